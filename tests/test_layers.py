"""The import graph of the package (README "More", docs/design.md): no import cycle between
the kernels and the ring's merge, and the graph passes (``passes/``, installed as
``hcp_compile.passes``) import only the layers below them: never the package's top
(``hcp_compile/__init__.py``, which imports the backend), the backend or ``explain``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"hcp_compile": ROOT / "hcp_compile", "hcp_compile.passes": ROOT / "passes"}
ABOVE_THE_PASSES = {"hcp_compile", "hcp_compile.compiled.backend", "hcp_compile.explain"}


def module_files() -> dict[str, Path]:
    files = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            files[name.removesuffix(".__init__")] = path
    return files


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports, anywhere in the file (function-level and
    TYPE_CHECKING imports too: they are dependencies all the same)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from . import layout`` imports the submodule; ``from .x import f``, module x
            submodules = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t for t in submodules if t in known] or [base]
        else:
            continue
        found |= {t for t in targets if t in known}
    return found - {name}


def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports(name, path, set(files)) for name, path in files.items()}


def reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, stack = set(), list(edges[start])
    while stack:
        current = stack.pop()
        if current == goal:
            return True
        if current not in seen:
            seen.add(current)
            stack.extend(edges.get(current, ()))
    return False


def test_merge_does_not_import_the_kernels():
    edges = graph()
    beside = {"hcp_compile.kernels.merge", "hcp_compile.kernels.precision"}
    kernels = {name for name in edges if name.startswith("hcp_compile.kernels")} - beside
    assert not edges["hcp_compile.kernels.merge"] & kernels, edges["hcp_compile.kernels.merge"]
    assert not any(reaches(edges, "hcp_compile.kernels.merge", k) for k in kernels)


def test_passes_import_only_layers_below_them():
    edges = graph()
    for name in [n for n in edges if n.startswith("hcp_compile.passes")]:
        assert not edges[name] & ABOVE_THE_PASSES, f"{name} imports {edges[name] & ABOVE_THE_PASSES}"


def test_the_schemes_are_below_the_algorithm():
    """A scheme is a way to move data: it imports nothing of the attention that runs it."""
    edges = graph()
    for name in [n for n in edges if n.startswith("hcp_compile.exchange.schemes")]:
        assert not reaches(edges, name, "hcp_compile.hierarchical"), name


# each folder of the runtime and what it may import (docs/extending.md, "The tree"): the
# kernels stand alone, the exchange runs on them, the host's batch work reads the schemes'
# registry and the kernels' cache keys; none imports the doors above them
LAYERS = {
    "hcp_compile.kernels": ("hcp_compile.kernels", "hcp_compile.validation"),
    "hcp_compile.exchange": ("hcp_compile.exchange", "hcp_compile.kernels", "hcp_compile.validation"),
    "hcp_compile.batch": ("hcp_compile.batch", "hcp_compile.exchange", "hcp_compile.kernels",
                          "hcp_compile.validation"),
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_each_folder_imports_only_the_layers_below_it():
    edges = graph()
    assert all(any(_within(name, folder) for name in edges) for folder in LAYERS)  # the folders exist
    for name, targets in edges.items():
        for folder, allowed in LAYERS.items():
            if _within(name, folder):
                wrong = {t for t in targets if not any(_within(t, a) for a in allowed)}
                assert not wrong, f"{name} imports {sorted(wrong)}, above its layer"
