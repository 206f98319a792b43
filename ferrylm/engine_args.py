"""Engine flags and `LLM(**kwargs)` generated from the config dataclasses (vLLM's EngineArgs idea):
a field declared with `config.option(...)` is a flag and a keyword, its default and help written
once. A new engine setting is one line in config.py; config_flags.py makes the flags."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from ferrylm.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from ferrylm.config_flags import ConfigFlag, add_flags, config_flags, field_value, values_from_args
from ferrylm.config_flags import flags_markdown as _flags_markdown

# EngineConfig's fields that hold a nested config: their own fields are flags and keywords too.
_NESTED = {"cache": CacheConfig, "scheduler": SchedulerConfig, "lora": LoRAConfig}

EngineArg = ConfigFlag  # the name this module's callers (and tests) know an engine flag by


def engine_args() -> Iterator[EngineArg]:
    """Every leaf field of EngineConfig and its nested configs, under its keyword."""
    return config_flags(((None, EngineConfig), *_NESTED.items()), skip=_NESTED)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `option` field, with its default and help (default shown)."""
    add_flags(parser, engine_args())


def engine_config(**kwargs: Any) -> EngineConfig:
    """EngineConfig from keywords (LLM's, or the parsed flags'); an unknown keyword is a TypeError
    naming it, as a misspelt function argument is. Values pass through each field's `parse`."""
    args = {arg.keyword: arg for arg in engine_args()}
    unknown = sorted(set(kwargs) - set(args))
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(args)}")
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {name: {} for name in _NESTED}
    for keyword, value in kwargs.items():
        arg = args[keyword]
        (top if arg.section is None else nested[arg.section])[arg.field.name] = field_value(arg, value)
    sections: dict[str, Any] = {name: _NESTED[name](**values) for name, values in nested.items()}
    return EngineConfig(**top, **sections)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The flags add_engine_flags declared, as an EngineConfig."""
    return engine_config(**values_from_args(args, engine_args()))


def flags_markdown() -> str:
    """The engine flags as docs/serving.md's table (a test keeps the page equal to this)."""
    return _flags_markdown(engine_args())


if __name__ == "__main__":
    print(flags_markdown(), end="")
