"""Process worlds: many test cases inside one multi-process gloo world per context-parallel mesh.

The parent (pytest) calls :func:`run_world` once per ``(ulysses, ring)`` mesh and suite: it
starts the world's ranks, each rank runs every case of the suite (``suite="module"``: the
module's function ``suite(mesh)``; ``"module:function"`` names another list, e.g.
``"compile_cases"`` for the compiled path of the tests) in order and saves one record per case
right after running it, and the parent collects the records. A case that raises is recorded
(exception type and message), not fatal; a world that crashes or hangs is killed at its
deadline and the cases it did not finish report that. Processes are started once per mesh,
never per test.

The ranks are forked from one server process per session that has imported torch, hcp_compile
and the case modules (multiprocessing's "forkserver"): each rank still starts as a fresh
process with no torch state initialized, without paying the seconds of CPU that importing
torch costs, for every rank of every world, on the test machine's 2 cores.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

WORLD_DEADLINE_S = 240  # a whole world, process start-up included
COLLECTIVE_TIMEOUT_S = 60  # gloo's timeout inside the workers: a mismatch errors, not hangs
FAILED_PEER_GRACE_S = 10  # how long the other ranks may go on after one rank died
WORLD_DIR_ENV = "HCP_TEST_WORLD_DIR"  # a folder every rank of a world shares (removed after it)
# imported once by the fork server, so no rank imports them again: torch and hcp_compile
# (seconds), and what a rank's first torch.compile would import (seconds more). Installed
# packages only: the server does not get the parent's sys.path (the ranks do). Not
# transformers: hf_cases checks that importing hcp_compile does not import it.
PRELOADED = ["torch", "torch.distributed", "hcp_compile", "torch._functorch.aot_autograd",
             "torch._functorch.partitioners", "torch._dynamo.backends.debugging",
             "torch._inductor.compile_fx"]


@dataclass
class World:
    """What a case sees on its rank."""

    mesh: object  # the ("ring", "ulysses") DeviceMesh of this world
    rank: int
    ulysses: int
    ring: int


@dataclass
class CaseRecord:
    """What one rank reported for one case."""

    value: dict | None = None  # the case's result, when it returned
    error_types: tuple[str, ...] = ()  # qualified names of the raised exception's classes
    message: str = ""
    traceback: str = ""

    @property
    def raised(self) -> bool:
        return bool(self.error_types)

    def raised_instance_of(self, cls: type) -> bool:
        return qualified_name(cls) in self.error_types

    def describe(self) -> str:
        if not self.raised:
            return "returned normally"
        return f"raised {self.error_types[0]}: {self.message}"


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class WorldResults:
    mesh: tuple[int, int]
    records: dict[str, dict[int, CaseRecord]]  # case id -> rank -> record
    return_codes: list[int | None]
    log: str
    suite: str

    @property
    def size(self) -> int:
        return self.mesh[0] * self.mesh[1]

    def per_rank(self, case_id: str) -> list[CaseRecord]:
        """Every rank's record of a case; fails the test when some rank has none."""
        by_rank = self.records.get(case_id, {})
        missing = [r for r in range(self.size) if r not in by_rank]
        if missing:
            raise AssertionError(
                f"ranks {missing} of mesh ulysses x ring = {self.mesh} (suite {self.suite}) left "
                f"no result for {case_id!r} (exit codes {self.return_codes}); end of the world's "
                f"log:\n"
                f"{self.log[-4000:]}"
            )
        return [by_rank[r] for r in range(self.size)]

    def values(self, case_id: str) -> list[dict]:
        """Every rank's returned value; fails the test when some rank raised instead."""
        records = self.per_rank(case_id)
        for rank, record in enumerate(records):
            if record.raised:
                raise AssertionError(f"rank {rank} {record.describe()}\n{record.traceback}")
        return [record.value for record in records]


