"""Triton paged attention for CUDA: KV write, varlen causal prefill, split-K (FlashDecoding) decode.

torch_native.py is the oracle for every kernel here. The module imports without triton or CUDA
(kernels are only defined when triton is importable); on CPU tensors the kernels run only under
TRITON_INTERPRET=1, set before triton is imported, and then compute in float32 because the
interpreter's bf16 dot is unreliable.

Grouped-query attention is packed: the G query heads that share a KV head are rows of the same
tile, so each K/V row is loaded once per group. Row r of a prefill tile is query token r // G_PAD,
head r % G_PAD of the group. Query i of sequence b sits at position seq_len - query_len + i (this
covers prefix-cache hits and chunked prefill) and sees keys 0..position, or on a sliding-window layer
only the last `window` of them (position - window + 1..position; the kernels start their key loops
there).

Quantized caches (--kv-cache-dtype, layout in kv_quant.py) are told apart by the cache pointer's
element type (8-bit: int8, fp8e4nv, fp8e5; a compile-time branch, one specialisation each): the write kernel
quantizes (fp8: x / per-tensor scale, saturated; int8: fp16 amax / 127 per (token, KV head) row,
codes rounded half to even, as kv_quant.quantize), the attention kernels dequantize each K/V tile
right after loading it (codes times scale, in the query's dtype). The scale pointers of a plain
cache are the caches themselves, never read.
"""

# No `from __future__ import annotations`: triton reads the kernels' `tl.constexpr` annotations.
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ferrylm.model.attention import kv_quant
from ferrylm.model.attention.base import AttentionSpec, attn_metadata
from ferrylm.model.forward_batch import ForwardBatch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: importable, TritonBackend() raises
    triton = tl = None

LOG2E = 1.4426950408889634
MAX_DECODE_PARTITIONS = 64
MIN_KEYS_PER_PARTITION = 64


