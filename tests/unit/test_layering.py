"""Imports point down only: cli → server, router → gateway (policy) → http → engine → model → leaves.

Read from the source (every import statement, also those inside functions), so a package cycle
or an upward import fails here before it becomes a tangle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ferrylm"

# package → packages it must never import
FORBIDDEN = {
    "http": ("server", "router", "gateway", "cli"),
    "gateway": ("server", "router", "cli"),
    "router": ("server", "cli"),
    "server": ("router", "cli"),
    "engine": ("server", "router", "gateway", "http", "cli"),
    "model": ("server", "router", "gateway", "http", "engine", "cli"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package: str) -> None:
    bad = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for line, module in _imports(path):
            parts = module.split(".")
            if parts[0] == "ferrylm" and len(parts) > 1 and parts[1] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_engine_never_imports_torch() -> None:
    """The engine is orchestration over ids; every tensor lives under model/."""
    bad = [f"{path.name}:{line}" for path in sorted((PACKAGE / "engine").rglob("*.py"))
           for line, module in _imports(path) if module.split(".")[0] == "torch"]
    assert not bad, bad
