"""Every file, module and test the docs name exists (issue 50: docs that stay true).

Scans README.md, examples/README.md and docs/*.md, prose and code blocks alike, for

- repository paths: a token starting with one of the repository's top-level folders
  (``hcp_compile/batch/layout.py``, ``benchmarks/results/``, ``tests/test_x.py::test_y``), or a
  relative path whose first folder is a folder of the repository and which ends in a file
  suffix (``kernels/flex.py``, ``batch/pickling.py``): the file or folder must exist (a
  relative one as the end of some path in the repository);
- dotted modules of the repository (``python -m benchmarks.speed``,
  ``hcp_compile.compiled.inserted.checked_layout``): the longest prefix that is a module must
  define or import the next name;
- test names (``test_something``, ``test_unsupported_*_arguments_are_named``,
  ``test_x[param]``): a test function or class of that name (or a test module) under tests/.

Placeholders stand for any name: ``<name>``, ``{a,b}`` (each alternative must exist), a ``*``.
A module whose code a doc shows as a sketch (``<!-- module: NAME -->`` before the block, as
tests/snippets.py reads it) may be cited by module and path before it exists. A file that no longer
exists is cited with the commit that holds it, as git spells it (``1a2b3c4:scripts/probe.py``),
which this test leaves alone. No torch import: this runs in well under a second.
"""

from __future__ import annotations

import fnmatch
import itertools
import re
import tomllib
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Outputs a documented command writes that are not committed yet. Each entry says why; an entry
# whose file exists is harmless (delete it then).
NOT_YET_WRITTEN = {
    # docs/benchmarks.md "Capacity": the commands of issue 48, results to be measured.
    "benchmarks/results/capacity_one_gpu.json",
    "benchmarks/results/capacity_hcp_eager.json",
    "benchmarks/results/capacity_hcp_compiled.json",
    "benchmarks/results/capacity.json",
    "benchmarks/results/capacity.png",
}

SUFFIXES = r"(?:py|json|json\.gz|md|log|txt|png|toml|gz)"
# Characters that may not precede a citation: a word, a path or module part ($OUT/x,
# /tmp/x, docs/x.md), a placeholder, or a commit (1a2b3c4:scripts/x.py).
NOT_AFTER = r"(?<![\w./$<>:*{-])"
PATH_CHARS = r"[\w./*<>{},-]"