def triton_available() -> bool:
    """True when triton imported; kernels still need CUDA tensors or TRITON_INTERPRET=1."""
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _quantize_rows(x, cache_ptr, scale_ptr, slot, h, mask, NUM_KV_HEADS: tl.constexpr):
        """Codes of one token's [HKV_PAD, D_PAD] rows for `cache_ptr`'s type; int8 also stores the
        fp16 row scales."""
        ty = cache_ptr.dtype.element_ty
        x = tl.where(mask, x.to(tl.float32), 0.0)
        if ty == tl.int8:
            s16 = (tl.max(tl.abs(x), 1) / 127.0).to(tl.float16)
            tl.store(scale_ptr + slot * NUM_KV_HEADS + h, s16, mask=h < NUM_KV_HEADS)
            r = x / tl.maximum(s16.to(tl.float32), 1e-30)[:, None]
            r = (r + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds an fp32 |r| < 2**22 half to even
            codes = tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)
        elif ty == tl.float8e4nv:
            codes = tl.minimum(tl.maximum(x / tl.load(scale_ptr), -448.0), 448.0).to(ty)
        else:
            codes = tl.minimum(tl.maximum(x / tl.load(scale_ptr), -57344.0), 57344.0).to(ty)
        return codes

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                         NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         HKV_PAD: tl.constexpr, D_PAD: tl.constexpr):
        """One program per token: copy (or quantize) its [Hkv, D] K and V rows into slot
        block*BLOCK_SIZE+offset."""
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        h = tl.arange(0, HKV_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
        if k_cache_ptr.dtype.element_ty.primitive_bitwidth == 8:  # int8 / fp8: compile-time branch
            heads = tl.arange(0, HKV_PAD)
            k = _quantize_rows(k, k_cache_ptr, k_scale_ptr, slot, heads, mask, NUM_KV_HEADS)
            v = _quantize_rows(v, v_cache_ptr, v_scale_ptr, slot, heads, mask, NUM_KV_HEADS)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequantize(x, cache_ptr, scale_ptr, row, n_ok, HEAD_DIM: tl.constexpr, ROW_AXIS: tl.constexpr):
        """A loaded K/V tile back in fp32: fp8 times the per-tensor scale, int8 codes times the fp16
        scale of their row (cache row offset // HEAD_DIM: the cache is contiguous); ROW_AXIS says
        which axis of the tile runs over keys."""
        if cache_ptr.dtype.element_ty == tl.int8:
            s = tl.load(scale_ptr + row // HEAD_DIM, mask=n_ok, other=0.0).to(tl.float32)
            if ROW_AXIS == 0:
                out = x.to(tl.float32) * s[:, None]
            else:
                out = x.to(tl.float32) * s[None, :]
        else:
            out = x.to(tl.float32) * tl.load(scale_ptr)
        return out

    @triton.jit
    def _attend_range(q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, kvh, lo, hi, m_i, l_i, acc, scale_log2,
                      stride_cb, stride_cs, stride_ch,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, D_PAD: tl.constexpr,
                      BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                      k_scale_ptr, v_scale_ptr, window, HAS_WINDOW: tl.constexpr):
        """Online softmax of the q rows over keys lo..hi of one sequence, read through its block table.
        CAUSAL rows see keys up to their position, and with HAS_WINDOW only the last `window` of those."""
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            block = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            row = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kvh * stride_ch
            k = tl.load(k_cache_ptr + row[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if k_cache_ptr.dtype.element_ty.primitive_bitwidth == 8:  # int8 / fp8: compile-time branch
                k = _dequantize(k, k_cache_ptr, k_scale_ptr, row, n_ok, HEAD_DIM, 1).to(q.dtype)
                v = _dequantize(v, v_cache_ptr, v_scale_ptr, row, n_ok, HEAD_DIM, 0).to(q.dtype)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, k, input_precision=DOT_PREC) * scale_log2  # [M, BLOCK_N], log2 domain
            keep = n_ok[None, :]
            if CAUSAL:
                keep = keep & (n[None, :] <= q_pos[:, None])
                if HAS_WINDOW:
                    keep = keep & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit(do_not_specialize=["num_tiles", "stride_bt"])  # vary per batch: avoid recompiles
    def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, seq_lens_ptr, query_start_ptr,
                        tiles_ptr, num_tiles, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
                        stride_cb, stride_cs, stride_ch, stride_bt,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, k_scale_ptr, v_scale_ptr, window,
                        HAS_WINDOW: tl.constexpr):
        """Grid (tiles, kv heads); tile i = (sequence tiles[i], first query tiles[num_tiles + i]). With a
        window, the key loop starts at the BLOCK_N tile holding the first key the tile's first query sees."""
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.load(tiles_ptr + tile)
        q0 = tl.load(tiles_ptr + num_tiles + tile)
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        q_start = tl.load(query_start_ptr + b).to(tl.int32)
        q_len = tl.load(query_start_ptr + b + 1).to(tl.int32) - q_start
        ctx = seq_len - q_len
        r = tl.arange(0, BLOCK_Q * G_PAD)
        qi = q0 + r // G_PAD
        g = r % G_PAD
        head = kvh * GROUP + g
        row_ok = (qi < q_len) & (g < GROUP)
        d = tl.arange(0, D_PAD)
        io_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=io_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_Q * G_PAD], -1.0e30, tl.float32)  # finite: exp2(m_old - m_new) stays defined
        l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
        hi = tl.minimum(seq_len, ctx + q0 + BLOCK_Q)  # keys beyond the tile's last query are masked anyway
        lo = 0
        if HAS_WINDOW:
            lo = (tl.maximum(ctx + q0 - window + 1, 0) // BLOCK_N) * BLOCK_N
        m_i, l_i, acc = _attend_range(q, ctx + qi, k_cache_ptr, v_cache_ptr, tables_ptr + b * stride_bt, kvh, lo,
                                      hi, m_i, l_i, acc, scale_log2, stride_cb, stride_cs, stride_ch,
                                      HEAD_DIM, BLOCK_SIZE, D_PAD, BLOCK_N, True, UPCAST, DOT_PREC,
                                      k_scale_ptr, v_scale_ptr, window, HAS_WINDOW)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + qi)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)

    @triton.jit
    def _decode_row(rows_ptr, query_start_ptr, GATHER: tl.constexpr):
        """(sequence, token row) of decode program i: itself in a decode-only batch, else looked up."""
        i = tl.program_id(0)
        if GATHER:
            b = tl.load(rows_ptr + i)
            return b, tl.load(query_start_ptr + b)
        else:
            return i, i

    @triton.jit(do_not_specialize=["num_parts", "stride_bt"])
    def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, tables_ptr, seq_lens_ptr, rows_ptr,
                       query_start_ptr, num_parts, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
                       stride_cb, stride_cs, stride_ch, stride_bt, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
                       BLOCK_N: tl.constexpr, GATHER: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                       k_scale_ptr, v_scale_ptr, window, HAS_WINDOW: tl.constexpr):
        """Grid (decode rows, kv heads, partitions). Each sequence's keys (with a window, its last
        `window` keys) are cut into num_parts equal ranges of whole BLOCK_N tiles, computed from its
        device-side length, so the grid depends on shapes only (CUDA-graph safe). With num_parts > 1 (a
        runtime branch: one compiled kernel serves both), it writes (acc, m, l) per partition for
        _reduce_kernel, else the output."""
        b, tok = _decode_row(rows_ptr, query_start_ptr, GATHER)
        i = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        first = 0
        if HAS_WINDOW:
            first = tl.maximum(seq_len - window, 0)
        part_len = tl.cdiv(tl.cdiv(seq_len - first, num_parts), BLOCK_N) * BLOCK_N
        lo = first + part * part_len
        hi = tl.minimum(lo + part_len, seq_len)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        head = kvh * GROUP + g
        io_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([G_PAD], -1.0e30, tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        m_i, l_i, acc = _attend_range(q, m_i, k_cache_ptr, v_cache_ptr, tables_ptr + b * stride_bt, kvh, lo, hi,
                                      m_i, l_i, acc, scale_log2, stride_cb, stride_cs, stride_ch,
                                      HEAD_DIM, BLOCK_SIZE, D_PAD, BLOCK_N, False, UPCAST, DOT_PREC,
                                      k_scale_ptr, v_scale_ptr, window, HAS_WINDOW)
        if num_parts > 1:
            # partials laid out [rows, H, num_parts, D_PAD + 2]: acc (unnormalised), then m, then l
            base = ((i * NUM_HEADS + head) * num_parts + part).to(tl.int64) * (D_PAD + 2)
            g_ok = g < GROUP
            tl.store(part_ptr + base[:, None] + d[None, :], acc, mask=g_ok[:, None])
            tl.store(part_ptr + base + D_PAD, m_i, mask=g_ok)
            tl.store(part_ptr + base + D_PAD + 1, l_i, mask=g_ok)
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=io_mask)

    @triton.jit(do_not_specialize=["num_parts"])
    def _reduce_kernel(part_ptr, out_ptr, rows_ptr, query_start_ptr, num_parts, stride_ot, stride_oh,
                       NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GATHER: tl.constexpr):
        """Grid (decode rows, heads): merge the partitions' softmax states (empty ones carry l = 0)."""
        _, tok = _decode_row(rows_ptr, query_start_ptr, GATHER)
        i = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, D_PAD)
        base = ((i * NUM_HEADS + h) * num_parts).to(tl.int64) * (D_PAD + 2)
        m = tl.full([D_PAD], -1.0e30, tl.float32)  # kept as vectors: loop-carried types stay simple
        l = tl.zeros([D_PAD], tl.float32)
        acc = tl.zeros([D_PAD], tl.float32)
        for p in range(0, num_parts):
            row = part_ptr + base + p * (D_PAD + 2)
            m_p = tl.load(row + D_PAD)
            l_p = tl.load(row + D_PAD + 1)
            m_new = tl.maximum(m, m_p)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(m_p - m_new)
            acc = acc * alpha + tl.load(row + d) * w
            l = l * alpha + l_p * w
            m = m_new
        out = acc / tl.where(l == 0.0, 1.0, l)
        tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes: large on GPUs, small under the interpreter (it runs every program in numpy)."""

    prefill_rows: int  # query rows (tokens x padded group) per prefill program
    prefill_keys: int
    prefill_warps: int
    decode_keys: int
    decode_warps: int
    num_stages: int
    target_programs: int  # decode programs wanted to fill the GPU (drives the split-K factor)

    @classmethod
    def for_device(cls, device: torch.device, head_dim: int, dtype: torch.dtype) -> "TileConfig":
        if device.type != "cuda":
            return cls(16, 16, 1, 16, 1, 1, 1)
        return cls.for_gpu(head_dim, dtype, torch.cuda.get_device_properties(device).multi_processor_count)

    @classmethod
    def for_gpu(cls, head_dim: int, dtype: torch.dtype, num_sms: int) -> "TileConfig":
        """Chosen so that ptxas reports no register spills on sm_90 (head dim 64 and 128); fp32 runs
        IEEE dots for parity checks only and gets small tiles."""
        big = head_dim > 64
        if dtype == torch.float32:
            return cls(64, 32, 4, 32, 4, 2, 2 * num_sms)
        return cls(128, 32 if big else 64, 8, 16 if big else 32, 4, 2, 2 * num_sms)


def _kernel_flags(q: torch.Tensor) -> dict:
    """fp32 math under the interpreter; IEEE fp32 dots on GPU fp32 (TF32 would break fp32 parity)."""
    fp32 = q.dtype == torch.float32 or not q.is_cuda
    return {"UPCAST": not q.is_cuda, "DOT_PREC": "ieee" if fp32 else "tf32"}


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' k_scale_ptr / v_scale_ptr: a quantized cache's scales (kv_quant.scales), else
    the caches themselves (the kernels' plain branch never reads them)."""
    if kv_quant.is_quantized(k_cache):
        return kv_quant.scales(k_cache), kv_quant.scales(v_cache)
    return k_cache, v_cache


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows ([T, Hkv, D], any row stride) into their cache slots."""
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k_scale, v_scale = kv_scales(k_cache, v_cache)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], HKV_PAD=_pow2(num_kv_heads), D_PAD=_pow2(head_dim, 16))


def _block_q(group: int, cfg: TileConfig) -> int:
    """Query tokens per prefill tile: the tile's rows hold every (padded) head of the group."""
    g_pad = _pow2(group)
    return max(cfg.prefill_rows, g_pad) // g_pad


