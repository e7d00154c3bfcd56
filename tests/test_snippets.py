"""Every ``python`` block of README.md and docs/*.md runs, and the dump excerpt of
docs/compiled-path.md is what the documented command dumps (tests/snippets.py: the markers that
say how a block runs). Skipped blocks show their reason in ``pytest -rs``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from snippets import (ROOT, Block, Source, blocks, code_of, dump_excerpt, processes, program,
                      python_blocks, run_on_ranks)

SNIPPETS = [b for b in python_blocks() if b.marker != "dump"]
# how a script block says, on each rank, what it checked (README's eager and compiled snippets)
SAYS_WHAT_IT_CHECKED = 'print(f"rank {dist.get_rank()}: '

DUMP_DOC = ROOT / "docs" / "compiled-path.md"
DUMP_EXCERPTS = [b for b in blocks(DUMP_DOC) if b.marker == "dump"]
# as docs/compiled-path.md gives it; it writes hcp_dump/ in the folder it runs in
DUMP_COMMAND = ("python examples/compile_model.py --layers 1 --tokens 40 --docs 4 --dim 32 "
                "--heads 4 --kv-heads 2 --dump-dir hcp_dump")
DUMP_RANKS = 4  # compile_model.py's default mesh: ulysses 2 x ring 2
# the torch the excerpts were dumped with (the doc says so): another version may name and print
# FX nodes otherwise, which is no fault of the doc
DUMP_TORCH = "2.14"


@pytest.mark.parametrize("block", SNIPPETS, ids=lambda b: b.id)
def test_snippet_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.marker == "not run":
        pytest.skip(f"{block.id} not run: {block.argument}")
    if block.marker == "module":
        run_module_block(block, monkeypatch)
        return
    sources = program(block)
    ranks = processes(sources)
    run_on_ranks(sources, ranks, tmp_path)
    if SAYS_WHAT_IT_CHECKED in block.text:  # each rank printed it, so a reader running it sees it
        for rank in range(ranks):
            assert f"rank {rank}: " in (tmp_path / f"rank{rank}.log").read_text(), f"{block.id} rank {rank}"


def run_module_block(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new modules of the block's document are installed first (a document's new files
    exist before the lines that import them run), then an existing module's lines run in a
    copy of its namespace, so that the package itself stays as it is."""
    in_document = [b for b in blocks(block.path) if b.marker == "module"]
    new = [b for b in in_document if importlib.util.find_spec(b.argument) is None]
    for module_block in new:
        install_module(module_block, monkeypatch)
    if block not in new:
        existing = importlib.import_module(block.argument)
        namespace = {**vars(existing), "__annotations__": {}}  # the module's own stay untouched
        exec(code_of(block.source), namespace)


def install_module(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    name = block.argument
    module = types.ModuleType(name)
    module.__package__ = name.rpartition(".")[0]  # for the block's relative imports
    monkeypatch.setitem(sys.modules, name, module)
    exec(code_of(block.source), vars(module))


def test_markers_say_how_a_block_is_treated(tmp_path: Path) -> None:
    document = tmp_path / "doc.md"
    document.write_text("\n".join([
        "<!-- not run: needs a GPU -->", "```python", "kernel = 'cudnn'", "```", "",
        "<!-- dump: rank0/graph_0/matches.md -->", "| a |", "|---|", "",
        "| a table without a marker |", "", "```bash", "ls", "```",
    ]))
    assert [(b.line, b.language, b.marker, b.argument, b.text) for b in blocks(document)] == [
        (2, "python", "not run", "needs a GPU", "kernel = 'cudnn'"),
        (7, "table", "dump", "rank0/graph_0/matches.md", "| a |\n|---|"),
        (12, "bash", None, "", "ls"),
    ]
    document.write_text("<!-- not-run: a typo -->\n```python\n```\n")
    with pytest.raises(ValueError, match="unknown marker 'not-run'"):
        blocks(document)


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the documented command's dump (``hcp_dump``), written in a fresh folder.

    The command's ranks run in the fork server's processes with torchrun's variables set,
    where compile_model.py runs its worker in the process instead of spawning one interpreter
    per rank (seconds of CPU each): the same worker, arguments and mesh."""
    if not torch.__version__.startswith(DUMP_TORCH + "."):
        pytest.skip(f"the excerpts are torch {DUMP_TORCH}'s dump; this is torch {torch.__version__}")
    folder = tmp_path_factory.mktemp("dump")
    args = DUMP_COMMAND.split()[2:]
    command = Source("<dump command>", 1, "\n".join([
        "import compile_model",  # examples/ is on the path of pytest's processes (pythonpath)
        f"raise SystemExit(compile_model.main({args!r}))",
    ]))
    run_on_ranks([command], DUMP_RANKS, folder)
    return folder / "hcp_dump"


def test_dump_command_and_torch_are_the_documented_ones() -> None:
    documented = " ".join(DUMP_DOC.read_text().split())
    assert DUMP_COMMAND in documented
    assert f"torch {DUMP_TORCH}" in documented


@pytest.mark.parametrize("block", DUMP_EXCERPTS, ids=lambda b: f"{b.id} {b.argument}")
def test_dump_excerpt_is_what_the_command_dumps(block: Block, dump: Path) -> None:
    """The excerpt equals the selection of :func:`snippets.dump_excerpt` from the fresh dump;
    nothing else is normalized (the selection leaves out the comments, which name paths)."""
    produced = dump_excerpt(dump / block.argument)
    assert block.text.strip() == produced, (
        f"{block.id}: the excerpt of {block.argument} differs from the dump; what the dump gives "
        f"(paste it as the block):\n{produced}"
    )
