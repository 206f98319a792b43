"""The fused MoE op (quant/csrc/moe_experts.cpp through arch/moe.py's StackedExperts): a layer's routed
experts in one call give the per-expert loop's output (bf16: bit for bit; fp32: within the last bits of
exp, which the op computes with libm and torch with its own vector code, except a rare row where that bit
moves an activation's int8 code) (softmax top-k, renormalised top-k,
Llama 4's sigmoid-scaled input beside a shared expert; q8 and q4 experts; bf16 and int8-policy fp32
activations; more rows than a tile takes; experts on another rank), and an MoE model's decode step
compiles into one graph whose greedy tokens equal eager mode's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ferrylm.config import QuantConfig
from ferrylm.model.arch.moe import SparseMoeBlock
from ferrylm.model.attention import AttentionSpec, select_backend
from ferrylm.model.attention.cpu import cpu_fused_ops
from ferrylm.model.loaders.loader import Checkpoint, load_model
from ferrylm.model.loaders.model_source import resolve_model
from ferrylm.model.quant.kernels import load_quant_kernels
from tests.model.tiny_models import add_word_tokenizer, make_tiny_model

KERNELS = load_quant_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None or KERNELS.moe_experts_int8 is None,
                                reason="no int8-activation kernels here (AVX2 or AVX512-VNNI)")

# expert widths a multiple of 32 (the int8 tiles' block); qwen3_moe: softmax top 2 not renormalised,
# mixtral: renormalised, llama4: top 1 whose sigmoid scales the input, plus a shared expert
KINDS = {"qwen3_moe": {"moe_intermediate_size": 64}, "mixtral": {}, "llama4": {}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-fused")
    return {kind: add_word_tokenizer(make_tiny_model(kind, root / kind, **kw)) for kind, kw in KINDS.items()}


def _moe_blocks(directory: Path, method: str, dtype: torch.dtype) -> list[SparseMoeBlock]:
    checkpoint = Checkpoint(resolve_model(str(directory)))
    cpu = torch.device("cpu")
    backend = select_backend(AttentionSpec.for_model(checkpoint.config, 16, dtype, cpu), "auto")
    model = load_model(checkpoint, dtype, cpu, backend, fused_ops=cpu_fused_ops(cpu),
                       quantization=QuantConfig(method), int8_activations=dtype == torch.float32)
    return model.moe_blocks()


def _loop(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    stacked, block.stacked = block.stacked, None
    try:
        return block(x)
    finally:
        block.stacked = stacked


def _assert_loop_result(fused: torch.Tensor, loop: torch.Tensor, case) -> None:
    if fused.dtype == torch.bfloat16:  # every intermediate rounded to bf16 as eager rounds it
        assert torch.equal(fused, loop), case
    else:  # measured: <= 3.6e-7 of the largest value, but where exp's last bit moves an activation across
        # an int8 rounding boundary, that token's row moves by one code's worth (6.7e-4 seen: 1 row in 128)
        scale = loop.abs().max().item()
        rows_off = ((fused - loop).abs() > 1e-5 * scale).any(dim=-1)
        assert (fused - loop).abs().max().item() <= 2e-3 * scale, case
        assert rows_off.sum().item() <= max(1, rows_off.numel() // 32), case


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32-int8-policy"])
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_experts_equal_the_per_expert_loop(checkpoints, kind, method, dtype):
    blocks = _moe_blocks(checkpoints[kind], method, dtype)
    assert blocks and all(b.stacked is not None and b.fused_for(dtype) for b in blocks)
    gen = torch.Generator().manual_seed(0)
    calls: list[int] = []
    for block in blocks:
        hook = block.experts[0].register_forward_hook(lambda *_: calls.append(1))
        limit = block.stacked.int8_rows(dtype)
        for rows in (1, 5, 13, limit):  # 13: two chunks of a tile's 8 rows; the most the eager path fuses
            x = torch.randn(rows, block.gate.in_features, generator=gen).to(dtype)
            before = len(calls)
            fused = block(x)
            assert len(calls) == before, "the fused path ran an expert module"
            _assert_loop_result(fused, _loop(block, x), (kind, method, rows))
        hook.remove()
        # one row past the limit: eager mode runs the loop, whose experts take their own paths
        x = torch.randn(limit + 1, block.gate.in_features, generator=gen).to(dtype)
        block(x)
        assert calls, "past the int8 row limit the experts run one by one"


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_both_work_splits_give_the_loop_result(checkpoints, threads):
    """Whole experts per thread (at least as many active experts as threads) and 16-row tiles of an
    expert (fewer): the thread count picks the split; the result is the loop's either way."""
    blocks = _moe_blocks(checkpoints["qwen3_moe"], "int8", torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3, 13):
            x = torch.randn(rows, blocks[0].gate.in_features, generator=gen).bfloat16()
            for block in blocks:
                _assert_loop_result(block(x), _loop(block, x), (threads, rows))
    finally:
        torch.set_num_threads(before)


