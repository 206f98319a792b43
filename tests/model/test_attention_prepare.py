"""AttentionBackend.prepare(batch): once per step whatever the depth, and the same bookkeeping the
layers used to redo each time (decode rows, prefill chunks and masks, the Triton launch plan)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from ferrylm.model.attention import AttentionSpec, select_backend
from ferrylm.model.attention.cpu import CpuBackend
from ferrylm.model.attention.metadata import PagedMetadata, split_batch
from ferrylm.model.attention.torch_native import TorchNativeBackend
from ferrylm.model.forward_batch import ForwardBatch
from tests.gpu.random_model import build_engine, build_runner, generate_greedy, model_config

BLOCK = 4


def _mixed_batch() -> ForwardBatch:
    """Decode rows around prefill chunks: a fresh prompt and a chunk after a cached prefix."""
    query_lens, context_lens = [1, 6, 1, 5, 1], [9, 0, 3, 7, 14]
    tables, next_block = [], 40
    for q, c in zip(query_lens, context_lens):
        n = -(-(q + c) // BLOCK)
        tables.append(list(range(next_block, next_block - n, -1)))
        next_block -= n
    return ForwardBatch.build([[3] * q for q in query_lens], context_lens, tables, BLOCK)


def _instrument(backend):
    """Count prepare() calls and record which metadata object every layer's forward() received."""
    calls = {"prepare": 0, "seen": []}
    prepare, forward = backend.prepare, backend.forward

    def counting_prepare(batch):
        calls["prepare"] += 1
        return prepare(batch)

    def recording_forward(q, k, v, k_cache, v_cache, batch, scale):
        calls["seen"].append(batch.attn_metadata)
        return forward(q, k, v, k_cache, v_cache, batch, scale)

    backend.prepare, backend.forward = counting_prepare, recording_forward
    return calls


@pytest.mark.parametrize("attention", ["torch", "auto"])
@pytest.mark.parametrize("num_layers", [1, 5])
def test_prepare_runs_once_per_step_whatever_the_depth(attention, num_layers):
    config = dataclasses.replace(model_config("tiny", 128), num_layers=num_layers)
    runner = build_runner(config, device="cpu", dtype=torch.float32, num_blocks=32, max_model_len=128,
                          attention=attention, block_size=BLOCK)
    calls = _instrument(runner.attn_backend)
    steps = []
    execute = runner.execute

    def counting_execute(output):
        steps.append(bool(output.scheduled))
        return execute(output)

    runner.execute = counting_execute
    engine = build_engine(runner, 32, 128, max_num_seqs=4, max_num_batched_tokens=8, block_size=BLOCK)
    outputs = generate_greedy(engine, [[5 + j for j in range(11)], [9, 4, 2]], 4)  # chunked, mixed, decode
    assert all(len(o) == 4 for o in outputs)
    forward_steps = sum(steps)
    assert forward_steps > 3 and calls["prepare"] == forward_steps
    assert len(calls["seen"]) == forward_steps * num_layers
    per_step = [calls["seen"][i:i + num_layers] for i in range(0, len(calls["seen"]), num_layers)]
    for step in per_step:  # every layer of a step reads the one object prepared for it
        assert step[0] is not None and all(m is step[0] for m in step)
    assert len({id(step[0]) for step in per_step}) == forward_steps  # a fresh metadata object each step


def test_model_prepares_once_when_the_caller_did_not():
    config = dataclasses.replace(model_config("tiny", 128), num_layers=3)
    runner = build_runner(config, device="cpu", dtype=torch.float32, num_blocks=48, max_model_len=128,
                          attention="torch", block_size=BLOCK)
    calls = _instrument(runner.attn_backend)
    with torch.inference_mode():
        runner.model(_mixed_batch(), runner.kv_caches)
    assert calls["prepare"] == 1 and len(calls["seen"]) == 3 and len({id(m) for m in calls["seen"]}) == 1