def _ignored(name: str) -> bool:
    patterns = [
        line.strip().strip("/")
        for line in (ROOT / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


@lru_cache(maxsize=None)
def top_folders() -> tuple[str, ...]:
    return tuple(
        sorted(
            p.name
            for p in ROOT.iterdir()
            if p.is_dir() and not p.name.startswith(".") and not _ignored(p.name)
        )
    )


@lru_cache(maxsize=None)
def repository_files() -> tuple[str, ...]:
    """Every file under the top-level folders, as a path from the root (no caches)."""
    files = []
    for top in top_folders():
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                files.append(path.relative_to(ROOT).as_posix())
    return tuple(files)


@lru_cache(maxsize=None)
def repository_folder_names() -> frozenset[str]:
    names = set()
    for file in repository_files():
        names.update(file.split("/")[:-1])
    return frozenset(names)


@lru_cache(maxsize=None)
def package_dirs() -> dict[str, str]:
    """Importable names of folders: each top-level folder, plus pyproject's package-dir
    mapping (``hcp_compile.passes`` is ``passes/``)."""
    dirs = {top: top for top in top_folders()}
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    dirs.update(setuptools.get("package-dir", {}))
    return dirs


@lru_cache(maxsize=None)
def defined_test_names() -> frozenset[str]:
    """Names a test citation may mean: test functions and classes, test modules."""
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.add(path.stem)
        for match in re.finditer(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", path.read_text(), re.M):
            names.add(match.group(1))
    return frozenset(names)


def expand(token: str) -> list[str]:
    """Brace alternatives expanded; ``<...>`` placeholders become ``*``."""
    token = re.sub(r"<[^<>/]*>", "*", token)
    parts = re.split(r"\{([^{}]*)\}", token)
    literal, choices = parts[0::2], [p.split(",") for p in parts[1::2]]
    return [
        "".join(itertools.chain.from_iterable(itertools.zip_longest(literal, combo, fillvalue="")))
        for combo in itertools.product(*choices)
    ]


@lru_cache(maxsize=None)
def sketches() -> frozenset[str]:
    """Modules the docs show as code (``<!-- module: NAME -->``), and their files."""
    names = set()
    for doc in DOCS:
        names.update(re.findall(r"<!-- module: ([\w.]+) -->", doc.read_text()))
    names = {name for name in names if module_source(name) is None}  # a block of a real module: no sketch
    dirs = package_dirs()
    for name in list(names):
        owner = max((p for p in dirs if name == p or name.startswith(p + ".")), key=len, default=None)
        if owner is not None:
            rest = name[len(owner) :].lstrip(".").replace(".", "/")
            names.add(f"{dirs[owner]}/{rest}.py" if rest else f"{dirs[owner]}/__init__.py")
    return frozenset(names)


def path_exists(path: str, relative: bool) -> bool:
    if path in sketches():
        return True
    if path in NOT_YET_WRITTEN:
        return True
    if relative:
        return any(f == path or f.endswith("/" + path) or fnmatch.fnmatch(f, "*/" + path) for f in repository_files())
    if "*" in path:
        pattern = path.rstrip("/")
        return any(fnmatch.fnmatch(f, pattern) or fnmatch.fnmatch(f, pattern + "/*") for f in repository_files())
    return (ROOT / path).exists()


def module_source(dotted: str) -> str | None:
    """The source of a repository module (or package), or None if there is none."""
    dirs = package_dirs()
    for i in range(dotted.count(".") + 1, 0, -1):
        prefix = ".".join(dotted.split(".")[:i])
        if prefix in dirs:
            base, rest = ROOT / dirs[prefix], []
        else:
            owner = next((p for p in sorted(dirs, key=len, reverse=True) if prefix.startswith(p + ".")), None)
            if owner is None:
                continue
            base, rest = ROOT / dirs[owner], prefix[len(owner) + 1 :].split(".")
        target = base.joinpath(*rest)
        for candidate in (target.with_suffix(".py"), target / "__init__.py"):
            if candidate.is_file():
                return candidate.read_text()
        if target.is_dir() and rest == []:
            return ""
        return None
    return None


def module_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    if any(dotted == s or dotted.startswith(s + ".") for s in sketches()):
        return True
    for i in range(len(parts), 0, -1):
        source = module_source(".".join(parts[:i]))
        if source is None:
            continue
        return i == len(parts) or re.search(rf"\b{re.escape(parts[i])}\b", source) is not None
    return False


def citations(text: str):
    """(line number, kind, token) of every citation in a doc."""
    tops = "|".join(map(re.escape, top_folders()))
    top_path = re.compile(rf"{NOT_AFTER}((?:{tops})/{PATH_CHARS}*)")
    rel_path = re.compile(rf"{NOT_AFTER}((?:[A-Za-z_]\w*/)+{PATH_CHARS}*?\.{SUFFIXES})(?![\w/])")
    module = re.compile(rf"{NOT_AFTER}((?:{tops})(?:\.[A-Za-z_]\w*)+)")
    test = re.compile(r"(?<![\w/.])(test_[\w*]*(?:\[[^\]\s`]*\])?)")
    for number, line in enumerate(text.splitlines(), 1):
        for match in top_path.finditer(line):
            token = match.group(1).rstrip(".,;:)")
            path, _, test_id = token.partition("::")
            yield number, "path", path
            if test_id:
                yield number, "test", test_id
        for match in rel_path.finditer(line):
            token = match.group(1)
            if token.split("/")[0] in top_folders():
                continue
            if token.split("/")[0] in repository_folder_names():
                yield number, "relative path", token
        for match in module.finditer(line):
            token = match.group(1)
            if re.search(rf"\.{SUFFIXES}$", token):  # a file name (docs/benchmarks.md)
                continue
            yield number, "module", token
        for match in test.finditer(line):
            token = match.group(1)
            if token.endswith(".py") or line[match.end() :].startswith(".py"):
                continue  # a test file, checked as a path where cited as one
            yield number, "test", token


def exists(kind: str, token: str) -> bool:
    if kind in ("path", "relative path"):
        return all(path_exists(p, kind == "relative path") for p in expand(token))
    if kind == "module":
        return module_exists(token)
    name = re.sub(r"\[.*\]$", "", token)
    if "*" in name:
        return any(fnmatch.fnmatch(n, name) for n in defined_test_names())
    return name in defined_test_names()


def missing_citations() -> list[str]:
    missing = []
    for doc in DOCS:
        for number, kind, token in citations(doc.read_text()):
            if not exists(kind, token):
                missing.append(f"{doc.relative_to(ROOT)}:{number}: {kind} `{token}`")
    return missing


def test_docs_cite_only_files_modules_and_tests_that_exist():
    missing = missing_citations()
    assert not missing, "docs cite what does not exist (rename or drop the citation):\n" + "\n".join(missing)


def test_the_scan_finds_each_kind_of_citation():
    text = (
        "see `hcp_compile/batch/layout.py`, tests/test_layers.py::test_nothing_here, kernels/flex.py,\n"
        "python -m benchmarks.speed, `test_no_such_test`, 1a2b3c4:scripts/gone.py, $OUT/tests/x.py\n"
    )
    found = {(kind, token) for _, kind, token in citations(text)}
    assert found == {
        ("path", "hcp_compile/batch/layout.py"),
        ("path", "tests/test_layers.py"),
        ("test", "test_nothing_here"),
        ("relative path", "kernels/flex.py"),
        ("module", "benchmarks.speed"),
        ("test", "test_no_such_test"),
    }
    assert [exists(kind, token) for kind, token in sorted(found)] == [
        True,  # benchmarks.speed
        True,  # hcp_compile/batch/layout.py
        True,  # tests/test_layers.py
        True,  # kernels/flex.py
        False,  # test_no_such_test
        False,  # test_nothing_here
    ]
    assert not exists("path", "scripts/gone.py")
    assert not exists("module", "hcp_compile.kernels.no_such_module")
    assert exists("module", "hcp_compile.passes.match")
    assert exists("path", "hcp_compile/kernels/<name>.py")
