"""--quantization values that cannot run are ValueErrors naming the flag, raised before serving."""

from __future__ import annotations

import pytest
import torch

from ferrylm.config import ConfigError, EngineConfig, QuantConfig
from ferrylm.model.attention.torch_native import TorchNativeBackend
from ferrylm.model.loaders.loader import Checkpoint, load_model
from ferrylm.model.loaders.model_source import resolve_model
from tests.model.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """hidden 64, intermediate 128: int4 groups of 128 do not divide q/k/v/gate/up's 64 inputs."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def _load(directory, quantization: str, device: str = "cpu"):
    return load_model(Checkpoint(resolve_model(str(directory))), torch.float32, torch.device(device),
                      TorchNativeBackend(), quantization=QuantConfig.parse(quantization))


@pytest.mark.parametrize("value", ["int3", "INT8", "bitsandbytes", "int4-g48", ""])
def test_unknown_value_is_a_config_error(value):
    with pytest.raises(ConfigError, match="--quantization") as err:
        EngineConfig(quantization=value)
    assert isinstance(err.value, ValueError)


def test_known_values_parse():
    assert QuantConfig.parse("int4") == QuantConfig("int4", 32)
    assert QuantConfig.parse("int4-g128") == QuantConfig("int4", 128)
    assert QuantConfig.parse("int8") == QuantConfig("int8")
    assert EngineConfig(quantization="gguf").quant == QuantConfig("gguf")
    assert EngineConfig().quant is None


def test_int4_group_that_does_not_divide_in_features(tiny_llama):
    with pytest.raises(ValueError, match=r"--quantization int4 with group size 128.*in_features 64"):
        _load(tiny_llama, "int4-g128")


def test_fp8_on_cpu_names_the_flag(tiny_llama):
    with pytest.raises(ValueError, match="--quantization fp8 needs a CUDA GPU"):
        _load(tiny_llama, "fp8")


def test_gguf_on_a_safetensors_checkpoint(tiny_llama):
    with pytest.raises(ValueError, match="--quantization gguf keeps a GGUF file's blocks"):
        _load(tiny_llama, "gguf")


def test_errors_come_before_serving(tiny_llama):
    """Through the engine's own entry point: Engine.from_config fails, no engine is built."""
    from ferrylm.engine.engine import Engine

    with pytest.raises(ValueError, match="--quantization int4 with group size 128"):
        Engine.from_config(EngineConfig(model=str(tiny_llama), dtype="float32", quantization="int4-g128"))


def test_cli_rejects_an_unknown_value(capsys):
    from ferrylm.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "hi", "--quantization", "int3"])
    assert "--quantization" in capsys.readouterr().err
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--quantization", "int4-g64"])
    from ferrylm.cli import engine_config_from_args

    assert engine_config_from_args(args).quant == QuantConfig("int4", 64)
