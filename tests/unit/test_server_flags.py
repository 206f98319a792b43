"""`ferrylm serve`'s own flags come from ServerConfig's `option` fields: one copy of every default."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from ferrylm.cli import build_parser
from ferrylm.config import ConfigError
from ferrylm.engine_args import engine_args
from ferrylm.server.config import (
    ServerConfig,
    add_server_flags,
    server_fields_from_args,
    server_flags,
    server_flags_markdown,
)

_ENV = ("FERRYLM_API_KEY", "FERRYLM_KV_TRANSFER_KEY", "FERRYLM_LORA_ADMIN_KEY")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    return parser


def _flags():
    return [flag for flag in server_flags() if flag.is_flag]


def test_no_flags_is_the_dataclass_defaults():
    fields = server_fields_from_args(_parser().parse_args([]))
    assert fields == {flag.field.name: flag.field.default for flag in _flags()}
    default = ServerConfig()
    assert ServerConfig(**fields) == default
    assert fields == {name: getattr(default, name) for name in fields}


def test_serve_parser_gives_the_same_defaults():
    args = build_parser().parse_args(["serve"])
    assert server_fields_from_args(args) == {flag.field.name: flag.field.default for flag in _flags()}


# a value other than the default for each flag, as typed on a command line and as the field holds it
CHANGED = {
    "host": (["0.0.0.0"], "0.0.0.0"), "port": (["0"], 0), "api_key": (["k" * 20], "k" * 20),
    "max_body_bytes": (["2048"], 2048), "max_sequences_per_request": (["3"], 3),
    "max_stream_backlog": (["7"], 7), "drain_timeout": (["1.5"], 1.5), "ready_timeout": (["2.5"], 2.5),
    "heartbeat_timeout": (["9"], 9.0), "log_level": (["debug"], "debug"), "kv_role": (["both"], "both"),
    "max_kv_transfer_bytes": (["4096"], 4096), "kv_transfer_key": (["t" * 20], "t" * 20),
    "reasoning_parser": (["qwen3"], "qwen3"),
    "structured_outputs_config": (['{"enable_in_reasoning": true}'], '{"enable_in_reasoning": true}'),
    "lora_modules": (["a=/x", '{"name": "b", "path": "/y"}'], (("a", "/x"), ("b", "/y"))),
    "lora_admin_key": (["l" * 20], "l" * 20),
}


def test_every_flag_reaches_its_field():
    assert {flag.keyword for flag in _flags()} == set(CHANGED), "a new flag needs a row in CHANGED"
    for flag in _flags():
        texts, expected = CHANGED[flag.keyword]
        fields = server_fields_from_args(_parser().parse_args([flag.flag, *texts]))
        assert fields[flag.field.name] == expected, flag.flag


def test_field_names_map_to_flag_names():
    args = _parser().parse_args(["--drain-timeout", "3", "--ready-timeout", "4", "--heartbeat-timeout", "5"])
    assert (args.drain_timeout, args.ready_timeout, args.heartbeat_timeout) == (3.0, 4.0, 5.0)
    fields = server_fields_from_args(args)
    assert (fields["drain_timeout_s"], fields["ready_timeout_s"], fields["heartbeat_timeout_s"]) == (3.0, 4.0, 5.0)


def test_secrets_default_to_their_environment_variables(monkeypatch):
    for name in _ENV:
        monkeypatch.setenv(name, name.lower() + "-secret-value")
    fields = server_fields_from_args(_parser().parse_args([]))
    assert (fields["api_key"], fields["kv_transfer_key"], fields["lora_admin_key"]) == tuple(
        name.lower() + "-secret-value" for name in _ENV)
    assert server_fields_from_args(_parser().parse_args(["--api-key", "given"]))["api_key"] == "given"


def test_help_names_the_variable_not_its_value(monkeypatch, capsys):
    monkeypatch.setenv("FERRYLM_API_KEY", "do-not-print-me")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "do-not-print-me" not in out and "FERRYLM_API_KEY" in out


def test_choices_are_enforced(capsys):
    for flag in ("--log-level", "--kv-role", "--reasoning-parser"):
        with pytest.raises(SystemExit):
            _parser().parse_args([flag, "nonsense"])
        assert "invalid choice" in capsys.readouterr().err


def test_bad_lora_module_is_a_config_error_when_the_config_is_built():
    args = _parser().parse_args(["--lora-modules", "no-equals-sign"])
    with pytest.raises(ConfigError, match="NAME=PATH"):
        server_fields_from_args(args)


def test_no_server_flag_shadows_an_engine_flag():
    engine = {arg.keyword for arg in engine_args() if arg.is_flag}
    assert not engine & {flag.keyword for flag in _flags()}


def test_hand_written_fields_are_not_flags():
    generated = {flag.field.name for flag in _flags()}
    hand_written = {f.name for f in dataclasses.fields(ServerConfig)} - generated
    assert {"served_model_names", "gateway", "connections", "tracing", "runner", "enable_lora"} <= hand_written


def test_docs_table_is_the_generated_one():
    page = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    table = page.split("<!-- server-flags:begin -->\n")[1].split("<!-- server-flags:end -->")[0]
    assert table == server_flags_markdown(), "docs/serving.md: rerun `python -m ferrylm.server.config`"
