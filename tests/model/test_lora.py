"""LoRA adapters in peft's format, chosen per request: FerryLM greedy equals peft's merged model
(merge_and_unload) token for token in float32, alone and in one mixed batch with the base model."""

from __future__ import annotations

import json

import pytest

from ferrylm.engine.adapters import AdapterBusy
from ferrylm.engine.llm import LLM
from ferrylm.engine.scheduler import RequestRejected
from ferrylm.executor import LoRAError
from ferrylm.lora_request import LoRARequest
from ferrylm.sampling_params import SamplingParams
from tests.model.lora_adapters import make_adapter, merged_greedy
from tests.model.tiny_models import add_word_tokenizer, make_tiny_model

pytest.importorskip("peft")

MAX_TOKENS = 32
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [1, 44, 45, 46], [1, 200, 201, 202, 203, 204, 205], [1, 5, 9, 33, 70, 100, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = add_word_tokenizer(make_tiny_model("llama", root / "base"))
    adapters = {
        "attn8": make_adapter(base, root / "attn8", 8, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=1),
        "all16": make_adapter(base, root / "all16", 16, seed=2, rslora=True),
        "mlp8": make_adapter(base, root / "mlp8", 8, ("gate_proj", "up_proj", "down_proj"), seed=3, alpha=4),
    }
    plan = [("attn8", 0), ("all16", 1), ("mlp8", 2), (None, 3)]  # (adapter, prompt) per request
    refs = [merged_greedy(base, adapters[name] if name else None, PROMPTS[p], MAX_TOKENS) for name, p in plan]
    return base, adapters, plan, refs


def _greedy(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outs]


def _requests(adapters, plan):
    return [LoRARequest(name, i + 1, str(adapters[name])) if name else None for i, (name, _) in enumerate(plan)]


@pytest.mark.parametrize("max_loras", [4, 1])
def test_mixed_batch_equals_peft_merged(tiny, max_loras):
    """Three adapters and the base model in one batch (max_loras=1: the scheduler runs one adapter's
    requests at a time), chunked prefill (8-token steps) and prefix caching on: every request's tokens
    are its merged twin's."""
    base, adapters, plan, refs = tiny
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=max_loras, max_lora_rank=16,
              max_num_batched_tokens=8)
    assert _greedy(llm, [PROMPTS[p] for _, p in plan], _requests(adapters, plan)) == refs


def test_each_adapter_alone_and_no_shared_kv(tiny):
    """Alone, in turn: prompt 3 (a prefix of prompt 0's first 12 tokens) runs after prompt 0 of another
    adapter; a shared KV block would carry attn8's K/V into the base model's answer."""
    base, adapters, plan, refs = tiny
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4)
    loras = _requests(adapters, plan)
    for (_, p), lora, ref in zip(plan, loras, refs):
        assert _greedy(llm, [PROMPTS[p]], [lora]) == [ref]
    assert llm.engine.adapters.get("attn8").rank == 8
    assert _greedy(llm, [PROMPTS[0]], [None])[0] != refs[0]  # the base model's own answer


def _copy_adapter(src, dst, edit=None, config_edit=None):
    dst.mkdir()
    settings = json.loads((src / "adapter_config.json").read_text())
    if config_edit:
        config_edit(settings)
    (dst / "adapter_config.json").write_text(json.dumps(settings))
    data = (src / "adapter_model.safetensors").read_bytes()
    (dst / "adapter_model.safetensors").write_bytes(edit(data) if edit else data)
    return dst


def test_bad_adapters_are_refused_naming_why(tiny, tmp_path):
    base, adapters, _, _ = tiny
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    cases = {
        "rank 16 is above --max-lora-rank 8": adapters["all16"],
        "corrupt": _copy_adapter(adapters["attn8"], tmp_path / "trunc", edit=lambda b: b[:len(b) // 2]),
        "use_dora": _copy_adapter(adapters["attn8"], tmp_path / "dora",
                                  config_edit=lambda s: s.update(use_dora=True)),
        "no adapter_config.json": tmp_path,
        "lora_A": _copy_adapter(adapters["attn8"], tmp_path / "rank", config_edit=lambda s: s.update(r=4)),
    }
    for reason, path in cases.items():
        with pytest.raises(LoRAError, match=reason):
            llm.engine.adapters.add("bad", str(path))
    assert llm.engine.adapters.list() == []
    with pytest.raises(RequestRejected, match="not loaded"):
        llm.engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), lora_name="missing")


def test_untargetable_module_is_refused(tiny, tmp_path):
    base, _, _, _ = tiny
    path = make_adapter(base, tmp_path / "head", 4, ("q_proj", "lm_head"), seed=4)
    llm = LLM(str(base), dtype="float32", enable_lora=True)
    with pytest.raises(LoRAError, match="lm_head"):
        llm.engine.adapters.add("head", str(path))


def test_unload_refused_while_its_requests_run(tiny):
    base, adapters, _, _ = tiny
    llm = LLM(str(base), dtype="float32", enable_lora=True)
    llm.engine.adapters.add("attn8", str(adapters["attn8"]))
    llm.engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True), lora_name="attn8")
    llm.engine.step()
    with pytest.raises(AdapterBusy, match="attn8"):
        llm.engine.adapters.remove("attn8")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.adapters.remove("attn8")
    assert llm.engine.adapters.list() == []


