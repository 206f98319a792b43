"""Imports point down only: cli → server, router → gateway (policy) → http → engine → executor.py →
model → leaves.

Read from the source (every import statement, also those inside functions), so a package cycle
or an upward import fails here before it becomes a tangle. Every form is resolved to the module it
names: `import ferrylm.server`, `from ferrylm import server`, `from ..server import x` (relative),
`importlib.import_module("ferrylm.server")` and `__import__("ferrylm.server")` with a literal name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ferrylm"

# package → packages (or top-level modules) it must never import
FORBIDDEN = {
    "http": ("server", "router", "gateway", "cli"),
    "gateway": ("server", "router", "cli"),
    "router": ("server", "cli"),
    "server": ("router", "cli"),
    # the engine reaches the model side only through ferrylm/executor.py
    "engine": ("server", "router", "gateway", "http", "cli", "model"),
    "model": ("server", "router", "gateway", "http", "engine", "cli"),
    "observability": ("server", "router", "gateway", "cli"),
}


def _package_of(path: Path) -> list[str]:
    """The dotted package a source file is in, as parts (ferrylm/engine/x.py → ferrylm, engine)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return parts if path.name == "__init__.py" else parts[:-1]


def imported_modules(source: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted module) for every import in `source`, in any form."""
    tree = ast.parse(source, str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(path)[: len(_package_of(path)) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]  # `from ferrylm import server`
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def _violations(package: str, module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "ferrylm" and len(parts) > 1 and parts[1] in FORBIDDEN[package]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package: str) -> None:
    bad = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for line, module in imported_modules(path.read_text(), path):
            if _violations(package, module):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("statement", [
    "import ferrylm.server",
    "from ferrylm import server",
    "from ferrylm.server.app import build_app",
    "from ..server import app",
    "from .. import server",
    "import importlib\nimportlib.import_module('ferrylm.server.app')",
    "__import__('ferrylm.server')",
    "def f():\n    from ferrylm import model",
])
def test_every_import_form_is_caught(statement: str) -> None:
    path = PACKAGE / "engine" / "engine.py"
    assert any(_violations("engine", m) for _, m in imported_modules(statement, path)), statement


def test_engine_never_imports_torch() -> None:
    """The engine is orchestration over ids; every tensor lives under model/."""
    bad = [f"{path.name}:{line}" for path in sorted((PACKAGE / "engine").rglob("*.py"))
           for line, module in imported_modules(path.read_text(), path) if module.split(".")[0] == "torch"]
    assert not bad, bad


def test_the_executor_seam_is_torch_free() -> None:
    """ferrylm/executor.py is all the engine sees of the model side: importable without torch at
    module level (it imports model/ only inside build functions)."""
    path = PACKAGE / "executor.py"
    tree = ast.parse(path.read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names] + \
        [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] == "torch" or m.startswith("ferrylm.model")], names
