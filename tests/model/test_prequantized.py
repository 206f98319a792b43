"""AWQ, GPTQ and compressed-tensors (W4A16 pack-quantized) int4 checkpoints written here with the
formats' documented packing (compressed-tensors' own packer) from random codes, zeros and fp16 scales
(no hub download), loaded as they are: the codes in memory are the file's,
the packed kernel equals a dequantize-then-matmul twin (the same random model saved in float32),
and greedy output equals the twin's. GPTQ act-order (a shuffled g_idx) and the v2 zero convention
included; what FerryLM cannot honour is a clear error naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from ferrylm import SamplingParams
from ferrylm.config import ConfigError, QuantConfig
from ferrylm.model.forward_batch import ForwardBatch
from ferrylm.model.loaders.loader import Checkpoint, load_model
from ferrylm.model.loaders.model_source import ModelLoadError, resolve_model
from ferrylm.model.quant.layout import unpack_q4
from tests.model.tiny_models import add_word_tokenizer, assert_same_greedy, make_tiny_model

safetensors_torch = pytest.importorskip("safetensors.torch")

GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 → [...] int32, nibble p at bits 4p."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return (nibbles.long() << shifts).sum(-1).to(torch.int64).to(torch.int32)  # wraps like the C packers


def _pack_awq(q: torch.Tensor) -> torch.Tensor:
    """[R, N] → [R, N/8]: nibble p of word j holds column 8j + AWQ_ORDER[p]."""
    r, n = q.shape
    return _words(q.reshape(r, n // 8, 8)[..., list(AWQ_ORDER)])


def _pack_gptq_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] → [K/8, N]: nibble p of word row j holds input 8j + p."""
    k, n = q.shape
    return _words(q.reshape(k // 8, 8, n).permute(0, 2, 1))


def _pack_gptq_cols(z: torch.Tensor) -> torch.Tensor:
    r, n = z.shape
    return _words(z.reshape(r, n // 8, 8))


def _compressed_tensors_config(symmetric: bool, act_order: bool) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": GROUP,
               "dynamic": False, "actorder": "group" if act_order else None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}}}


def _quantized_pair(tmp_path, method: str, act_order: str = "", v2: bool = False, asym: bool = False):
    """(quantized dir, float twin dir, {module: codes [N, K] in file input order}). `act_order`:
    "shared" (modules reading the same input share one order, as GPTQ's Hessian gives q/k/v) or
    "own" (each module its own). `asym`: compressed-tensors with zero points."""
    twin = make_tiny_model("qwen2", tmp_path / "twin")  # qwen2: q/k/v biases stay float beside int4 weights
    state = safetensors_torch.load_file(str(twin / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    quantized, codes, orders = {}, {}, {}
    for name in list(state):
        if not any(name.endswith(f"{m}.weight") for m in LINEARS):
            quantized[name] = state[name]
            continue
        module = name.removesuffix(".weight")
        n, k = state[name].shape
        groups = k // GROUP
        q = torch.randint(0, 16, (k, n), generator=gen)
        z = torch.randint(0, 16, (groups, n), generator=gen) if method == "awq" or asym else \
            torch.full((groups, n), 8)
        s = (torch.rand(groups, n, generator=gen) * 0.04 + 0.01).half()
        g_idx = torch.arange(k) // GROUP
        if act_order:  # GPTQ desc_act: inputs quantized in a shuffled order, groups follow that order
            key = (name.split(".self_attn")[0], k) if act_order == "shared" else name
            g_idx = orders.setdefault(key, g_idx[torch.randperm(k, generator=gen)])
        w = (q - z[g_idx]).float() * s.float()[g_idx]  # [K, N], the formats' meaning
        state[name] = w.t().contiguous()
        codes[module] = q.t().to(torch.uint8)
        if method == "awq":
            quantized |= {f"{module}.qweight": _pack_awq(q), f"{module}.qzeros": _pack_awq(z), f"{module}.scales": s}
        elif method == "compressed-tensors":  # signed codes and zeros, packed by the library that writes them
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

            quantized |= {f"{module}.weight_packed": pack_to_int32((q.t() - 8).to(torch.int8), 4, packed_dim=1),
                          f"{module}.weight_scale": s.t().contiguous(), f"{module}.weight_shape": torch.tensor([n, k])}
            if asym:
                quantized[f"{module}.weight_zero_point"] = pack_to_int32((z.t() - 8).to(torch.int8), 4, packed_dim=0)
            if act_order:
                quantized[f"{module}.weight_g_idx"] = g_idx.to(torch.int32)
        else:
            stored = z if v2 else z - 1
            quantized |= {f"{module}.qweight": _pack_gptq_rows(q), f"{module}.qzeros": _pack_gptq_cols(stored),
                          f"{module}.scales": s, f"{module}.g_idx": g_idx.to(torch.int32)}
    safetensors_torch.save_file(state, str(twin / "model.safetensors"))
    qdir = tmp_path / method
    qdir.mkdir()
    safetensors_torch.save_file(quantized, str(qdir / "model.safetensors"))
    config = json.loads((twin / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
        if method == "awq" else _compressed_tensors_config(not asym, bool(act_order))
        if method == "compressed-tensors" else
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": bool(act_order), "sym": True,
         "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    (qdir / "config.json").write_text(json.dumps(config))
    return qdir, twin, codes


def _load(directory, **kw):
    from ferrylm.model.attention.torch_native import TorchNativeBackend

    return load_model(Checkpoint(resolve_model(str(directory))), torch.float32, torch.device("cpu"),
                      TorchNativeBackend(), **kw)


def _logits(model, prompt):
    cfg = model.config
    caches = [(torch.zeros(8, 16, cfg.num_kv_heads, cfg.head_dim), torch.zeros(8, 16, cfg.num_kv_heads, cfg.head_dim))
              for _ in range(cfg.num_layers)]
    with torch.no_grad():
        return model.compute_logits(model(ForwardBatch.build([prompt], [0], [list(range(8))], 16), caches))


@pytest.mark.parametrize("method,act_order,v2,asym", [
    ("awq", "", False, False), ("gptq", "", False, False), ("gptq", "own", False, False),
    ("gptq", "shared", False, False), ("gptq", "", True, False), ("compressed-tensors", "", False, False),
    ("compressed-tensors", "", False, True), ("compressed-tensors", "own", False, True)],
    ids=["awq", "gptq", "gptq-act-order", "gptq-act-order-shared", "gptq-v2", "ct-symmetric", "ct-asymmetric",
         "ct-act-order"])
def test_codes_are_the_files_and_logits_equal_the_twin(tmp_path, method, act_order, v2, asym):
    if method == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    qdir, twin, codes = _quantized_pair(tmp_path, method, act_order, v2, asym)
    model = _load(qdir)
    assert model.config.prequantized == method
    qkv = model.layers[1].self_attn.qkv_proj
    assert qkv.quant.name == method and model.lm_head.quant.name == "none"
    q_part = qkv.packed.parts[0] if act_order == "own" else qkv.packed  # own act orders: q, k, v kept apart
    packed, perm = (q_part.inner, q_part.perm) if act_order else (q_part, slice(None))  # shared: one gather
    q_rows = codes["model.layers.1.self_attn.q_proj"]
    stored = unpack_q4(packed.codes)[:q_rows.shape[0]]
    assert torch.equal(stored, q_rows[:, perm])  # the file's codes, in the order the kernel reads them
    twin_model = _load(twin)
    for prompt in (list(range(3, 60)), [7]):
        got, want = _logits(model, prompt), _logits(twin_model, prompt)
        assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_greedy_equals_the_dequantized_twin_through_the_engine(tmp_path):
    from ferrylm import LLM

    qdir, twin, _ = _quantized_pair(tmp_path, "gptq", act_order="shared")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 33, 70, 100 + i] * (1 + 4 * i)} for i in range(3)]
    outs = {}
    for name, directory in (("int4", qdir), ("twin", twin)):
        llm = LLM(str(add_word_tokenizer(directory)), dtype="float32", max_num_batched_tokens=16, enforce_eager=True)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["int4"] == outs["twin"]


def test_what_cannot_be_honoured_is_an_error_naming_the_field(tmp_path):
    qdir, _, _ = _quantized_pair(tmp_path, "awq")
    config_path = qdir / "config.json"
    good = json.loads(config_path.read_text())
    for field, value, message in [("bits", 8, "quantization_config.bits 8"),
                                  ("quant_method", "bitsandbytes", "quant_method 'bitsandbytes'"),
                                  ("version", "gemv", "quantization_config.version 'gemv'"),
                                  ("group_size", 48, "quantization_config.group_size 48")]:
        config_path.write_text(json.dumps(good | {"quantization_config": good["quantization_config"] | {field: value}}))
        with pytest.raises(ModelLoadError, match=message):
            Checkpoint(resolve_model(str(qdir)))
    config_path.write_text(json.dumps(good))
    with pytest.raises(ConfigError, match="already quantized with awq"):
        _load(qdir, quantization=QuantConfig.parse("int8"))
    with pytest.raises(ConfigError, match="--quantization gptq serves a checkpoint quantized with gptq"):
        _load(make_tiny_model("llama", tmp_path / "plain"), quantization=QuantConfig.parse("gptq"))


def test_compressed_tensors_schemes_other_than_w4a16_are_errors_naming_the_field(tmp_path):
    pytest.importorskip("compressed_tensors")
    qdir, _, _ = _quantized_pair(tmp_path, "compressed-tensors")
    config_path = qdir / "config.json"
    good = json.loads(config_path.read_text())
    qc = good["quantization_config"]
    scheme = qc["config_groups"]["group_0"]
    weights = scheme["weights"]
    for changed, message in [
            (qc | {"format": "float-quantized"}, "format 'float-quantized'"),
            (qc | {"config_groups": {"group_0": scheme | {"input_activations": {"num_bits": 8}}}},
             "input_activations is not supported"),
            (qc | {"config_groups": {"group_0": scheme | {"weights": weights | {"num_bits": 8}}}}, "num_bits 8"),
            (qc | {"config_groups": {"group_0": scheme | {"weights": weights | {"strategy": "tensor"}}}},
             "strategy 'tensor'"),
            (qc | {"config_groups": {"group_0": scheme | {"weights": weights | {"actorder": "weight"}}}},
             "actorder 'weight'"),
            (qc | {"config_groups": {"group_0": scheme, "group_1": scheme}}, "one scheme")]:
        config_path.write_text(json.dumps(good | {"quantization_config": changed}))
        with pytest.raises(ModelLoadError, match=message):
            Checkpoint(resolve_model(str(qdir)))


def test_tp2_keeps_the_files_codes_and_equals_tp1(tmp_path):
    """Tensor parallelism (gloo, 2 ranks) on an int4 checkpoint: each rank keeps its slice of the file's
    codes (column-parallel rows anywhere, row-parallel inputs at group boundaries) and greedy tokens and
    logprobs equal TP=1's. GPTQ only: every format is one Int4Tensor once unpacked, and that is what
    is sliced (a TP engine start costs CI ~12 s)."""
    from ferrylm import LLM

    method = "gptq"
    qdir, _, codes = _quantized_pair(tmp_path, method)
    directory = str(add_word_tokenizer(qdir))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": [5, 9, 33, 70, 100 + i] * (1 + 3 * i)} for i in range(3)]
    plain = LLM(directory, dtype="float32", enforce_eager=True)
    want = plain.generate(prompts, params, use_tqdm=False)
    plain.shutdown()
    tp = LLM(directory, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16, enforce_eager=True)
    try:
        got = tp.generate(prompts, params, use_tqdm=False)
        down = tp.engine.executor.runner.model.layers[1].mlp.down_proj
        assert down.quant.name == method
        file_codes = codes["model.layers.1.mlp.down_proj"]  # [N, K]: rank 0 holds inputs 0..K/2
        assert torch.equal(unpack_q4(down.packed.codes)[:file_codes.shape[0]], file_codes[:, :file_codes.shape[1] // 2])
    finally:
        tp.shutdown()
    assert_same_greedy(want, got)


def test_tp_of_an_act_order_checkpoint_is_an_error_naming_it(tmp_path):
    from ferrylm import LLM

    qdir, _, _ = _quantized_pair(tmp_path, "gptq", act_order="own")
    with pytest.raises(Exception, match="act-order .*cannot be split over --tensor-parallel-size 2"):
        LLM(str(add_word_tokenizer(qdir)), dtype="float32", tensor_parallel_size=2, enforce_eager=True)
