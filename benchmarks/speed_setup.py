"""What every mode of benchmarks.speed needs: the :class:`Setup` (options, device, ranks,
meshes), a workload's global :class:`Batch` on the device (its ``cu_seqlens``, q, k and v), and
torch's fake process group for one rank alone (``--fake-rank``)."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import hcp_compile
from benchmarks.cp_throughput import causal_flops
from benchmarks.speed_workloads import HEADS, Workload


@dataclass
class Setup:
    """What every mode needs: the options, the device, the ranks and the meshes."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    rank: int
    world: int
    fake: bool = False  # --fake-rank: this process is the only one; its peers' collectives are fake
    started: float = field(default_factory=time.perf_counter)
    _hcp_mesh: DeviceMesh | None = None
    _sequence_mesh: DeviceMesh | None = None

    def hcp_mesh(self) -> DeviceMesh:
        if self._hcp_mesh is None:
            self._hcp_mesh = hcp_compile.make_mesh(self.args.ulysses, self.args.ring, self.device.type)
        return self._hcp_mesh

    def layout_window(self, window: tuple[int, int]) -> tuple[int, int]:
        """The window hcp's layout balances for: the workload's (``--layout-window on``, what a
        trainer that knows its model's window passes to ``shard_plan``) or none (the default)."""
        return window if self.args.layout_window == "on" else (-1, -1)

    def sequence_mesh(self) -> DeviceMesh:
        """The 1-D mesh of all ranks that torch's native CP shards over."""
        if self._sequence_mesh is None:
            self._sequence_mesh = init_device_mesh(self.device.type, (self.world,))
        return self._sequence_mesh

    @property
    def leads(self) -> bool:
        """This process runs the one-GPU modes, collects the rows and reports them."""
        return self.rank == 0 or self.fake

    def say(self, text: str) -> None:
        if self.leads:
            print(f"[{time.perf_counter() - self.started:7.1f} s] {text}", flush=True)


@dataclass
class Batch:
    """One workload's global batch for one head configuration, the same on every rank."""

    workload: Workload
    heads: str
    cu: Tensor
    longest: int
    q: Tensor  # [T, Hq, D]
    k: Tensor  # [T, Hkv, D]
    v: Tensor

    @classmethod
    def make(cls, workload: Workload, heads: str, setup: Setup) -> "Batch":
        cu = cu_seqlens(workload.lengths, setup.device)
        tokens, head_dim = sum(workload.lengths), setup.args.head_dim
        gen = torch.Generator(setup.device).manual_seed(0)  # the same tensors on every rank
        q, k, v = (torch.randn(tokens, h, head_dim, generator=gen, device=setup.device, dtype=setup.dtype)
                   for h in (HEADS[heads][0], HEADS[heads][1], HEADS[heads][1]))
        return cls(workload, heads, cu, max(workload.lengths), q, k, v)

    @property
    def qkv(self) -> list[Tensor]:
        return [self.q, self.k, self.v]

    def flops(self) -> float:
        return causal_flops(list(self.workload.lengths), self.q.shape[1], self.q.shape[2],
                            self.workload.window_left)


def cu_seqlens(lengths: Sequence[int], device: torch.device) -> Tensor:
    """The int32 ``cu_seqlens`` of documents of these lengths, on ``device``."""
    lengths = torch.tensor(lengths)
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device, torch.int32)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU), before a host clock reads."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def init_fake(rank: int, world: int) -> None:
    """Make this process rank ``rank`` of a ``world`` over torch's fake process group, whose
    collectives return at once and move no data (``--fake-rank``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


@contextlib.contextmanager
def fake_process_group(rank: int, world: int) -> Iterator[None]:
    """Inside the block this process is rank ``rank`` of a ``world`` over the fake process
    group (:func:`init_fake`); destroyed on the way out."""
    init_fake(rank, world)
    try:
        yield
    finally:
        dist.destroy_process_group()