def test_lora_needs_enable_lora(tiny):
    base, adapters, _, _ = tiny
    llm = LLM(str(base), dtype="float32")
    with pytest.raises(Exception, match="--enable-lora"):
        llm.engine.adapters.add("attn8", str(adapters["attn8"]))


def test_adapter_on_packed_gguf_weights_equals_dequantized(tiny, tmp_path):
    """The deltas ride on whatever the base Linear is: a GGUF kept packed (Q4_0/Q4_1/Q8_0 blocks) with
    an adapter gives the logits of the same file dequantized to float with the same adapter."""
    import torch

    from ferrylm.config import LoRAConfig, QuantConfig
    from ferrylm.model.attention.torch_native import TorchNativeBackend
    from ferrylm.model.forward_batch import ForwardBatch
    from ferrylm.model.loaders.loader import Checkpoint, load_model
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.model.lora.manager import LoRAManager
    from ferrylm.scheduler_output import NewRequestData, SchedulerOutput
    from tests.model.test_quant_models import _write_tiny_gguf

    base, adapters, _, _ = tiny
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, base)
    checkpoint = Checkpoint(resolve_model(str(path)))
    prompt = PROMPTS[0]
    step = SchedulerOutput([], [NewRequestData("r", prompt, SamplingParams(), None, "all16")], [], 0)

    def logits(quantization: str | None, with_adapter: bool) -> torch.Tensor:
        model = load_model(checkpoint, torch.float32, torch.device("cpu"), TorchNativeBackend(),
                           quantization=None if quantization is None else QuantConfig.parse(quantization))
        lora = LoRAManager(model, LoRAConfig(enable_lora=True, max_loras=2), model.config, torch.float32, "cpu")
        lora.add("all16", str(adapters["all16"]))
        lora.track(step)
        cfg = model.config
        caches = [(torch.zeros(8, 16, cfg.num_kv_heads, cfg.head_dim), torch.zeros(8, 16, cfg.num_kv_heads,
                   cfg.head_dim)) for _ in range(cfg.num_layers)]
        batch = ForwardBatch.build([prompt], [0], [list(range(8))], 16)
        with torch.inference_mode(), lora.rows(["r" if with_adapter else "base"], [len(prompt)], "cpu"):
            return model.compute_logits(model(batch, caches))

    packed = logits(None, True)
    assert (packed - logits("none", True)).abs().max() <= 1e-5 * packed.abs().max()
    assert (packed - logits(None, False)).abs().max() > 1e-2 * packed.abs().max()  # the adapter did something


@pytest.mark.parametrize("extra", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                            "disable_by_batch_size": 8}},
    {"num_gpu_blocks_override": 7, "preemption_mode": "swap"},
    {"num_gpu_blocks_override": 7, "preemption_mode": "recompute"},
], ids=["ngram", "swap", "recompute"])
def test_speculation_and_preemption_keep_adapter_tokens(tiny, extra):
    """n-gram drafts are verified through each request's adapter; a request preempted (its blocks
    swapped out or dropped and recomputed) resumes through its adapter: tokens stay peft's."""
    base, adapters, plan, refs = tiny
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, block_size=8, **extra)
    assert _greedy(llm, [PROMPTS[p] for _, p in plan], _requests(adapters, plan)) == refs
    stats = llm.engine.stats()
    if "preemption_mode" in extra:
        assert stats.num_preemptions > 0
    else:
        assert stats.spec_decode_num_accepted_tokens > 0


def test_tensor_parallel_shards_the_adapters(tiny):
    """--tensor-parallel-size 2: each rank holds its slice of B (q/k/v, gate/up) or of A (o, down);
    the mixed batch's tokens are still peft's merged model's, and an adapter loaded while the ranks
    run reaches them all."""
    base, adapters, plan, refs = tiny
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, tensor_parallel_size=2)
    try:
        assert _greedy(llm, [PROMPTS[p] for _, p in plan], _requests(adapters, plan)) == refs
        llm.engine.adapters.remove("all16")
        assert _greedy(llm, [PROMPTS[1]], [_requests(adapters, plan)[1]]) == [refs[1]]  # loaded again
    finally:
        llm.shutdown()


def test_a_name_loaded_again_with_other_weights_never_reads_the_old_cache(tiny):
    """Same prompt, same adapter name, first attn8's weights then all16's: the second answer is
    all16's, not one continued from K/V the old weights left in the prefix cache."""
    base, adapters, plan, refs = tiny
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=16, block_size=4)
    prompt = PROMPTS[1] * 4  # 16 tokens: full blocks to cache
    old = _greedy(llm, [prompt], [LoRARequest("x", 1, str(adapters["attn8"]))])
    new = _greedy(llm, [prompt], [LoRARequest("x", 1, str(adapters["all16"]))])
    fresh = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=16, block_size=4)
    assert new == _greedy(fresh, [prompt], [LoRARequest("y", 1, str(adapters["all16"]))]) != old
