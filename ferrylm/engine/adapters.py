"""The LoRA adapters an engine serves, by name: loaded and unloaded between steps through the
executor (which reads and holds their matrices), listed for /v1/models, checked when a request names one."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from ferrylm.config import ConfigError, LoRAConfig
from ferrylm.executor import Executor, LoRAError


class AdapterBusy(RuntimeError):
    """Unloading an adapter that requests are still running or waiting on (HTTP 409)."""


@dataclass(frozen=True)
class LoRAInfo:
    """A loaded adapter; `generation` numbers the loads from a random start per engine, so a name
    loaded again (other weights), here or after a restart, never meets the K/V its previous weights
    left in the prefix cache or its disk tier."""

    name: str
    path: str
    rank: int
    generation: int = 0


class Adapters:
    """Name → adapter for one engine. `in_use(name)`: requests of that adapter not yet finished."""

    def __init__(self, config: LoRAConfig, executor: Executor, in_use: Callable[[str], int]):
        self.config, self._executor, self._in_use = config, executor, in_use
        self._loaded: dict[str, LoRAInfo] = {}
        self._loads = secrets.randbits(62)  # a restart's first load must not reuse the last one's number

    def add(self, name: str, path: str) -> LoRAInfo:
        """Load (or replace, when idle) the adapter `name`; raises LoRAError naming what is wrong."""
        if not self.config.enable_lora:
            raise ConfigError("LoRA adapters need --enable-lora")
        if not name or not isinstance(name, str) or len(name) > 256:
            raise LoRAError("a LoRA adapter needs a name of 1 to 256 characters")
        if name in self._loaded and self._in_use(name):
            raise AdapterBusy(f"LoRA adapter {name!r} has requests running; unload it when they finish")
        rank = self._executor.add_lora(name, path)
        self._loads += 1
        info = LoRAInfo(name, path, rank, self._loads)
        self._loaded[name] = info
        return info

    def remove(self, name: str) -> None:
        """Forget `name`; KeyError if not loaded, AdapterBusy while requests of it are unfinished."""
        if name not in self._loaded:
            raise KeyError(name)
        busy = self._in_use(name)
        if busy:
            raise AdapterBusy(f"LoRA adapter {name!r} has {busy} request(s) running or waiting; unload it "
                              "when they finish")
        self._executor.remove_lora(name)
        del self._loaded[name]

    def get(self, name: str) -> LoRAInfo | None:
        return self._loaded.get(name)

    def list(self) -> list[LoRAInfo]:
        return list(self._loaded.values())
