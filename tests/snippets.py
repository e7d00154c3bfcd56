"""The code blocks of README.md and docs/*.md, and running a program on several gloo ranks.

A block is a fenced code block, or a markdown table right after a ``dump`` marker. A marker is
an HTML comment (invisible on the rendered page) on the line before the block:

- ``<!-- not run: REASON -->``: the block is skipped, REASON shown in pytest's skip summary;
- ``<!-- setup: PATH -->``: PATH (a Python file, relative to the repository) runs first, in the
  same namespace: it defines what the block takes as given;
- ``<!-- module: NAME -->``: the block is code of module NAME; a module that does not exist is
  a new file the document adds (the block then runs as that module, registered under NAME),
  one that exists gets the block's lines added (they run in a copy of its namespace);
- ``<!-- dump: FILE -->``: the block is an excerpt of rank 0's FILE of the compiled path's dump
  (:func:`dump_excerpt`), compared with a fresh dump instead of run.

Every other ``python`` block runs as a script, on the number of processes that a
``torchrun --nproc-per-node N`` in it (or in its setup) names, else one. The ranks are forked
from the fork server of hcp_compile/testing/worlds.py, which has imported torch and hcp_compile already,
and get torchrun's environment variables, so ``dist.init_process_group("gloo")`` works as under
torchrun.
"""

from __future__ import annotations

import os
import re
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from hcp_compile.testing import worlds

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = ("not run", "setup", "module", "dump")
MARKER = re.compile(r"<!--\s*([\w -]+):\s*(.+?)\s*-->")
PROCESSES = re.compile(r"torchrun --nproc-per-node (\d+)")
RUN_DEADLINE_S = 240  # a whole run, generous: the machine's 2 cores may be shared
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class Source:
    """Code to run, named by the file it comes from so that tracebacks point into it."""

    filename: str
    first_line: int
    text: str


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, or of a table's first row (1-based)
    language: str  # the fence's info string; "table" for a table
    text: str
    marker: str | None = None  # one of MARKERS
    argument: str = ""  # what follows the marker's colon

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"

    @property
    def first_line(self) -> int:
        """The document's line number of the block's first line of code."""
        return self.line if self.language == "table" else self.line + 1

    @property
    def source(self) -> Source:
        return Source(str(self.path), self.first_line, self.text)


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, and the tables after ``dump`` markers."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("```"):
            end = next(j for j in range(index + 1, len(lines)) if lines[j].startswith("```"))
            found.append(Block(path, index + 1, line[3:].strip(), "\n".join(lines[index + 1:end]),
                               *_marker_before(lines, index, path)))
            index = end + 1
        elif line.startswith("|"):
            end = next((j for j in range(index, len(lines)) if not lines[j].startswith("|")),
                       len(lines))
            marker, argument = _marker_before(lines, index, path)
            if marker == "dump":
                found.append(Block(path, index + 1, "table", "\n".join(lines[index:end]), marker,
                                   argument))
            index = end
        else:
            index += 1
    return found


def _marker_before(lines: list[str], index: int, path: Path) -> tuple[str | None, str]:
    previous = next((lines[j] for j in range(index - 1, -1, -1) if lines[j].strip()), "")
    match = MARKER.fullmatch(previous.strip())
    if match is None:
        return None, ""
    if match[1] not in MARKERS:  # a typo must not silently turn a marker into a plain block
        raise ValueError(f"{path.name}:{index}: unknown marker {match[1]!r}; known: {MARKERS}")
    return match[1], match[2]


def python_blocks() -> list[Block]:
    return [b for path in DOCUMENTS for b in blocks(path) if b.language == "python"]


def program(block: Block) -> list[Source]:
    """What a script block runs: its setup file, if any, then the block."""
    if block.marker != "setup":
        return [block.source]
    setup = ROOT / block.argument
    return [Source(str(setup), 1, setup.read_text()), block.source]


def processes(sources: list[Source]) -> int:
    match = PROCESSES.search("\n".join(s.text for s in sources))
    return int(match[1]) if match else 1


def code_of(source: Source) -> types.CodeType:
    """The code object of ``source``, its line numbers those of its file."""
    return compile("\n" * (source.first_line - 1) + source.text, source.filename, "exec")


# --------------------------------------------------------------------------------------------
# running on ranks
# --------------------------------------------------------------------------------------------

def run_on_ranks(sources: list[Source], world: int, cwd: Path,
                 deadline_s: float = RUN_DEADLINE_S) -> None:
    """Run ``sources`` in one namespace on each of ``world`` ranks (as ``__main__``, in
    ``cwd``); raises AssertionError with the failed ranks' output unless every rank exits 0."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(worlds.free_port()),
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    logs = [cwd / f"rank{rank}.log" for rank in range(world)]
    for log in logs:  # readable even for a rank that fails before it opens its log
        log.touch()
    context = worlds.fork_server()
    procs = [context.Process(target=_rank_main, name=f"snippet-rank-{rank}",
                             args=(rank, env, sources, cwd, logs[rank]))
             for rank in range(world)]
    try:
        for proc in procs:
            proc.start()
        return_codes = worlds.wait_all(procs, time.monotonic() + deadline_s)
    finally:  # also when the wait is interrupted: no rank outlives the call
        worlds.kill_running(procs)
    failed = [rank for rank, code in enumerate(return_codes) if code != 0]
    if failed:
        output = "\n".join(f"--- rank {rank} (exit code {return_codes[rank]}):\n"
                           f"{logs[rank].read_text()[-LOG_TAIL_CHARS:]}" for rank in failed)
        raise AssertionError(f"{sources[-1].filename}: ranks {failed} failed\n{output}")


def _rank_main(rank: int, env: dict[str, str], sources: list[Source], cwd: Path,
               log: Path) -> None:
    worlds.output_to(log)
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    os.chdir(cwd)  # what a snippet writes lands in the test's folder
    torch.set_num_threads(1)  # several ranks share the test machine's cores
    namespace = {"__name__": "__main__"}
    for source in sources:
        exec(code_of(source), namespace)


# --------------------------------------------------------------------------------------------
# the compiled path's dump
# --------------------------------------------------------------------------------------------

# The statements of a dumped graph that an excerpt shows: calls of an hcp op, of a function
# the rewrite inserts, or of a collective.
DUMP_STATEMENT = re.compile(r"torch\.ops\.hcp\.|hcp_compile_compiled_|torch\.ops\._c10d_functional\.")
RELEASES = re.compile(r";\s+(\w+ = )+None$")  # FX's trailing "x = y = None" statements


def dump_excerpt(file: Path) -> str:
    """What a ``dump`` block shows of a dump file: a ``.md`` file whole; of a graph's code, the
    statements that match :data:`DUMP_STATEMENT`, without indentation and FX's trailing
    ``x = None`` statements (comments, which hold the machine's paths, are not statements)."""
    text = file.read_text()
    if file.suffix == ".md":
        return text.strip()
    statements = (line.strip() for line in text.splitlines())
    return "\n".join(RELEASES.sub("", s) for s in statements
                     if not s.startswith("#") and DUMP_STATEMENT.search(s))
