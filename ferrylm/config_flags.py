"""Command-line flags generated from config dataclasses: a field declared with `config.option(...)` is a
flag whose default, help, choices and environment fallback are written once, on the field. The engine's
flags (engine_args.py) and `ferrylm serve`'s (server/config.py) are both made here."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from ferrylm.config import ConfigError


class ConfigFlag(NamedTuple):
    """One settable value: its keyword (the flag is `--` + keyword with dashes, the parsed args' attribute
    is the keyword), where it lives (None: on the top config, else the nested config's field name) and its
    dataclass field."""

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


def config_flags(sections: Iterable[tuple[str | None, type]], skip: Iterable[str] = ()) -> Iterator[ConfigFlag]:
    """Every field of the given (section, dataclass) pairs under its keyword; `skip`: the top config's
    fields that hold a nested config (their own fields come as their section)."""
    skipped = set(skip)
    for section, cls in sections:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if section is None and f.name in skipped:
                continue
            yield ConfigFlag(f.metadata.get("name") or f.name, section, f, hints[f.name])


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[ConfigFlag]) -> None:
    """One argparse flag per `option` field, with its default and help (default shown)."""
    for flag in flags:
        if flag.is_flag:
            _add_flag(parser, flag)


def _add_flag(parser: argparse.ArgumentParser, arg: ConfigFlag) -> None:
    meta, default = arg.field.metadata, typing.cast(Any, arg.field.default)
    names = [arg.flag] + ([meta["short"]] if meta.get("short") else [])
    help_text = meta["help"] if _shown(default) is None else f"{meta['help']} (default: {default})"
    if meta.get("env"):  # read when the parser is built, as a hand-written os.environ.get default was
        help_text = f"{help_text} (env {meta['env']})"
        default = os.environ.get(meta["env"], default)
    if meta.get("nargs"):  # a list of texts; `parse` turns the whole list into the field's value
        parser.add_argument(*names, dest=arg.keyword, nargs=meta["nargs"], default=list(default),
                            metavar=meta.get("metavar"), choices=meta.get("choices"), help=help_text)
        return
    if base_type(arg.annotation) is bool:
        parser.add_argument(*names, dest=arg.keyword, action=argparse.BooleanOptionalAction, default=default,
                            help=help_text)
        return
    parse = meta.get("parse")
    parser.add_argument(*names, dest=arg.keyword, default=default, choices=meta.get("choices"),
                        metavar=meta.get("metavar"),
                        type=_argparse_type(parse) if parse else base_type(arg.annotation), help=help_text)


def base_type(annotation: Any) -> Any:
    """`int | None` → int; `tuple[str, ...]` → tuple; a plain type as it is."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return members[0] if len(members) == 1 else object
    return origin or annotation


def _argparse_type(parse: Any) -> Any:
    """A bad value is a usage error at start-up that names what is wrong, not a traceback."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (ConfigError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def field_value(arg: ConfigFlag, value: Any) -> Any:
    """A keyword's or a parsed flag's value as its field holds it: through the field's `parse` unless it
    already is the field's type (a ConfigError names what is wrong)."""
    parse = arg.field.metadata.get("parse")
    if parse is not None and value is not None and not isinstance(value, base_type(arg.annotation)):
        return parse(value)
    return value


def values_from_args(args: argparse.Namespace, flags: Iterable[ConfigFlag]) -> dict[str, Any]:
    """The parsed flags, by keyword (as typed: field_value converts)."""
    return {flag.keyword: getattr(args, flag.keyword) for flag in flags if flag.is_flag}


def flags_markdown(flags: Iterable[ConfigFlag]) -> str:
    """The flags as a docs table (a test keeps each page's table equal to this)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for arg in flags:
        if arg.is_flag:
            meta = arg.field.metadata
            short = f", `{meta['short']}`" if meta.get("short") else ""
            shown = _shown(arg.field.default)
            cell = ("none" if arg.field.default == () else "unset") if shown is None else shown
            if meta.get("env"):
                cell = f"{cell}, env `{meta['env']}`"
            rows.append(f"| `{arg.flag}`{short} | {cell} | {meta['help'].replace('|', '/').replace('<', '&lt;')} |")
    return "\n".join(rows) + "\n"


def _shown(default: Any) -> str | None:
    """A default as the docs table shows it; None when there is none (None or an empty list)."""
    if default is None or default == ():
        return None
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"`{default}`"
