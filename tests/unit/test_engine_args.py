"""Engine flags and LLM() keywords come from the config dataclasses: one copy of every default."""

from __future__ import annotations

import argparse
import inspect

import pytest

from ferrylm.config import ConfigError, EngineConfig, SpeculativeConfig
from ferrylm.engine.llm import LLM
from ferrylm.engine_args import add_engine_flags, engine_args, engine_config, engine_config_from_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return parser


def _value(config: EngineConfig, keyword: str):
    arg = next(a for a in engine_args() if a.keyword == keyword)
    owner = config if arg.section is None else getattr(config, arg.section)
    return getattr(owner, arg.field.name)


def test_no_flags_is_the_dataclass_defaults():
    assert engine_config_from_args(_parser().parse_args([])) == EngineConfig()
    assert engine_config() == EngineConfig()


# a value other than the default for each flag, as typed on a command line and as the field holds it
CHANGED = {
    "model": ("x.gguf", "x.gguf"), "dtype": ("float32", "float32"), "device": ("cuda", "cuda"),
    "quantization": ("int4-g64", "int4-g64"), "enforce_eager": (None, True),
    "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 3}', SpeculativeConfig("ngram", 3)),
    "tensor_parallel_size": ("2", 2), "enable_expert_parallel": (None, True),
    "grammar_compile_timeout": ("1.5", 1.5), "grammar_compile_memory": ("256", 256),
    "block_size": ("32", 32), "num_gpu_blocks_override": ("40", 40),
    "kv_cache_memory": ("12345", 12345), "gpu_memory_utilization": ("0.5", 0.5),
    "enable_prefix_caching": (None, False), "kv_cache_dtype": ("int8", "int8"), "swap_space": ("2.5", 2.5),
    "max_num_seqs": ("7", 7), "max_num_batched_tokens": ("99", 99), "max_model_len": ("300", 300),
    "long_prefill_token_threshold": ("64", 64), "preemption_mode": ("swap", "swap"),
    "decode_isolation_headroom": ("0.25", 0.25), "enable_lora": (None, True), "max_loras": ("2", 2),
    "max_lora_rank": ("64", 64), "max_cpu_loras": ("9", 9), "kv_offload_cpu_gib": ("0.5", 0.5),
    "kv_offload_disk_path": ("/tmp/kvd", "/tmp/kvd"), "kv_offload_disk_gib": ("2.5", 2.5),
}
# flags that are only valid beside another
COMPANIONS = {"kv_offload_disk_path": ["--kv-offload-cpu-gib", "1"]}


def test_every_flag_reaches_its_field():
    flags = [a for a in engine_args() if a.is_flag]
    assert {a.keyword for a in flags} == set(CHANGED), "a new flag needs a row in CHANGED"
    for arg in flags:
        text, expected = CHANGED[arg.keyword]
        if text is None:  # a boolean: the form that flips the default
            argv = [("--no-" if arg.field.default else "--") + arg.flag[2:]]
        else:
            argv = [arg.flag, text]
        argv += COMPANIONS.get(arg.keyword, [])
        assert _value(engine_config_from_args(_parser().parse_args(argv)), arg.keyword) == expected, arg.flag


def test_llm_keywords_are_the_flags_names():
    config = engine_config(max_num_seqs=3, kv_cache_dtype="int8", num_gpu_blocks_override=12, seed=5,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert (config.scheduler.max_num_seqs, config.cache.cache_dtype, config.cache.num_blocks, config.seed) == \
        (3, "int8", 12, 5)
    assert config.speculative == SpeculativeConfig("ngram", 2)


def test_llm_repeats_no_default():
    params = inspect.signature(LLM.__init__).parameters
    assert [p for p in params if p not in ("self", "kwargs")] == ["model", "dtype"]
    assert (params["model"].default, params["dtype"].default) == (EngineConfig.model, EngineConfig.dtype)


def test_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)  # raised before any model loads


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        engine_config(speculative_config={"method": "ngram"})
    with pytest.raises(ConfigError, match="preemption-mode"):
        engine_config(preemption_mode="never")


def test_bad_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 1}'])
    assert "not implemented" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-num-seqs", "many"])


def test_short_tensor_parallel_flag():
    assert engine_config_from_args(_parser().parse_args(["-tp", "2"])).tensor_parallel_size == 2


def test_docs_table_is_the_generated_one():
    from pathlib import Path

    from ferrylm.engine_args import flags_markdown

    page = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    table = page.split("<!-- engine-flags:begin -->\n")[1].split("<!-- engine-flags:end -->")[0]
    assert table == flags_markdown(), "docs/serving.md: rerun `python -m ferrylm.engine_args`"