def prefill_tiles(query_lens: list[int], block_q: int) -> list[tuple[int, int]]:
    """(sequence, first query) of every prefill tile (sequences with more than one query); a
    sequence's later, longer-running tiles first."""
    return [(b, q0) for b, n in enumerate(query_lens) if n > 1 for q0 in reversed(range(0, n, block_q))]


class BatchPlan(NamedTuple):
    """Launch tensors of a batch with prefill rows, built once per step from host lists (one H2D copy)."""

    tiles: torch.Tensor  # int32 [2, num_tiles]: sequence, first query
    decode_rows: torch.Tensor  # int32 [num_decode]: sequences with one query
    num_tiles: int
    num_decode: int

    @classmethod
    def build(cls, batch: ForwardBatch, block_q: int, device: torch.device) -> "BatchPlan":
        tiles = prefill_tiles(batch.query_lens_list, block_q)
        decode = [b for b, n in enumerate(batch.query_lens_list) if n == 1]
        flat = torch.tensor([b for b, _ in tiles] + [q0 for _, q0 in tiles] + decode, dtype=torch.int32)
        flat = flat.to(device)
        n = len(tiles)
        return cls(flat[:2 * n].view(2, n), flat[2 * n:], n, len(decode))


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                  plan: BatchPlan, scale: float, cfg: TileConfig, out: torch.Tensor, window: int | None = None) -> None:
    """Causal varlen attention of the rows of sequences with more than one query, into `out`; with a
    `window`, a query at position p sees keys p - window + 1 .. p."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    group = q.shape[1] // num_kv_heads
    k_scale, v_scale = kv_scales(k_cache, v_cache)
    _prefill_kernel[(plan.num_tiles, num_kv_heads)](
        q, k_cache, v_cache, out, batch.block_tables, batch.seq_lens, batch.query_start_loc, plan.tiles,
        plan.num_tiles, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), batch.block_tables.stride(0), GROUP=group, HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], G_PAD=_pow2(group), BLOCK_Q=_block_q(group, cfg), D_PAD=_pow2(head_dim, 16),
        BLOCK_N=cfg.prefill_keys, num_warps=cfg.prefill_warps, num_stages=cfg.num_stages, k_scale_ptr=k_scale,
        v_scale_ptr=v_scale, window=window or 0, HAS_WINDOW=window is not None, **_kernel_flags(q))


def decode_partitions(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int,
                      target_programs: int) -> int:
    """Split-K factor from shapes only (never from lengths, so a captured graph stays valid)."""
    wanted = -(-target_programs // max(1, num_seqs * num_kv_heads))
    useful = -(-max_blocks * block_size // MIN_KEYS_PER_PARTITION)
    return max(1, min(wanted, useful, MAX_DECODE_PARTITIONS))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float,
                 num_parts: int, cfg: TileConfig, out: torch.Tensor, plan: BatchPlan | None = None,
                 window: int | None = None) -> None:
    """Single-query rows into `out`: every row of a decode-only batch (plan None, q row b is sequence
    b), else plan.decode_rows. FlashDecoding when num_parts > 1. With a `window`, only each
    sequence's last `window` keys."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[-2]
    group = num_heads // num_kv_heads
    d_pad = _pow2(head_dim, 16)
    num_rows = batch.num_seqs if plan is None else plan.num_decode
    rows = batch.query_start_loc if plan is None else plan.decode_rows  # not read without GATHER
    split = num_parts > 1
    partials = torch.empty((num_rows, num_heads, num_parts, d_pad + 2) if split else (1,),
                           dtype=torch.float32, device=q.device)
    k_scale, v_scale = kv_scales(k_cache, v_cache)
    _decode_kernel[(num_rows, num_kv_heads, num_parts)](
        q, k_cache, v_cache, out, partials, batch.block_tables, batch.seq_lens, rows, batch.query_start_loc,
        num_parts, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), batch.block_tables.stride(0), NUM_HEADS=num_heads, GROUP=group,
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], G_PAD=_pow2(group, 16), D_PAD=d_pad, BLOCK_N=cfg.decode_keys,
        GATHER=plan is not None, num_warps=cfg.decode_warps, num_stages=cfg.num_stages, k_scale_ptr=k_scale,
        v_scale_ptr=v_scale, window=window or 0, HAS_WINDOW=window is not None, **_kernel_flags(q))
    if split:
        _reduce_kernel[(num_rows, num_heads)](partials, out, rows, batch.query_start_loc, num_parts, out.stride(0),
                                              out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad,
                                              GATHER=plan is not None)