def test_paged_metadata_matches_the_per_layer_bookkeeping():
    """split_batch against what TorchNativeBackend/CpuBackend computed inside every layer before."""
    batch = _mixed_batch()
    meta = split_batch(batch)
    assert not meta.decode_only
    rows = [b for b, n in enumerate(batch.query_lens_list) if n == 1]
    rows_t = torch.tensor(rows, dtype=torch.int64)
    assert torch.equal(meta.decode.token_idx, batch.query_start_loc.index_select(0, rows_t))
    assert torch.equal(meta.decode.block_tables, batch.block_tables.index_select(0, rows_t))
    assert torch.equal(meta.decode.seq_lens, batch.seq_lens.index_select(0, rows_t))
    assert meta.decode.max_seq_len == max(batch.seq_lens_list[b] for b in rows)
    starts = batch.query_start_loc.tolist()
    chunks = [(b, n) for b, n in enumerate(batch.query_lens_list) if n > 1]
    assert [(c.start, c.length, c.seq_len) for c in meta.prefill] == [
        (starts[b], n, batch.seq_lens_list[b]) for b, n in chunks]
    for chunk, (b, n) in zip(meta.prefill, chunks):
        seq_len = batch.seq_lens_list[b]
        assert torch.equal(chunk.block_table, batch.block_tables[b])
        if n == seq_len:
            assert chunk.mask is None
        else:
            q_pos = torch.arange(seq_len - n, seq_len)
            assert torch.equal(chunk.mask, torch.arange(seq_len)[None, :] <= q_pos[:, None])


def test_decode_only_metadata_is_the_batch_itself():
    batch = ForwardBatch.build([[1], [2], [3]], [0, 5, 9], [[0], [1, 2], [3, 4, 5]], BLOCK)
    meta = split_batch(batch)
    assert meta.decode_only and meta.prefill == ()
    assert meta.decode.block_tables is batch.block_tables and meta.decode.seq_lens is batch.seq_lens
    assert meta.decode.token_idx.tolist() == [0, 1, 2] and meta.decode.max_seq_len == 10


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("forced", [None, 3])
def test_triton_metadata_matches_the_per_layer_plan(forced):
    from ferrylm.model.attention.triton import BatchPlan, TileConfig, TritonBackend, _block_q, decode_partitions

    heads, kv_heads, head_dim = 6, 2, 16
    spec = AttentionSpec(heads, kv_heads, head_dim, BLOCK, torch.float32, torch.device("cpu"))
    backend = TritonBackend(spec, forced)
    cfg = TileConfig.for_device(spec.device, head_dim, torch.float32)
    batch = _mixed_batch()
    meta = backend.prepare(batch)
    want = BatchPlan.build(batch, _block_q(heads // kv_heads, cfg), torch.device("cpu"))
    assert torch.equal(meta.plan.tiles, want.tiles) and torch.equal(meta.plan.decode_rows, want.decode_rows)
    assert meta.plan.num_tiles == want.num_tiles and meta.num_decode == want.num_decode == 3
    auto = decode_partitions(3, kv_heads, batch.block_tables.shape[1], BLOCK, cfg.target_programs)
    assert meta.decode_partitions == (forced or auto)
    decode = ForwardBatch.build([[1], [2]], [3, 30], [[0], list(range(1, 9))], BLOCK)
    meta = backend.prepare(decode)
    assert meta.plan is None and meta.num_decode == 2  # shapes only: what a CUDA graph captures
    assert meta.decode_partitions == (forced or decode_partitions(2, kv_heads, 8, BLOCK, cfg.target_programs))


def test_forward_refuses_missing_or_foreign_metadata():
    batch = ForwardBatch.build([[1, 2]], [0], [[0]], BLOCK)
    q, kv = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    caches = [torch.zeros(2, BLOCK, 1, 8) for _ in range(2)]
    backend = TorchNativeBackend()
    with pytest.raises(ValueError, match="prepare"):
        backend.forward(q, kv, kv, caches[0], caches[1], batch, 1.0)
    with pytest.raises(ValueError, match="PagedMetadata"):
        backend.forward(q, kv, kv, caches[0], caches[1], batch.with_attn_metadata(object()), 1.0)
    out = backend.forward(q, kv, kv, caches[0], caches[1], batch.with_attn_metadata(backend.prepare(batch)), 1.0)
    assert out.shape == q.shape and batch.attn_metadata is None  # attaching copies, never mutates


def test_select_backend():
    spec = AttentionSpec(4, 2, 16, BLOCK, torch.float32, torch.device("cpu"))
    assert type(select_backend(spec, "torch")) is TorchNativeBackend
    from ferrylm.model.attention.cpu import cpu_fused_ops

    auto = select_backend(spec)
    assert type(auto) is (CpuBackend if cpu_fused_ops(spec.device) is not None else TorchNativeBackend)
    assert isinstance(auto.prepare(_mixed_batch()), PagedMetadata)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend(spec, "flash")
