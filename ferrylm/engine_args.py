"""Engine flags and `LLM(**kwargs)` generated from the config dataclasses (vLLM's EngineArgs idea):
a field declared with `config.option(...)` is a flag and a keyword, its default and help written
once. A new engine setting is one line in config.py."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterator
from typing import Any, NamedTuple

from ferrylm.config import CacheConfig, ConfigError, EngineConfig, LoRAConfig, SchedulerConfig

# EngineConfig's fields that hold a nested config: their own fields are flags and keywords too.
_NESTED = {"cache": CacheConfig, "scheduler": SchedulerConfig, "lora": LoRAConfig}


class EngineArg(NamedTuple):
    """One settable value: its keyword (the flag is `--` + keyword with dashes), where it lives
    (None: on EngineConfig, else the nested config's field name) and its dataclass field."""

    keyword: str
    section: str | None
    field: dataclasses.Field
    annotation: Any

    @property
    def flag(self) -> str:
        return "--" + self.keyword.replace("_", "-")

    @property
    def is_flag(self) -> bool:
        return "help" in self.field.metadata


def engine_args() -> Iterator[EngineArg]:
    """Every leaf field of EngineConfig and its nested configs, under its keyword."""
    for section, cls in ((None, EngineConfig), *_NESTED.items()):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if section is None and f.name in _NESTED:
                continue
            yield EngineArg(f.metadata.get("name") or f.name, section, f, hints[f.name])


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `option` field, with its default and help (default shown)."""
    for arg in engine_args():
        if arg.is_flag:
            _add_flag(parser, arg)


def _add_flag(parser: argparse.ArgumentParser, arg: EngineArg) -> None:
    meta, default = arg.field.metadata, arg.field.default
    names = [arg.flag] + ([meta["short"]] if meta.get("short") else [])
    help_text = meta["help"] if default is None else f"{meta['help']} (default: {default})"
    if _base_type(arg.annotation) is bool:
        parser.add_argument(*names, dest=arg.keyword, action=argparse.BooleanOptionalAction, default=default,
                            help=help_text)
        return
    parse = meta.get("parse")
    parser.add_argument(*names, dest=arg.keyword, default=default, choices=meta.get("choices"),
                        type=_argparse_type(parse) if parse else _base_type(arg.annotation), help=help_text)


def _base_type(annotation: Any) -> Any:
    """`int | None` → int; a plain type as it is."""
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    return members[0] if members else annotation


def _argparse_type(parse: Any) -> Any:
    """A bad value is a usage error at start-up that names what is wrong, not a traceback."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (ConfigError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


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
        parse = arg.field.metadata.get("parse")
        if parse is not None and value is not None and not isinstance(value, _base_type(arg.annotation)):
            value = parse(value)
        (top if arg.section is None else nested[arg.section])[arg.field.name] = value
    sections: dict[str, Any] = {name: _NESTED[name](**values) for name, values in nested.items()}
    return EngineConfig(**top, **sections)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The flags add_engine_flags declared, as an EngineConfig."""
    return engine_config(**{arg.keyword: getattr(args, arg.keyword) for arg in engine_args() if arg.is_flag})


def flags_markdown() -> str:
    """The engine flags as docs/serving.md's table (a test keeps the page equal to this)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for arg in engine_args():
        if arg.is_flag:
            short = f", `{arg.field.metadata['short']}`" if arg.field.metadata.get("short") else ""
            default = arg.field.default
            shown = "unset" if default is None else ("on" if default else "off") if isinstance(default, bool) \
                else f"`{default}`"
            rows.append(f"| `{arg.flag}`{short} | {shown} | {arg.field.metadata['help'].replace('|', '/')} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(flags_markdown(), end="")