class TritonMetadata(NamedTuple):
    """What TritonBackend.prepare derives from a batch once per step; every layer launches from it."""

    plan: BatchPlan | None  # None for a decode-only batch: its kernels launch from shapes alone
    num_decode: int  # single-query rows
    decode_partitions: int  # split-K factor of the decode kernel (0 without decode rows)


class TritonBackend:
    """AttentionBackend for CUDA. Single-query rows take the split-K decode kernel, rows of longer
    chunks the varlen prefill kernel. A decode-only batch's metadata holds no tensors and depends on
    its shapes only, so CudaGraphRunner can capture it. Sliding-window layers (Gemma 3) pass their
    window: a compile-time flag specialises the kernels, whose key loops start at the window."""

    supports_cuda_graphs = True
    supports_quantized_kv = True  # fp8 / int8 caches (kv_quant.py): kernels specialised on the cache type
    supports_sliding_window = True

    def __init__(self, spec: AttentionSpec, decode_partitions: int | None = None):
        """`decode_partitions` forces the split-K factor (tests); None picks it from the batch shape."""
        if triton is None:
            raise RuntimeError("TritonBackend needs the triton package (pip install triton)")
        self.spec = spec
        self.forced_partitions = decode_partitions
        self.cfg = TileConfig.for_device(spec.device, spec.head_dim, spec.dtype)
        self.block_q = _block_q(spec.num_heads // spec.num_kv_heads, self.cfg)

    def prepare(self, batch: ForwardBatch) -> TritonMetadata:
        plan = None if batch.is_decode_only else BatchPlan.build(batch, self.block_q, batch.block_tables.device)
        num_decode = batch.num_seqs if plan is None else plan.num_decode
        parts = 0
        if num_decode:
            spec = self.spec
            parts = self.forced_partitions or decode_partitions(
                num_decode, spec.num_kv_heads, batch.block_tables.shape[1], spec.block_size, self.cfg.target_programs)
        return TritonMetadata(plan, num_decode, parts)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float, window: int | None = None) -> torch.Tensor:
        meta = attn_metadata(batch, TritonMetadata)
        if not q.is_cuda and not _interpreting():
            raise RuntimeError("TritonBackend on CPU tensors needs TRITON_INTERPRET=1 set before importing triton")
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        q = _last_dim_contiguous(q)
        out = torch.empty_like(q)
        if meta.plan is not None:
            paged_prefill(q, k_cache, v_cache, batch, meta.plan, scale, self.cfg, out, window)
        if meta.num_decode:
            paged_decode(q, k_cache, v_cache, batch, scale, meta.decode_partitions, self.cfg, out, meta.plan, window)
        return out