@contextlib.contextmanager
def fake_world(ulysses: int, ring: int, rank: int = 0) -> Iterator[object]:
    """Inside the block this process is rank ``rank`` of a ``ulysses x ring`` world over torch's
    fake process group (collectives return at once and move no data): the rank's mesh, for
    what a rank derives alone (layouts, plans, host work); destroyed on the way out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hcp_compile as hc

    assert not dist.is_initialized(), "another test left torch.distributed initialized"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ulysses * ring)
    try:
        yield hc.make_mesh(ulysses=ulysses, ring=ring, device_type="cpu")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(ulysses: int, ring: int, suite: str, deadline_s: float = WORLD_DEADLINE_S) -> WorldResults:
    """Start ``ulysses * ring`` ranks, run the mesh's ``suite`` in each, collect the records."""
    world = ulysses * ring
    with tempfile.TemporaryDirectory(prefix="hcp_world_") as tmp:
        out = Path(tmp)
        shared = out / "shared"
        shared.mkdir()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               WORLD_DIR_ENV: str(shared)}
        log = out / "log.txt"
        log.touch()
        procs = [
            fork_server().Process(target=_rank_main, name=f"hcp-rank-{rank}",
                                  args=(rank, ulysses, ring, out, suite, env, log))
            for rank in range(world)
        ]
        try:
            for proc in procs:
                proc.start()
            return_codes = wait_all(procs, time.monotonic() + deadline_s)
        finally:  # also when the wait is interrupted: no rank outlives the call
            kill_running(procs)
        records: dict[str, dict[int, CaseRecord]] = {}
        for path in sorted(out.glob("*.pt")):
            saved = torch.load(path, weights_only=False)
            case_id, rank = saved.pop("key")
            records.setdefault(case_id, {})[rank] = CaseRecord(**saved)
        log_text = log.read_text()
    return WorldResults((ulysses, ring), records, return_codes, log_text, suite)


def fork_server() -> multiprocessing.context.BaseContext:
    """The start method of the ranks; the server starts (and imports :data:`PRELOADED`) with
    the first world and serves every later one."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)  # read when the server starts
    return context


def wait_all(procs: list, deadline: float) -> list[int | None]:
    """Exit codes once every process ended, or at ``deadline``, or a grace period after one of
    them failed (its peers would wait for it in a collective); None for those still running."""
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + FAILED_PEER_GRACE_S)
        time.sleep(0.05)
    return [proc.exitcode for proc in procs]


def kill_running(procs: list) -> None:
    for proc in procs:  # each by its own handle: only the processes this module started
        if proc.pid is not None:
            if proc.exitcode is None:
                proc.kill()
            proc.join()


# --------------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------------

def output_to(log: Path) -> None:
    """This process's stdout and stderr appended to ``log``, line by line."""
    with open(log, "ab", buffering=0) as file:
        for stream in (1, 2):  # the file descriptors: also what native code writes
            os.dup2(file.fileno(), stream)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def run_script(script: Path, args: list[str], deadline_s: float) -> str:
    """The output of ``python script *args`` (an example that spawns its own ranks); fails the
    test with it when the run fails. A run past the deadline is ended with its whole process
    group."""
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )
    try:
        output, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this call started, nothing else
        output, _ = proc.communicate()
        raise AssertionError(f"{script.name} {' '.join(args)} ran past {deadline_s} s:\n{output}") from None
    assert proc.returncode == 0, f"{script.name}: exit code {proc.returncode}:\n{output}"
    return output


def _rank_main(rank: int, ulysses: int, ring: int, out: Path, suite: str, env: dict[str, str],
               log: Path) -> None:
    """A rank's process: its output appended to the world's log, the world's variables set."""
    output_to(log)
    os.environ.update(env)
    _worker(rank, ulysses, ring, out, suite)
    # a forked rank then ends without the interpreter's teardown of torch (seconds of CPU per
    # process, and a suite starts dozens of them on 2 cores)


def record_of(run: Callable[[], dict]) -> dict:
    """The fields of a :class:`CaseRecord`, saved as a plain dict (read by the parent)."""
    try:
        value = run()
    except Exception as exc:  # noqa: BLE001 - every failure is a result to report
        return {"error_types": tuple(qualified_name(c) for c in type(exc).__mro__),
                "message": str(exc), "traceback": traceback.format_exc()}
    return {"value": _detached(value)}


def _detached(value: dict) -> dict:
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            for k, v in value.items()}


def suite_function(suite: str) -> Callable:
    module, _, function = suite.partition(":")
    return getattr(importlib.import_module(module), function or "suite")


def _worker(rank: int, ulysses: int, ring: int, out: Path, suite: str) -> None:
    import hcp_compile as hc

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=ulysses * ring,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    world = World(hc.make_mesh(ulysses, ring, "cpu"), rank, ulysses, ring)
    for index, case in enumerate(suite_function(suite)((ulysses, ring))):
        started = time.monotonic()
        record = record_of(lambda: case.run(world))
        if rank == 0:  # in the world's log: where a world's time goes
            print(f"case {case.id}: {time.monotonic() - started:.1f} s", flush=True)
        path = out / f"{index:04d}.rank{rank}.pt"
        torch.save({"key": (case.id, rank), **record}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)  # the parent never sees a half-written record
    dist.destroy_process_group()
