"""A process world that serves requests one at a time (what hypothesis-driven CP tests need).

:func:`worlds.run_world` runs a suite known in advance; a property test draws its cases in the
parent, one example at a time. :class:`ServedWorld` starts the ranks of one mesh once (from the
same fork server), then for each :meth:`ServedWorld.ask` every rank runs
``handler(world, request)`` and saves its record; the parent waits for all of them. A rank whose
handler raised exits (its peers may be left inside a collective), and a world that lost a rank
or passed the request's deadline is killed: the request fails with the world's log, and the
caller starts a new world for the next one (:attr:`ServedWorld.alive`).
"""

from __future__ import annotations

import datetime
import itertools
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .worlds import (
    COLLECTIVE_TIMEOUT_S, FAILED_PEER_GRACE_S, WORLD_DIR_ENV, CaseRecord, World, WorldResults, fork_server,
    free_port, kill_running, output_to, record_of, suite_function,
)

ABORT_EXIT = 3  # a rank's exit code after its handler raised: its world cannot go on
POLL_S = 0.02
STOP_FILE = "stop"


class ServedWorld:
    """``ulysses * ring`` ranks on ``device_type`` (CUDA: every rank on device 0, over gloo)
    running ``handler`` ("module:function") on each request."""

    def __init__(self, ulysses: int, ring: int, handler: str, device_type: str = "cpu",
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S):
        self.mesh, self.handler = (ulysses, ring), handler
        self.folder = Path(tempfile.mkdtemp(prefix="hcp_served_"))
        (self.folder / "shared").mkdir()
        self.log = self.folder / "log.txt"
        self.log.touch()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               WORLD_DIR_ENV: str(self.folder / "shared")}
        # a CUDA rank starts from a fresh interpreter: a forked one cannot initialize CUDA where
        # its parent (or the fork server's) already did
        context = multiprocessing.get_context("spawn") if device_type == "cuda" else fork_server()
        self.procs = [
            context.Process(target=_served_rank, name=f"hcp-served-{rank}",
                                  args=(rank, ulysses, ring, device_type, handler, self.folder, env, self.log,
                                        collective_timeout_s))
            for rank in range(ulysses * ring)
        ]
        self.requests = itertools.count()
        self.alive = True
        for proc in self.procs:
            proc.start()

    def ask(self, request: object, deadline_s: float) -> list[dict]:
        """Every rank's value of ``handler(world, request)``; raises AssertionError (and ends
        the world) when a rank raised, died or passed ``deadline_s``."""
        assert self.alive, "this world ended; start a new one"
        index = next(self.requests)
        _save(self.folder / f"request{index}.pt", request)
        expected = [self.folder / f"{index}.rank{rank}.pt" for rank in range(len(self.procs))]
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and not all(p.exists() for p in expected):
            if any(p.exitcode is not None for p in self.procs):
                deadline = min(deadline, time.monotonic() + FAILED_PEER_GRACE_S)
            time.sleep(POLL_S)
        records = {rank: CaseRecord(**torch.load(path, weights_only=False))
                   for rank, path in enumerate(expected) if path.exists()}
        complete = len(records) == len(self.procs) and not any(r.raised for r in records.values())
        if not complete:
            self.alive = False
            kill_running(self.procs)  # at once: the others may wait for a lost rank until their timeout
        case_id = f"request {index}"
        results = WorldResults(self.mesh, {case_id: records}, [p.exitcode for p in self.procs],
                               self.log.read_text(), self.handler)
        if not complete:
            shutil.rmtree(self.folder, ignore_errors=True)
        raised = [f"rank {rank} {record.describe()}\n{record.traceback}" for rank, record in records.items()
                  if record.raised]  # each: a lost peer's error in the others comes with its cause
        assert not raised, "\n".join(raised)
        return results.values(case_id)

    def close(self) -> None:
        """Ask the ranks to stop, then end those that did not."""
        if self.alive:
            self.alive = False
            (self.folder / STOP_FILE).touch()
            deadline = time.monotonic() + FAILED_PEER_GRACE_S
            while time.monotonic() < deadline and any(p.exitcode is None for p in self.procs):
                time.sleep(POLL_S)
            kill_running(self.procs)
            shutil.rmtree(self.folder, ignore_errors=True)


def _save(path: Path, value: object) -> None:
    torch.save(value, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)  # the reader never sees a half-written file


def _next_request(folder: Path, index: int) -> object | None:
    """Request ``index`` once it is written; None when the world is asked to stop."""
    path = folder / f"request{index}.pt"
    while not path.exists():
        if (folder / STOP_FILE).exists():
            return None
        time.sleep(POLL_S)
    return torch.load(path, weights_only=False)


def _served_rank(rank: int, ulysses: int, ring: int, device_type: str, handler: str, folder: Path,
                 env: dict[str, str], log: Path, collective_timeout_s: float) -> None:
    import hcp_compile as hc

    output_to(log)
    os.environ.update(env)
    world_size = ulysses * ring
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # the ranks share the cores
    if device_type == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU: gloo stages through the host
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    world = World(hc.make_mesh(ulysses, ring, device_type), rank, ulysses, ring)
    serve = suite_function(handler)
    for index in itertools.count():
        request = _next_request(folder, index)
        if request is None:
            break
        record = record_of(lambda: serve(world, request))
        _save(folder / f"{index}.rank{rank}.pt", record)
        if "error_types" in record:
            os._exit(ABORT_EXIT)  # no teardown: a peer may wait in a collective this rank left
    dist.destroy_process_group()