def test_experts_of_another_rank_are_skipped(checkpoints):
    """Expert parallelism: a rank holds a share of the experts (slots -1 elsewhere) and sums only theirs;
    the fused op equals the loop over the same local experts, and two halves add up to the whole."""
    blocks = _moe_blocks(checkpoints["mixtral"], "int8", torch.float32)
    block = blocks[0]
    x = torch.randn(7, block.gate.in_features, generator=torch.Generator().manual_seed(1))
    whole = block(x)
    halves = []
    for local in ({0, 1}, {2, 3}):
        block.local = local
        block.stack_experts()  # restacks the local experts (views of the first stack)
        assert block.stacked is not None and (block.stacked.slots >= 0).sum().item() == 2
        half = block(x)
        _assert_loop_result(half, _loop(block, x), local)
        halves.append(half)
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-5, atol=1e-6)


def test_a_bf16_router_runs_in_float32_and_rounds_as_its_bf16_matmul(checkpoints):
    """prepare_router keeps a float32 copy of a bf16 router (oneDNN's bf16 matmul costs ~15 us more a call at
    one row); its logits are the bf16 matmul's, rounded to bf16, up to its summation order, and a LoRA on the
    router (which only self.gate applies) turns the copy off."""
    blocks = _moe_blocks(checkpoints["qwen3_moe"], "int8", torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for block in blocks:
        assert block.router_f32 is not None and block.router_f32.dtype == torch.float32
        assert torch.equal(block.router_f32, block.gate.weight.float())
        x = torch.randn(5, block.gate.in_features, generator=gen).bfloat16()
        got, want = block.router_logits(x), block.gate(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
        # a router with adapters goes through its Linear (here: adapters resident, none on this step's rows)
        block.gate.lora = SimpleNamespace(step=SimpleNamespace(groups=SimpleNamespace(rows=None)))
        try:
            assert block.router_logits(x) is not got and torch.equal(block.router_logits(x), want)
        finally:
            block.gate.lora = None
    fp32 = _moe_blocks(checkpoints["qwen3_moe"], "int8", torch.float32)
    assert all(block.router_f32 is None for block in fp32)


def test_bad_arguments_are_errors_not_crashes(checkpoints):
    block = _moe_blocks(checkpoints["qwen3_moe"], "int8", torch.bfloat16)[0]
    st = block.stacked
    gu, dn = st.gate_up, st.down
    x = torch.randn(2, block.gate.in_features).bfloat16()
    logits = block.gate(x)

    def call(**change):
        args = dict(x=x, logits=logits, top_k=2, routing=0, slots=st.slots)
        args.update(change)
        return KERNELS.moe_experts_int8(args["x"], args["logits"], args["top_k"], args["routing"], args["slots"],
                                        gu.codes, gu.scales, gu.mins, gu.group, gu.q4,
                                        dn.codes, dn.scales, dn.mins, dn.group, dn.q4)

    assert call(x=x[:0], logits=logits[:0]).shape == (0, x.shape[1])
    for change, message in [({"top_k": 0}, "top_k"), ({"top_k": 99}, "top_k"), ({"routing": 7}, "routing"),
                            ({"slots": st.slots[:-1]}, "slots"), ({"slots": st.slots + 50}, "past"),
                            ({"logits": logits[:1]}, "logits")]:
        with pytest.raises(RuntimeError, match=message):
            call(**change)


def _counting(logits, rows: list[int]):
    def run(batch):
        rows.append(batch.num_seqs)
        return logits(batch)
    return run


def test_moe_decode_compiles_into_one_graph_with_eager_tokens(checkpoints, tmp_path, monkeypatch):
    """With its experts fused, a Qwen3-MoE decode step (int8 experts, bf16) compiles like a dense
    model's; the compiled engine's greedy tokens equal enforce_eager's, batched."""
    from ferrylm import LLM, SamplingParams

    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path / "cache"))
    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 3 * i, 8] * (1 + i)} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs, compiled_steps = {}, []
    for eager in (True, False):
        llm = LLM(str(checkpoints["qwen3_moe"]), dtype="bfloat16", quantization="int8", enforce_eager=eager,
                  max_num_seqs=4, max_model_len=128)
        runner = llm.engine.executor
        if not eager:
            step = runner.wait_compiled(timeout=900)
            assert step is not None, "the MoE decode step did not compile (see the warning logged)"
            monkeypatch.setattr(step, "logits", _counting(step.logits, compiled_steps))
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert max(compiled_steps) == 3, "decode steps did not run the compiled graphs"
    assert outputs[False] == outputs[True]
