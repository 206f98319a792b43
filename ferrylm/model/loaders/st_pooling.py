"""A sentence-transformers checkpoint's pooling: its `modules.json` lists the modules after the
transformer (a Pooling module whose `config.json` picks the mode, a Normalize module or not), and
`--runner pooling` pools as they say when `--pooler-config` does not (vLLM does the same). A module or
mode FerryLM cannot run (Dense projections, max or weighted-mean pooling, pooling that leaves out the
prompt) is refused at start, naming it, instead of serving vectors that differ from the model's.
Torch-free: the CLI reads it before anything is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from ferrylm.config import ConfigError

# sentence-transformers' Pooling config keys → our pooling types
MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


class CheckpointPooling(NamedTuple):
    pooling_type: str  # last | mean | cls
    normalize: bool


def _read(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from None


def sentence_transformers_pooling(directory: str | Path) -> CheckpointPooling | None:
    """The pooling `directory`'s modules.json describes; None when it has none (not a
    sentence-transformers checkpoint, or not a directory). ConfigError naming what cannot be served."""
    root = Path(directory)
    if not (root / "modules.json").is_file():
        return None
    modules = _read(root / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                for m in modules):
        raise ConfigError(f"{root / 'modules.json'}: expected a list of {{\"type\": ..., \"path\": ...}} modules")
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    unknown = [m["type"] for m, kind in zip(modules, kinds) if kind not in KNOWN_MODULES]
    if unknown:
        raise ConfigError(f"{root / 'modules.json'}: the sentence-transformers module(s) {', '.join(unknown)} "
                          "cannot be served (supported: Transformer, Pooling, Normalize); --pooler-config "
                          "with a pooling_type serves the model without them")
    pooling = [m for m, kind in zip(modules, kinds) if kind == "Pooling"]
    if len(pooling) != 1:
        raise ConfigError(f"{root / 'modules.json'}: expected one Pooling module, found {len(pooling)}")
    config = _read(root / str(pooling[0].get("path", "")) / "config.json")
    if not isinstance(config, dict):
        raise ConfigError(f"{root}: the Pooling module's config.json is not an object")
    chosen = [mode for key, mode in MODES.items() if config.get(key)]
    refused = [key for key in UNSUPPORTED_MODES if config.get(key)]
    if refused or len(chosen) != 1:
        raise ConfigError(f"{root}: pooling {', '.join(refused + [k for k in MODES if config.get(k)]) or 'none'} "
                          "cannot be served (one of lasttoken, mean_tokens, cls_token); --pooler-config with a "
                          "pooling_type picks another")
    if config.get("include_prompt", True) is not True:
        raise ConfigError(f"{root}: pooling with include_prompt false (an instruction left out) cannot be served")
    return CheckpointPooling(chosen[0], "Normalize" in kinds)
