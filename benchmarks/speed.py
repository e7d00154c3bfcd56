"""Speed of hierarchical CP against the best one-GPU kernel and PyTorch's native context
parallelism, on packed workloads: one table, one JSON file, optionally one plot.

Launch from the repository root, one process per GPU (ulysses A x ring R = the world size):
    torchrun --nproc-per-node 2 -m benchmarks.speed --ulysses 2 --ring 1
    torchrun --nproc-per-node 2 -m benchmarks.speed --ulysses 1 --ring 2 --workloads W2,W3 --heads gqa
    torchrun --nproc-per-node 1 -m benchmarks.speed --modes one-gpu-flex,one-gpu-flash
Per-rank memory of 2 ranks on a machine of one GPU (both on cuda:0, over gloo; no speeds):
    torchrun --nproc-per-node 2 -m benchmarks.speed --share-gpu --ulysses 2 --ring 1
One rank's work without its communication, on a machine of one GPU (rank 1 of ulysses 1 x ring 2):
    python -m benchmarks.speed --fake-rank 1 --ulysses 1 --ring 2 --heads gqa
Merge the JSON files of split runs into one table (efficiencies are recomputed over all rows):
    python -m benchmarks.speed --merge a.json b.json --out all.json --plot all.png
A stream (below): 60 steps of new W2 batches, 4 attention calls each, on one GPU; one rank of
ulysses 1 x ring 2 alone; the per-rank memory of ulysses 2 x ring 1 on one GPU:
    python -m benchmarks.speed --stream 60 --layers 4 --workloads W2-128K \
        --modes one-gpu-hcp,one-gpu-flash,one-gpu-flex --plot stream.png
    python -m benchmarks.speed --stream 60 --layers 4 --workloads W2-128K --heads gqa \
        --fake-rank 1 --ulysses 1 --ring 2 --modes one-gpu-hcp,hcp-eager,hcp-compiled
    torchrun --nproc-per-node 2 -m benchmarks.speed --stream 60 --layers 4 --workloads W2-128K \
        --share-gpu --ulysses 2 --ring 1 --modes hcp-eager,hcp-compiled
Every batch composition in one process (``--mixed``, below), one mode per process, then one table:
    for m in one-gpu-flash one-gpu-hcp one-gpu-flex; do python -m benchmarks.speed --mixed 200 --layers 4 \\
        --heads gqa --modes $m --out mixed_$m.json; done
    python -m benchmarks.speed --merge mixed_one-gpu-*.json --out mixed.json
Time and memory of one call as the tokens grow (``--scale``, below):
    python -m benchmarks.speed --scale 128K,256K,512K,1M --heads gqa
(one process needs no torchrun: plain python runs a world of one.)
CPU smoke test of the plumbing (gloo, 512-token batches, the torch kernel; under 2 minutes on
2 cores). Of the one-GPU modes only hcp's and dense SDPA run there (flash needs CUDA; torch's
flex has no CPU backward, its row records that error), so the efficiencies are against those:
    torchrun --nproc-per-node 2 -m benchmarks.speed --device cpu --ulysses 2 --ring 1 \\
        --shrink 256 --head-dim 16 --dtype float32 --heads mha --workloads W1-128K,W4-128K \\
        --out /tmp/speed_smoke.json

Every step is causal attention, forward + backward, head_dim 128, bf16, 32 query heads over 8
KV heads (``gqa``) or 32 (``mha``), on these packed batches (lengths seeded, the same on every
rank and in every run):
- W1-128K, W1-256K: one document of 128K / 256K tokens;
- W2-128K, W2-256K: document lengths log-uniform in 256..32K, 128K / 256K tokens in all;
- W3-128K, W3-256K: lengths log-uniform in 128..2K, 128K / 256K tokens;
- W4-128K, W4-256K: the W2 batches under a sliding window (left 4096, right 0);
- W2-512K, W2-1M, W4-1M: W2's lengths, 512K / 1M tokens, W4-1M under W4's window (1M: 131K per
  rank of 8, the ring-8 ceilings; only when named, and W2's in ``--scale``).

Modes (``--modes``; default all that apply):
- ``one-gpu-flex``: torch's ``flex_attention``, compiled, on the whole batch with a document +
  causal (+ window) block mask from ``create_block_mask``; ``enable_gqa`` for GQA.
- ``one-gpu-sdpa``: dense causal ``F.scaled_dot_product_attention`` on ``[1, H, T, D]``
  (torch's backend choice), on one-document workloads only (W1), where it is exact.
- ``one-gpu-hcp``: hcp's single-device ``varlen_attention`` (no context parallelism) on the
  whole batch, kernel as ``--kernel`` resolves it.
- ``one-gpu-flash``: ``aten._flash_attention_forward`` (torch's varlen flash, what hcp's flash
  kernel wraps) on the whole batch, KV heads unrepeated (flash handles GQA), autograd backward.
- ``hcp-eager``, ``hcp-compiled``: hcp_compile on this rank's shard for each placement
  (``--placements``), eagerly in ``context_parallel`` and with ``torch.compile(backend="hcp")``
  (Inductor on CUDA); the compiled modules are reused across workloads (dynamic shapes). The
  kernel column is the one ``--kernel`` (default auto) resolves to, as hcp resolves it (under a
  window, flash cannot run a ring step, so auto takes another kernel). ``--recompute-exchange
  on|both`` runs them with hcp's ``recompute_exchange`` option (too, with ``both``).
- ``torch-native-cp``: ``torch.distributed.tensor.experimental.context_parallel`` (SDPA ring,
  head-tail load balancing) over all ranks, on W1 with MHA only (it knows no documents and no GQA).
The one-GPU modes run on rank 0 while the other ranks wait at a barrier, so that they are
measured in the same run as the CP modes. The fastest of them is "best one GPU".

Columns: ms = median fwd+bwd of ``--iters`` after ``--warmup`` (for compiled modes the first
call, the compile, is the first warm-up; its seconds are first_call_s in the JSON); TF/s per GPU counts only visible pairs (causal,
inside the window), 7 products of 2·D FLOPs per pair and query head; eff = best one-GPU ms /
(GPUs x ms); peak GiB = what one more fwd+bwd call allocates at its peak beyond what was
allocated before it (``one_call_peak``: after the timed steps, with none of their outputs,
gradients or graphs alive, so the figure repeats from run to run). Not counted: the inputs q,
k, v and the output gradient (and flex's block mask, and what a kernel keeps from earlier
calls). Counted: the output, dq, dk, dv, what the forward saves and the kernel's workspace.
peak/1GPU = its ratio to the best one-GPU
mode's; saved GiB = the largest memory a rank's forward allocates and still holds when it returns
(the output and what the backward needs: what a model holds per layer until its backward), and
its ratio; exposed comm = in one profiled step of rank 0, the time some NCCL kernel runs while no
other kernel does, in ms and in % of the traced step (first kernel start to last kernel end). A
failing mode (compile error, OOM, unsupported) is a row with its error; the run goes on. The JSON
file is rewritten after every row, so a run cut short keeps what it measured. ``--trace DIR`` also
traces the host in the profiled step (of every mode, the one-GPU ones included), keeps each
rank's trace in DIR and prints the step's span, busy time and top kernels. ``--memory-peak``
records the CUDA allocator's history over that one call and prints, on
rank 0, the places holding most of its peak (``common.live_at_peak``). ``--share-gpu``
puts every rank on cuda:0 and runs the collectives over gloo (staged through the host): the
CP rows then keep their peak memory, which is the same allocations as on one GPU per rank,
and leave out their times (mesh ``AxR shared``); the one-GPU rows run alone and keep theirs.
``--fake-rank R`` runs one process alone as rank R of the ulysses x ring world over torch's fake
process group, whose collectives return at once and move no data: the CP rows (mesh ``AxR
rank R alone``) then time exactly that rank's kernels, layout copies and merges with no
communication and no waiting for the other ranks, so their efficiency is an upper bound on
what a real run of that mesh reaches (their outputs are not the attention: what the
collectives would have delivered is whatever memory the allocator hands out). Before each CP
mode the GPU's free memory is filled with normal samples, so that those buffers hold values
like real activations: zeros (fresh memory from the driver) would run the tensor cores
faster than real data does. The one-GPU rows run as usual.

Stream mode (``--stream N --layers L``): training is no batch repeated but a stream,
every step a batch of new document lengths through every layer. Step s draws its lengths from
the workload's distribution (W2, W4: log-uniform 256..32K; W3: 128..2K; as many tokens as the
workload) seeded (workload seed, s), the same on every rank and in every run (step 0 is the
batch above; W1's one document is the same batch every step). A step: ``cu_seqlens`` to the
device, then what a trainer builds per batch (hcp's CP modes: ``shard_plan``; one-gpu-flex: its
block mask, ``create_block_mask`` compiled), then L attention calls on it (the layers, each on
its own q, k and v), forward, then backward, then a synchronize; its time is the host clock
over all of it (the ranks of a CP mode start each step together; a step's time is its slowest
rank's). The layers' inputs are random buffers made before the stream and sliced per step (a
CP rank's are born sharded: it pays the plan, not a shard of every layer). Every mode's stream
starts from a clean slate: Dynamo's graphs and hcp's caches of earlier batches dropped (the
one-gpu-flex and hcp-compiled streams compile in their first steps, one module for the stream,
dynamic shapes; Inductor's caches on disk stay). Modes: the one-GPU ones (flex, flash, hcp, sdpa
on W1), hcp-eager and hcp-compiled, with ``--fake-rank`` (one rank's time) and ``--share-gpu``
(its memory, no times) as above; no torch-native-cp, no profile. The stream rows' columns (a
table of their own; fields of the JSON rows): total s = the stream's time; TF/s/GPU = all its
visible-pair FLOPs over that (``tflops_per_gpu``); steady TF/s/GPU = the same over the last half
of the steps, from step N // 2 on (``steady_tflops_per_gpu``); eff, steady eff = against the
best one-GPU stream (``efficiency``: by time, ``steady_efficiency``: by steady TF/s); one-time %
= the share of the time beyond what all steps would take at the steady rate, 1 - overall /
steady (``one_time_pct``): the compiles, graph builds and other first-time work, which have no
clock of their own, as the excess over steady (negative where noise makes the first half
faster); first step s (``first_step_s``: the compiles show here); prepare ms = the median per
step of ``cu_seqlens`` to the device plus the plan or mask, part of the step times
(``prepare_ms``); graphs = Dynamo graphs compiled during the stream, recompiles included
(``graphs``); peak GiB = over the stream beyond the layers' inputs and the one output gradient
(made before it): a step's outputs, saved tensors and gradients of every layer, and the kernel's
workspace; cumulative s by tenth of the steps = the time at the end of step ceil(N i / 10),
i = 1..10 (``cumulative_s``, the last the total). The JSON keeps every step's ms (``step_ms``)
and ``stream_steps``, ``stream_layers``; the plot draws each stream's cumulative time against the
step.
``--plan-ahead``: the CP modes take each step's prepared batch (``hcp_compile.prepare_batch``
for this rank) from one DataLoader worker process that runs two steps ahead, as a trainer's
loader can; taking it is part of the step (a worker that falls behind shows), ``shard_plan``
then adopts it (plan ahead = yes). ``--trace DIR``: after the stream, two more steps of new
batches, the second traced (host and GPU) into ``DIR/<workload>_<heads>_<mode>_<placement>
_u<A>r<R>_stream_rank<r>.json.gz``: traced step / busy / plan ms = its host-clock time, the
time some kernel runs in it, and the plan's part (``traced_step_ms``, ``traced_busy_ms``,
``traced_plan_ms``); step minus busy is the time the GPU waited for the host (no
communication in a one-GPU or fake-rank stream).

Mixed stream (``--mixed N``): one process through every batch composition. A stream
as above (``--layers``, the modes, ``--kernel``, ``--fake-rank``) of N steps whose batches come
from the ``--workloads`` (default the eight of W1..W4 at 128K and 256K) in rounds that hold each
workload once, every round in a random order (seeded: the same in every run), step s a new batch
of its workload (lengths seeded (workload seed, s)); ``torch._dynamo.reset()`` before every K-th
step (``--mixed-reset K``, default 25; 0: never), outside the steps' times, as a notebook, an
evaluation loop or another compiled model would: the next steps compile again. One row per mode,
workload ``mixed``, in the streams' table (its steady TF/s over the last half, resets included;
``step_workloads`` and ``mixed_reset`` in the JSON), and a table of its own: overall over steady
TF/s; the first step and its excess over one-gpu-flash's first in the same run; per workload
(``first_extra_s``), its first step after the stream's first minus its median step after the
stream's first. A mode's stream starts reset, but in the process that ran the modes before it:
for a first step that is the process's, run one mode per process and ``--merge`` the files. A
failing step ends the row with an error that names the step and its workload.

Scale table (``--scale SIZES``, such as 128K,256K,512K,1M; one process, one GPU): at each size W2's
lengths (log-uniform 256..32K, seed 0), and per mode (one-gpu-hcp with ``--kernel``,
one-gpu-flex, one-gpu-flash; ``--modes`` picks among them) one call fwd+bwd: after ``--warmup``
calls (at least one), peak GiB = the ``max_memory_allocated`` of one call beyond what is allocated
before it: q, k, v and dout (and what the kernel keeps from earlier calls); then ms = the median
of ``--iters`` calls; TF/s as above; out+grads GiB = out, dq, dk and dv from their shapes
(``outputs_gib``: as many bytes as q, k, v and dout); extra GiB = peak minus out+grads (saved
tensors, workspaces, temporaries: ``extra_gib``), extra/inputs = that over the bytes of q, k, v
and dout (``extra_vs_inputs``); ms per FLOP / smallest's = the row's ms per causal FLOP over that
of the smallest size of its heads and mode (``flop_time_vs_smallest``: 1 where time grows as the
causal FLOPs), peak per token / smallest's likewise (``token_peak_vs_smallest``: 1 where memory
grows as the tokens). An out-of-memory error is the row's error; the cache is emptied and the run
goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import gzip
import itertools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import hcp_compile
from benchmarks.common import (
    exposed_length, kernel_intervals, kernel_summary, live_at_peak, log_uniform_lengths, stream_seed, union_intervals,
)
from benchmarks.cp_throughput import causal_flops, time_fwd_bwd
from hcp_compile.batch.layout import window_by_position
from hcp_compile.batch.prepared import PreparedBatch
from hcp_compile.kernels import KERNEL_CHOICES, BlockRequest, BoundedCache, KeysByValue, resolve_kernel

HEADS = {"gqa": (32, 8), "mha": (32, 32)}
ONE_GPU_MODES = ("one-gpu-flex", "one-gpu-flash", "one-gpu-sdpa", "one-gpu-hcp")
SCALE_MODES = ("one-gpu-hcp", "one-gpu-flex", "one-gpu-flash")  # --scale: hcp against torch's two kernels
MODES = (*ONE_GPU_MODES, "hcp-eager", "hcp-compiled", "torch-native-cp")
PLACEMENTS = ("balanced", "zigzag")
WINDOW_LEFT = 4096
NO_WINDOW = (-1, -1)
# the row (workload) of a --mixed stream
MIXED = "mixed"
# the note a stream's failing step adds to its exception, which the row's error starts with
STEP_NOTE = "at step"

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Workload:
    name: str
    lengths: tuple[int, ...]
    window_left: int = -1  # -1: no window
    spread: tuple[int, int, int] | None = None  # the lengths' (low, high, seed), log-uniform; None: one document

    @property
    def window(self) -> tuple[int, int]:
        return (self.window_left, 0) if self.window_left >= 0 else NO_WINDOW

    def step(self, step: int) -> "Workload":
        """Step ``step`` of a stream of this workload (``--stream``): as many tokens in new
        lengths from the same distribution, seeded (seed, step), the same on every rank and in
        every run; step 0 is this batch. One document is the same batch at every step."""
        if self.spread is None:
            return self
        low, high, seed = self.spread
        lengths = log_uniform_lengths(sum(self.lengths), low, high, seed=stream_seed(seed, step))
        return replace(self, lengths=tuple(lengths))


def workloads(shrink: int = 1) -> dict[str, Workload]:
    """The workloads by name; token counts, length ranges and the window divided by ``shrink``
    (tiny CPU runs keep the names)."""
    short = (_size(128, shrink), _size(2048, shrink), 1)  # (low, high, seed)
    result = [Workload(f"W1-{size_label(k)}", (_tokens(k, shrink),)) for k in (128, 256)]
    result += [log_uniform(k, shrink) for k in (128, 256)]
    result += [Workload(f"W3-{size_label(k)}", _drawn(k, short, shrink), spread=short) for k in (128, 256)]
    result += [replace(log_uniform(k, shrink), name=f"W4-{size_label(k)}", window_left=_size(WINDOW_LEFT, shrink))
               for k in (128, 256, 1024)]
    result += [log_uniform(k, shrink) for k in (512, 1024)]
    return {w.name: w for w in result}


def log_uniform(k: int, shrink: int = 1) -> Workload:
    """W2 at ``k`` K tokens (``W2-<size_label(k)>``): lengths log-uniform in 256..32K, seed 0,
    as :func:`workloads` describes (the batches of ``--scale``)."""
    spread = (_size(256, shrink), _size(32768, shrink), 0)
    return Workload(f"W2-{size_label(k)}", _drawn(k, spread, shrink), spread=spread)


def _tokens(k: int, shrink: int) -> int:
    return k * 1024 // shrink


def _size(n: int, shrink: int) -> int:
    return max(1, n // shrink)


def _drawn(k: int, spread: tuple[int, int, int], shrink: int) -> tuple[int, ...]:
    low, high, seed = spread
    return tuple(log_uniform_lengths(_tokens(k, shrink), low, high, seed=seed))


def size_label(k: int) -> str:
    """``k`` K tokens as a name writes it: 128K, 1M."""
    return f"{k // 1024}M" if k % 1024 == 0 else f"{k}K"


def parse_size(text: str) -> int:
    """A token count as ``--scale`` takes it, ``128K`` or ``1M``, in K tokens."""
    number, unit = text[:-1], text[-1:].upper()
    if unit not in ("K", "M") or not number.isdigit() or int(number) < 1:
        raise ValueError(f"expected a token count such as 128K or 1M, got {text!r}")
    return int(number) * (1024 if unit == "M" else 1)


# run only when named in --workloads (a one-GPU step takes seconds)
ONLY_WHEN_NAMED = ("W2-512K", "W2-1M", "W4-1M")


@dataclass
class Row:
    """One (workload, heads, mode, placement, mesh) measurement, of one batch repeated or of a
    stream (``--stream``: the stream_* fields set, ms None, tflops_per_gpu and efficiency over
    the whole stream); efficiency, steady_efficiency and the memory ratios are filled by
    :func:`relate` from the rows at hand."""

    workload: str
    heads: str
    mode: str
    placement: str  # "-" where the mode has none
    kernel: str
    mesh: str  # "AxR" for hcp ("AxR shared": --share-gpu), the world size for torch-native-cp, "1" for one GPU
    gpus: int
    ms: float | None = None
    tflops_per_gpu: float | None = None
    efficiency: float | None = None
    peak_gib: float | None = None
    peak_vs_one_gpu: float | None = None
    saved_gib: float | None = None
    saved_vs_one_gpu: float | None = None
    exposed_comm_ms: float | None = None
    exposed_comm_pct: float | None = None
    first_call_s: float | None = None
    error: str | None = None
    recompute_exchange: bool = False  # hcp's option of that name
    # a stream (--stream): its steps and attention calls per step; None: one batch repeated
    stream_steps: int | None = None
    stream_layers: int | None = None
    stream_s: float | None = None  # the stream's time, all steps
    steady_tflops_per_gpu: float | None = None  # over the last half of the steps
    steady_efficiency: float | None = None
    one_time_pct: float | None = None  # % of stream_s beyond all steps at the steady rate
    first_step_s: float | None = None
    prepare_ms: float | None = None  # median per step: cu_seqlens to the device, the plan or the mask
    graphs: int | None = None  # Dynamo graphs compiled during the stream (recompiles included)
    cumulative_s: list[float] | None = None  # time at the end of each tenth of the steps
    step_ms: list[float] | None = None
    plan_ahead: bool = False  # --plan-ahead: a CP stream's plans prepared by a DataLoader worker
    # --trace with --stream: one traced step after the stream (a new batch), on the host clock
    traced_step_ms: float | None = None  # the step, from its lengths to the end of its backward
    traced_busy_ms: float | None = None  # the time some kernel of the step runs
    traced_plan_ms: float | None = None  # the host's plan (or mask) inside it
    # --mixed: a stream whose steps meet several workloads (the row's workload is "mixed")
    step_workloads: list[str] | None = None  # each step's workload
    mixed_reset: int | None = None  # torch._dynamo.reset() before every this many steps (0: never)
    # per workload: its first step after the stream's first, minus its median step after the stream's first, s
    first_extra_s: dict[str, float | None] | None = None
    # --scale: one call on W2 lengths; peak_gib is then the peak beyond q, k, v and dout
    scale: bool = False
    outputs_gib: float | None = None  # out, dq, dk and dv, from their shapes: as many bytes as q, k, v, dout
    extra_gib: float | None = None  # peak_gib beyond outputs_gib
    extra_vs_inputs: float | None = None  # extra_gib over the bytes of q, k, v and dout
    flop_time_vs_smallest: float | None = None  # ms per causal FLOP over the smallest size's (heads, mode)
    token_peak_vs_smallest: float | None = None  # peak_gib per token over the smallest size's (heads, mode)

    def key(self) -> tuple[str | bool | int | None, ...]:
        return (self.workload, self.heads, self.mode, self.placement, self.mesh, self.recompute_exchange,
                self.stream_steps, self.stream_layers, self.plan_ahead, self.mixed_reset, self.scale)


@dataclass
class Measurement:
    ms: float | None  # None: a stream, timed by step_ms
    peak_gib: float | None = None
    saved_gib: float | None = None
    exposed_comm_ms: float | None = None
    exposed_comm_pct: float | None = None
    first_call_s: float | None = None
    step_ms: list[float] | None = None  # a stream's steps
    prepare_ms: float | None = None
    graphs: int | None = None
    traced: "TracedStep | None" = None  # --trace with --stream


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
    lengths = torch.tensor(lengths)
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device, torch.int32)


# --------------------------------------------------------------------------- measuring


def measure(
    fn: Callable[..., Tensor], inputs: list[Tensor], setup: Setup, *, alone: bool = False,
    first_call: bool = False, profile: str | None = None,
) -> Measurement:
    """fwd+bwd of ``fn(*inputs)``: with ``first_call`` one call (the compile) timed apart,
    which counts as the first warm-up; then the median of ``--iters`` after the (other)
    warm-ups and the peak memory beyond what is allocated before them; then (``profile``, the
    mode's name for its trace; CUDA, unless ``--no-profile``) the exposed communication of one
    more step. ``alone``: only this rank runs it, no barrier."""
    first_call_s = None
    if first_call:
        started = time.perf_counter()
        fn(*inputs).sum().backward()
        _synchronize(setup.device)
        first_call_s = round(time.perf_counter() - started, 1)
    for t in inputs:
        t.grad = None
    cuda = setup.device.type == "cuda"
    warmup = max(0, setup.args.warmup - first_call)
    ms = time_fwd_bwd(fn, inputs, warmup, setup.args.iters, barrier=not alone)
    if cuda:
        with memory_history(setup, profile) if setup.args.memory_peak else contextlib.nullcontext():
            peak = one_call_peak(fn, inputs, barrier=not alone)
    else:
        peak = None
    profiled = profile is not None and cuda and not setup.args.no_profile
    exposed = exposed_communication(fn, inputs, setup, profile, alone) if profiled else (None, None)
    saved = held_after_forward(fn, inputs) if cuda else None
    return Measurement(ms, peak, saved, *exposed, first_call_s)


@contextlib.contextmanager
def memory_history(setup: Setup, name: str | None) -> Iterator[None]:
    """``--memory-peak``: the allocator's history of the block, with Python stacks, and on the
    leading rank where its peak's memory lies (:func:`live_at_peak`)."""
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        yield
        history = torch.cuda.memory._snapshot()["device_traces"][setup.device.index or 0]
    finally:
        torch.cuda.memory._record_memory_history(None)
    if setup.leads:
        setup.say(f"  {name or 'mode'} memory: {live_at_peak(history)}")


def one_call_peak(fn: Callable[..., Tensor], inputs: list[Tensor], *, barrier: bool = True) -> float:
    """GiB that one fwd+bwd of ``fn(*inputs)`` allocates at its peak beyond its inputs (q, k, v
    and the output's gradient, made before the count starts), with nothing of an earlier call
    alive: no gradients, outputs or graphs of the timed steps, so the figure is the same in
    every run (a timed loop's peak also counts the previous step's output and gradients,
    whichever of them the allocator has not yet reused)."""
    for t in inputs:
        t.grad = None
    gc.collect()
    grad = torch.randn_like(inputs[0])  # every mode's output has q's shape (a mismatch fails the backward)
    if barrier:
        dist.barrier()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    fn(*inputs).backward(grad)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - held) / 2**30
    for t in inputs:
        t.grad = None
    return peak


def held_after_forward(fn: Callable[..., Tensor], inputs: list[Tensor]) -> float:
    """GiB allocated by one forward and still held when it returns: the output and what the
    step saved for its backward, which a model holds for every layer until its backward."""
    before = torch.cuda.memory_allocated()
    out = fn(*inputs)
    held = (torch.cuda.memory_allocated() - before) / 2**30
    out.backward(torch.ones_like(out))
    for t in inputs:
        t.grad = None
    return held


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def exposed_communication(
    fn: Callable[..., Tensor], inputs: list[Tensor], setup: Setup, name: str, alone: bool,
) -> tuple[float | None, float | None]:
    """One fwd+bwd traced by the profiler on every rank (``alone``: on this one), after one it
    warms up on; from rank 0's trace, the time some NCCL kernel runs while no other kernel
    does: ms, and % of the traced step (first kernel start to last kernel end). None on the
    other ranks. With ``--trace DIR`` the host is traced too, every rank's trace is kept as
    ``DIR/<name>_rank<r>.json.gz`` and rank 0 prints where its step's time went
    (:func:`kernel_summary`)."""
    from torch.profiler import ProfilerActivity, profile

    folder = setup.args.trace
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if folder else [])
    if not alone:
        dist.barrier()
    rank = setup.rank
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "trace.json"
        if folder:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{name}_rank{rank}.json.gz"
        # a first step as the profiler's warm-up: the first launch it traces waits for its
        # buffers (2.4 ms on an H200), which the trace would show as the host's own time
        with profile(activities=activities, schedule=torch.profiler.schedule(wait=0, warmup=1, active=1),
                     on_trace_ready=lambda done: done.export_chrome_trace(str(path))) as prof:
            for _ in range(2):
                # a gradient tensor as the timed steps pass, not .sum().backward(): the first
                # reduction of a process loads its kernel, which the trace would count (20 ms)
                out = fn(*inputs)
                out.backward(torch.ones_like(out))
                for t in inputs:
                    t.grad = None
                torch.cuda.synchronize()
                prof.step()
        if not setup.leads:
            return None, None
        trace = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
    comm, compute = kernel_intervals(trace)
    kernels = comm + compute
    if not kernels:
        return None, None
    if folder:
        setup.say(f"  {name}: {kernel_summary(trace)}")
    if alone or setup.fake:  # a one-GPU mode, or peers that move no data: no communication
        return None, None
    span_us = max(stop for _, stop in kernels) - min(start for start, _ in kernels)
    exposed_us = exposed_length(comm, compute)
    return round(exposed_us / 1e3, 2), round(100 * exposed_us / span_us, 1)


def trace_name(batch: Batch, setup: Setup, mode: str, placement: str = "-") -> str:
    args = setup.args
    return f"{batch.workload.name}_{batch.heads}_{mode}_{placement}_u{args.ulysses}r{args.ring}"


def one_gpu_trace(batch: Batch, setup: Setup, mode: str) -> str | None:
    """A one-GPU mode is profiled only for ``--trace`` (it has no communication to measure)."""
    return trace_name(batch, setup, mode) if setup.args.trace else None


def record(row: Row, run: Callable[[], Measurement], setup: Setup, *, together: bool) -> Row:
    """``run`` one mode into ``row``. An exception (compile error, OOM, refused input) becomes
    the row's error and the run goes on. ``together``: every rank ran it; the ranks then agree
    on the error and take the largest peak memory."""
    measured, error, out_of_memory = None, None, False
    try:
        measured = run()
    except Exception as exc:  # noqa: BLE001 -- a failing mode is a result, not the end of the run
        # a stream's failing step, first: the error column is cut short
        where = "".join(f" {note}" for note in getattr(exc, "__notes__", ()) if note.startswith(STEP_NOTE))
        error = f"{type(exc).__name__}{where}: {exc}".strip()[:2000]
        out_of_memory = isinstance(exc, torch.cuda.OutOfMemoryError)
    if out_of_memory:  # here, once the exception and the tensors of its frames are gone
        gc.collect()
        torch.cuda.empty_cache()
    if together and setup.world > 1 and not setup.fake:
        report = [None] * setup.world
        dist.all_gather_object(report, (error, measured))
        error = next((e for e, _ in report if e), None)
        if measured is not None and error is None:
            everyone = [m for _, m in report]
            measured.peak_gib, measured.saved_gib = (_largest([getattr(m, name) for m in everyone])
                                                     for name in ("peak_gib", "saved_gib"))
            if measured.step_ms is not None:  # a step ends when its slowest rank is done
                measured.step_ms = [max(times) for times in zip(*(m.step_ms for m in everyone))]
                measured.prepare_ms = max(m.prepare_ms for m in everyone)
    if error is not None:
        row.error = error
    elif measured is not None:
        significant = {name: None if value is None else _significant(value)
                       for name, value in (("ms", measured.ms), ("peak_gib", measured.peak_gib),
                                           ("saved_gib", measured.saved_gib), ("prepare_ms", measured.prepare_ms))}
        row.ms, row.peak_gib, row.saved_gib, row.prepare_ms = significant.values()
        row.exposed_comm_ms, row.exposed_comm_pct = measured.exposed_comm_ms, measured.exposed_comm_pct
        row.first_call_s = measured.first_call_s
        if measured.step_ms is not None:
            row.step_ms = [_significant(t) for t in measured.step_ms]
            row.graphs = measured.graphs
        if measured.traced is not None:
            traced = measured.traced
            row.traced_step_ms, row.traced_busy_ms, row.traced_plan_ms = (
                _significant(v) for v in (traced.step_ms, traced.busy_ms, traced.plan_ms))
            setup.say(f"  traced step: {traced.summary}")
    return row


def _largest(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else max(values)


def _significant(value: float) -> float:
    return float(f"{value:.4g}")  # readable for GPU sizes and tiny CPU smoke tests alike


# --------------------------------------------------------------------------- the modes


def one_gpu_call(mode: str, batch: Batch, setup: Setup) -> tuple[Attend, list[Tensor]]:
    """A one-GPU mode's call on the whole batch and its inputs: q, k and v, new leaves that take
    gradients, in the mode's layout (flex's and SDPA's ``[1, H, T, D]``, made before the timing as
    hcp's ``[T, H, D]`` is). The call holds the batch's ``cu_seqlens``, not the batch."""
    bhtd = mode in ("one-gpu-flex", "one-gpu-sdpa")
    inputs = [(t.transpose(0, 1).unsqueeze(0).contiguous() if bhtd else t.clone()).requires_grad_()
              for t in batch.qkv]
    cu, longest, workload = batch.cu, batch.longest, batch.workload
    if mode == "one-gpu-flex":
        mask = document_block_mask(workload, setup.device)
        attend = torch.compile(flex_attention, dynamic=False) if setup.device.type == "cuda" else flex_attention
        gqa = inputs[0].shape[1] != inputs[1].shape[1]
        return (lambda q, k, v: attend(q, k, v, block_mask=mask, enable_gqa=gqa)), inputs
    if mode == "one-gpu-sdpa":
        return dense_causal, inputs
    if mode == "one-gpu-flash":
        return flash_call(cu, longest, workload.window_left), inputs
    module = PackedAttention(workload.window, setup.args.kernel)
    return (lambda q, k, v: module(q, k, v, cu, longest)), inputs


def one_gpu_flex(batch: Batch, setup: Setup) -> Measurement:
    """torch's flex_attention on the whole batch, compiled, with a document + causal (+ window)
    block mask. On CPU it runs uncompiled and fails: torch's flex has no backward there (the
    smoke test records that error)."""
    cuda = setup.device.type == "cuda"
    return measure(*one_gpu_call("one-gpu-flex", batch, setup), setup, alone=True, first_call=cuda,
                   profile=one_gpu_trace(batch, setup, "one-gpu-flex"))


def document_block_mask(workload: Workload, device: torch.device) -> BlockMask:
    """Queries see earlier keys of their own document (and, with a window, at most
    ``window_left`` positions back)."""
    lengths = torch.tensor(workload.lengths, device=device)
    document = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    left = workload.window_left

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)
        return visible & (q_idx - kv_idx <= left) if left >= 0 else visible

    tokens = int(lengths.sum())
    # _compile: without it the mask is evaluated as a dense [T, T] tensor (16 GiB at 128K)
    return create_block_mask(mask_mod, None, None, tokens, tokens, device=device,
                             _compile=device.type == "cuda")


def one_gpu_sdpa(batch: Batch, setup: Setup) -> Measurement:
    """Dense causal ``F.scaled_dot_product_attention`` on ``[1, H, T, D]`` with the backend torch
    picks (cuDNN on an H200 with torch 2.11): exact only for a one-document batch without a
    window, the only workloads it runs on."""
    return measure(*one_gpu_call("one-gpu-sdpa", batch, setup), setup, alone=True,
                   profile=one_gpu_trace(batch, setup, "one-gpu-sdpa"))


def dense_causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def one_gpu_hcp(batch: Batch, setup: Setup) -> Measurement:
    """hcp's single-device ``varlen_attention`` (no context parallelism) on the whole batch,
    with the kernel ``--kernel`` resolves to."""
    return measure(*one_gpu_call("one-gpu-hcp", batch, setup), setup, alone=True,
                   profile=one_gpu_trace(batch, setup, "one-gpu-hcp"))


def one_gpu_flash(batch: Batch, setup: Setup) -> Measurement:
    """``aten._flash_attention_forward`` (differentiable) on the whole batch, as hcp's flash
    kernel calls it: KV heads as they are, the window as flash's left/right sizes."""
    return measure(*one_gpu_call("one-gpu-flash", batch, setup), setup, alone=True,
                   profile=one_gpu_trace(batch, setup, "one-gpu-flash"))


def flash_call(cu: Tensor, longest: int, window_left: int) -> Attend:
    window = {"window_size_left": window_left, "window_size_right": 0} if window_left >= 0 else {}

    def attend(q, k, v):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, **window
        )[0]

    return attend


class PackedAttention(nn.Module):
    """The single-device call that the hcp modes run on shards (compiled: rewritten). The
    window is an attribute, not an argument: a module's ints stay constants in the graph, while
    an int argument that changes between calls would be traced as a symbol, and the backend
    needs the window at compile time."""

    def __init__(self, window: tuple[int, int], kernel: str = "auto"):
        super().__init__()
        self.window, self.kernel = window, kernel

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        if self.kernel != "auto":  # one device, a named kernel (under CP the context or backend names it)
            return torch.ops.hcp.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True,
                                                  q.shape[-1] ** -0.5, *self.window, self.kernel)[0]
        return hcp_compile.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                            causal=True, window_size=self.window)


def hcp_mode(
    batch: Batch, setup: Setup, placement: str, compiled: Callable[..., Tensor] | None,
    recompute_exchange: bool,
) -> Measurement:
    """hcp on this rank's shard: eagerly in ``context_parallel``, or through ``compiled`` (a
    compiled :class:`PackedAttention` of the batch's window, with the same
    ``recompute_exchange``)."""
    if setup.fake and setup.device.type == "cuda":
        fill_free_memory(setup.device)
    profile = trace_name(batch, setup, "hcp-compiled" if compiled is not None else "hcp-eager", placement)
    if compiled is None:
        with hcp_eager(batch, setup, placement, recompute_exchange) as (attend, local):
            return measure(attend, local, setup, profile=profile)
    local = sharded(batch, setup, placement)
    # the token count, the document count and the longest document vary across workloads:
    # traced as symbols, so that one graph per (placement, window) serves them all (but a
    # one-document batch, whose 2-entry cu_seqlens gets specialized, has a graph of its own)
    for t in (*local, batch.cu):
        torch._dynamo.maybe_mark_dynamic(t, 0)

    def step(q, k, v):
        with torch.compiler.config.patch(dynamic_sources="L['max_seqlen']"):
            return compiled(q, k, v, batch.cu, batch.longest)

    return measure(step, local, setup, first_call=True, profile=profile)


def sharded(batch: Batch, setup: Setup, placement: str) -> list[Tensor]:
    """This rank's shards of q, k and v under ``placement``, leaves that take gradients."""
    plan = hcp_compile.shard_plan(batch.cu, setup.hcp_mesh(), placement=placement)
    return [plan.shard(t).requires_grad_() for t in batch.qkv]


@contextlib.contextmanager
def hcp_eager(batch: Batch, setup: Setup, placement: str,
              recompute_exchange: bool = False) -> Iterator[tuple[Callable[..., Tensor], list[Tensor]]]:
    """``(attend, shards)``: this rank's eager CP call on its shards (``attend(*shards)``),
    valid inside the block (``context_parallel`` of ``--kernel`` is active there)."""
    local = sharded(batch, setup, placement)
    attend = PackedAttention(batch.workload.window)
    with hcp_compile.context_parallel(setup.hcp_mesh(), kernel=setup.args.kernel, placement=placement,
                                      recompute_exchange=recompute_exchange):
        yield (lambda q, k, v: attend(q, k, v, batch.cu, batch.longest)), local


def fill_free_memory(device: torch.device) -> None:
    """Most of the GPU's free memory, written with bf16 normal samples and left in the caching
    allocator, which carves later buffers out of it: what a fake collective "receives"."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    filler = torch.empty(int(0.8 * free) // 2, dtype=torch.bfloat16, device=device)
    filler.normal_()
    del filler


def compile_hcp(
    setup: Setup, placement: str, window: tuple[int, int], recompute_exchange: bool,
) -> Callable[..., Tensor]:
    args = setup.args
    backend = hcp_compile.backend(mesh=setup.hcp_mesh(), placement=placement, kernel=args.kernel,
                                  inner=args.inner, recompute_exchange=recompute_exchange)
    return torch.compile(PackedAttention(window), backend=backend, fullgraph=True)


def hcp_kernel(workload: Workload, heads: str, setup: Setup, cp: bool = True) -> str:
    """The kernel hcp runs this workload with (the choice context_parallel and the backend
    make, or the single-device op's with ``cp=False``) for ``--kernel``; the option itself when
    none can (the mode then fails and its row says why)."""
    kernel = setup.args.kernel
    q, k = (torch.empty(0, h, setup.args.head_dim, device=setup.device, dtype=setup.dtype) for h in HEADS[heads])
    # one device judges each call by its batch's composition (the op passes it); CP by the mean
    composition = {} if cp else {"segments": len(workload.lengths), "longest": max(workload.lengths)}
    by_position = cp and window_by_position(workload.window, setup.args.ring)
    request = BlockRequest.of(q, k, workload.window, window_by_position=by_position, **composition)
    try:
        return resolve_kernel(kernel, request)
    except hcp_compile.InputError:
        return kernel


def torch_native_cp(batch: Batch, setup: Setup) -> Measurement:
    """torch's ring CP: SDPA inside ``context_parallel``, which shards the [1, H, T, D] buffers
    in place (head-tail load balancing) and patches ``F.scaled_dot_product_attention``."""
    from torch.distributed.tensor.experimental import context_parallel

    q, k, v = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in batch.qkv)
    with context_parallel(setup.sequence_mesh(), buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                          no_restore_buffers={q, k, v}):
        local = [t.requires_grad_() for t in (q, k, v)]
        # F's attribute is looked up per call: the patched function
        return measure(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), local,
                       setup, profile=trace_name(batch, setup, "torch-native-cp", "head-tail"))


# --------------------------------------------------------------------------- streams


@dataclass
class Step:
    """One step's batch of a stream, as a trainer has it before its layers run."""

    workload: Workload  # the step's lengths
    cu: Tensor
    longest: int
    prepared: PreparedBatch | None = None  # --plan-ahead: this rank's plan, built by a DataLoader worker

    @property
    def tokens(self) -> int:
        return sum(self.workload.lengths)


# a step's batch -> the tokens of every layer's q, k and v on this rank, and the attention call
Prepare = Callable[[Step], tuple[int, Attend]]


class LayerInputs:
    """Every layer's q, k and v and one output gradient, random, made once per stream with
    room for ``rows`` tokens (made again, larger, should a step need more): each step takes
    the first rows of each as new leaves, so that it starts without gradients and draws no
    random numbers. ``bhtd``: flex's and SDPA's layout ``[1, H, T, D]``, else ``[T, H, D]``."""

    def __init__(self, setup: Setup, heads: str, rows: int, *, bhtd: bool):
        self.setup, self.heads, self.bhtd = setup, heads, bhtd
        self.rows, self.layers, self.dout = 0, [], None
        self._make(rows)

    def _make(self, rows: int) -> None:
        setup, head_dim = self.setup, self.setup.args.head_dim
        self.layers, self.dout = [], None  # the old ones go first
        gen = torch.Generator(setup.device).manual_seed(0)

        def random(heads: int) -> Tensor:
            shape = (1, heads, rows, head_dim) if self.bhtd else (rows, heads, head_dim)
            return torch.randn(shape, generator=gen, device=setup.device, dtype=setup.dtype)

        q_heads, kv_heads = HEADS[self.heads]
        self.layers = [[random(h) for h in (q_heads, kv_heads, kv_heads)] for _ in range(setup.args.layers)]
        self.dout, self.rows = random(q_heads), rows

    def take(self, rows: int) -> tuple[list[list[Tensor]], Tensor]:
        """Every layer's ``[q, k, v]`` of ``rows`` tokens, and the output gradient."""
        if rows > self.rows:
            self._make(rows + rows // 4)
        dim = 2 if self.bhtd else 0
        return ([[t.narrow(dim, 0, rows).requires_grad_() for t in layer] for layer in self.layers],
                self.dout.narrow(dim, 0, rows))


def stream(
    setup: Setup, steps: list[Workload], heads: str, prepare: Prepare, *, together: bool, bhtd: bool = False,
    context: contextlib.AbstractContextManager | None = None, ahead: Iterator[PreparedBatch] | None = None,
    traced: tuple[list[Workload], Path] | None = None, resets: Collection[int] = (),
) -> Measurement:
    """A stream: every step's batch through ``--layers`` attention calls (one per layer, each
    on its own q, k and v, all on the step's ``cu_seqlens``), forward, then backward. A step is
    timed on the host clock from its lengths on the host to the end of its backward on the
    device (synchronized), ``cu_seqlens`` to the device and ``prepare`` (the plan or the mask;
    its time is kept apart too) included. ``together``: every rank runs it, each step starting
    together. Peak memory: the largest allocated beyond the layers' inputs. ``ahead``: each
    step's prepared batch (``--plan-ahead``), taken inside the step: a step waits for a worker
    that has not finished. ``traced``: two more steps of these batches, after the stream, the
    second traced into this file (:func:`traced_step`). ``resets``: the steps before which
    ``torch._dynamo.reset()`` runs, outside their time (``--mixed``). A failing step's exception
    says which step and workload it was (:data:`STEP_NOTE`)."""
    device, cuda = setup.device, setup.device.type == "cuda"
    # the inputs are sized once for the largest step: making them again would be a step's time
    tokens = max(sum(w.lengths) for w in steps + (traced[0] if traced is not None else []))
    rows = -(-tokens * 5 // (4 * setup.world)) if together else tokens  # a rank's share, room for pads
    inputs = LayerInputs(setup, heads, rows, bhtd=bhtd)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    graphs = counters["stats"]["unique_graphs"]

    def run_step(workload: Workload) -> tuple[float, float]:
        """One step: its ms and its plan's."""
        if together:
            dist.barrier()
        _synchronize(device)
        started = time.perf_counter()
        with torch.profiler.record_function("plan"):
            step = Step(workload, cu_seqlens(workload.lengths, device), max(workload.lengths),
                        next(ahead) if ahead is not None else None)
            rows, attend = prepare(step)
            _synchronize(device)
        prepared = time.perf_counter()
        layers, dout = inputs.take(rows)
        outs = [attend(*qkv) for qkv in layers]
        torch.autograd.backward(outs, [dout] * len(outs))
        _synchronize(device)
        stopped = time.perf_counter()
        return (stopped - started) * 1e3, (prepared - started) * 1e3

    def run_steps() -> Iterator[tuple[float, float]]:
        for index, workload in enumerate(steps):
            if index in resets:  # as a notebook, an evaluation loop or another compiled model would
                torch._dynamo.reset()
            try:
                yield run_step(workload)
            except Exception as error:
                error.add_note(f"{STEP_NOTE} {index} ({workload.name})")
                raise

    with context if context is not None else contextlib.nullcontext():
        step_ms, prepare_ms = zip(*run_steps())
        peak = (torch.cuda.max_memory_allocated() - held) / 2**30 if cuda else None
        found = traced_step(run_step, *traced) if traced is not None else None
    return Measurement(None, peak, step_ms=list(step_ms), prepare_ms=statistics.median(prepare_ms),
                       graphs=counters["stats"]["unique_graphs"] - graphs, traced=found)


@dataclass
class TracedStep:
    """One step of a stream under the profiler (``--trace``): its host-clock time, the time some
    kernel ran, and the plan's (host) part; the rest of the step the GPU waited for the host
    (in a fake-rank or one-GPU stream there is no communication to wait for)."""

    step_ms: float
    busy_ms: float
    plan_ms: float
    summary: str


def traced_step(run_step: Callable[[Workload], tuple[float, float]], batches: list[Workload],
                path: Path) -> TracedStep:
    """``run_step`` on the two new ``batches``, the second traced (CPU and CUDA) into ``path``
    (the first warms the profiler up: its first traced launch waits for its buffers)."""
    from torch.profiler import ProfilerActivity, profile

    path.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, schedule=torch.profiler.schedule(wait=0, warmup=1, active=1),
                 on_trace_ready=lambda done: done.export_chrome_trace(str(path))) as prof:
        for workload in batches:
            step_ms, plan_ms = run_step(workload)
            prof.step()
    trace = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
    comm, compute = kernel_intervals(trace)
    busy = sum(stop - start for start, stop in union_intervals(comm + compute)) / 1e3
    summary = kernel_summary(trace) if comm or compute else "no kernels"
    return TracedStep(step_ms, busy, plan_ms, summary)


def flex_stream(setup: Setup) -> Prepare:
    """torch's flex: every step the batch's block mask, as a trainer must build it (compiled
    on CUDA, as :func:`one_gpu_flex`), then the layers' calls through one compiled flex."""
    attend = torch.compile(flex_attention, dynamic=False) if setup.device.type == "cuda" else flex_attention

    def prepare(step: Step) -> tuple[int, Attend]:
        mask = document_block_mask(step.workload, setup.device)
        return step.tokens, lambda q, k, v: attend(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return prepare


def flash_stream() -> Prepare:
    """``aten._flash_attention_forward`` on each step's batch, as :func:`one_gpu_flash`."""
    return lambda step: (step.tokens, flash_call(step.cu, step.longest, step.workload.window_left))


def sdpa_stream() -> Prepare:
    """Dense causal SDPA, as :func:`one_gpu_sdpa` (one document: the same batch every step)."""
    return lambda step: (step.tokens, dense_causal)


def hcp_stream(kernel: str) -> Prepare:
    """hcp's single-device ``varlen_attention`` with ``kernel``, one module per window for the
    stream (the window is a module's constant)."""
    module = functools.cache(lambda window: PackedAttention(window, kernel))

    def prepare(step: Step) -> tuple[int, Attend]:
        attend = module(step.workload.window)
        return step.tokens, lambda q, k, v: attend(q, k, v, step.cu, step.longest)

    return prepare


def hcp_cp_stream(setup: Setup, placement: str,
                  compile_window: Callable[[tuple[int, int]], Callable[..., Tensor]] | None) -> Prepare:
    """hcp on this rank's shards: every step the batch's ``shard_plan`` (host work a trainer
    pays: it shards its tokens by it; the layers' q, k and v are born sharded), then the
    layers' calls, eagerly (inside the ``context_parallel`` the caller enters) or through
    ``compile_window(window)``, a compiled module per window for the stream (made at its
    first step), with dynamic shapes as in :func:`hcp_mode`."""
    mesh, eager = setup.hcp_mesh(), functools.cache(PackedAttention)
    compiled_by_window = functools.cache(compile_window) if compile_window is not None else None

    def prepare(step: Step) -> tuple[int, Attend]:
        plan = hcp_compile.shard_plan(step.prepared if step.prepared is not None else step.cu, mesh,
                                      placement=placement)
        window = step.workload.window
        if compiled_by_window is None:
            module = eager(window)
            return plan.local_tokens, lambda q, k, v: module(q, k, v, step.cu, step.longest)
        compiled = compiled_by_window(window)
        torch._dynamo.maybe_mark_dynamic(step.cu, 0)

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            for t in (q, k, v):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            with torch.compiler.config.patch(dynamic_sources="L['max_seqlen']"):
                return compiled(q, k, v, step.cu, step.longest)

        return plan.local_tokens, attend

    return prepare


def forget_batches() -> None:
    """Empty what hcp keeps of the batches it has seen by their values (the cache keys that
    its :class:`KeysByValue` hand out, and its bounded lru caches of layouts and schedules):
    every mode's stream draws the same batches, which must be new to each mode as a
    trainer's are. Its unbounded caches, of configurations (compiled kernels), stay."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "hcp_compile" or name.startswith("hcp_compile.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, KeysByValue):
                value._keys.clear()
            elif isinstance(value, BoundedCache):
                value.clear()
            elif callable(getattr(value, "cache_parameters", None)) and value.cache_parameters()["maxsize"] is not None:
                value.cache_clear()


class PlannedSteps(torch.utils.data.Dataset):
    """Each step's batch prepared on the host for one rank (``hcp_compile.prepare_batch``), as a
    trainer's DataLoader worker builds it while the previous steps run (``--plan-ahead``)."""

    def __init__(self, steps: list[Workload], ulysses: int, ring: int, placement: str, rank: int):
        self.steps, self.ulysses, self.ring, self.placement, self.rank = steps, ulysses, ring, placement, rank

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> PreparedBatch:
        workload = self.steps[index]
        return hcp_compile.prepare_batch(
            cu_seqlens(workload.lengths, torch.device("cpu")), ulysses=self.ulysses, ring=self.ring,
            placement=self.placement, rank=self.rank, window=workload.window)


def plans_ahead(setup: Setup, steps: list[Workload], placement: str) -> Iterator[PreparedBatch]:
    """The steps' prepared batches from one DataLoader worker process, two steps ahead (the
    worker stops when the iterator is dropped)."""
    loader = torch.utils.data.DataLoader(
        PlannedSteps(steps, setup.args.ulysses, setup.args.ring, placement, setup.rank),
        batch_size=None, num_workers=1, prefetch_factor=2)
    return iter(loader)


def summarize_stream(row: Row, flops: list[float]) -> None:
    """A stream row's figures from its step times and the steps' FLOPs (visible pairs, all
    layers): overall TF/s per GPU (all FLOPs over all the time), steady TF/s per GPU (over the
    last half of the steps, ``steps // 2`` on), the one-time share (the % of the time beyond
    what every step would take at the steady rate: 1 - overall / steady), the first step's
    seconds and the cumulative seconds at the end of each tenth of the steps."""
    if row.step_ms is None:
        return
    seconds = [ms / 1e3 for ms in row.step_ms]
    total, half = sum(seconds), len(seconds) // 2
    overall = sum(flops) / row.gpus / total / 1e12
    steady = sum(flops[half:]) / row.gpus / sum(seconds[half:]) / 1e12
    cumulative = list(itertools.accumulate(seconds))
    n = len(seconds)
    row.stream_s = _significant(total)
    row.tflops_per_gpu, row.steady_tflops_per_gpu = _significant(overall), _significant(steady)
    row.one_time_pct = round(100 * (1 - overall / steady), 1)
    row.first_step_s = _significant(seconds[0])
    row.cumulative_s = [_significant(cumulative[-(-n * tenth // 10) - 1]) for tenth in range(1, 11)]


def summarize_compositions(row: Row) -> None:
    """A mixed stream's figure per workload (``first_extra_s``, :func:`first_extra_s`)."""
    if row.step_ms is not None and row.step_workloads is not None:
        row.first_extra_s = first_extra_s(row.step_workloads, row.step_ms)


def first_extra_s(names: Sequence[str], step_ms: Sequence[float]) -> dict[str, float | None]:
    """Per workload of ``names`` (each step's), in order of first appearance: the seconds its
    first step after the stream's first takes beyond its median step after the stream's first
    (the stream's first step pays the process's one-time work, which is no workload's); None
    for a workload met only at the stream's first step."""
    extra: dict[str, float | None] = {}
    for name in dict.fromkeys(names):
        later = [ms for index, (step, ms) in enumerate(zip(names, step_ms)) if step == name and index > 0]
        extra[name] = _significant((later[0] - statistics.median(later)) / 1e3) if later else None
    return extra


# --------------------------------------------------------------------------- the scale table


def run_scale(setup: Setup, heads: str, on_row: Callable[[Row], None]) -> None:
    """``--scale``: one call of each selected one-GPU mode on W2 lengths (:func:`log_uniform`) at
    each size. An out-of-memory error is that row's (:func:`record` empties the cache after it)."""
    args = setup.args
    for k in args.scale:
        workload = log_uniform(k, args.shrink)
        tokens = sum(workload.lengths)
        setup.say(f"{workload.name} {heads}: one call on {tokens} tokens, {len(workload.lengths)} documents, "
                  f"longest {max(workload.lengths)}")
        flops = causal_flops(list(workload.lengths), HEADS[heads][0], args.head_dim)
        for mode in args.modes:
            if skipped(mode, [workload], setup):
                continue
            kernel = {"one-gpu-flex": "flex", "one-gpu-flash": "flash"}.get(mode) or hcp_kernel(
                workload, heads, setup, cp=False)
            row = Row(workload.name, heads, mode, "-", kernel, "1", 1, scale=True,
                      outputs_gib=_significant(outputs_gib(tokens, heads, setup)))
            row = record(row, lambda mode=mode: scale_call(mode, workload, heads, setup), setup, together=False)
            scale_figures(row, flops)
            on_row(row)
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()  # the next size's buffers are larger


def scale_call(mode: str, workload: Workload, heads: str, setup: Setup) -> Measurement:
    """One fwd+bwd call of a one-GPU ``mode`` on ``workload``: ``--warmup`` calls (at least one:
    flex compiles, kernels build their graphs), one call whose peak memory beyond what is
    allocated before it (q, k, v, dout, and what the kernel keeps from earlier calls) is the peak
    (CUDA only), then the median ms of ``--iters``."""
    batch = Batch.make(workload, heads, setup)
    attend, inputs = one_gpu_call(mode, batch, setup)
    del batch  # q, k and v held once, as a caller holds them: the mode's copies
    dout = torch.randn_like(inputs[0])  # every mode's output has q's shape and layout

    def call(grad: Tensor) -> None:
        attend(*inputs).backward(grad)
        for t in inputs:
            t.grad = None  # the next call starts without gradients

    for _ in range(max(1, setup.args.warmup)):
        call(dout)
    peak = None
    if setup.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        call(dout)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - held) / 2**30
    del dout  # the timing makes its own
    return Measurement(time_fwd_bwd(attend, inputs, 0, setup.args.iters, barrier=False), peak)


def outputs_gib(tokens: int, heads: str, setup: Setup) -> float:
    """GiB of a call's out, dq, dk and dv: two tensors of the query heads, two of the KV heads,
    as many bytes as its inputs q, k, v and dout."""
    q_heads, kv_heads = HEADS[heads]
    return 2 * (q_heads + kv_heads) * tokens * setup.args.head_dim * setup.dtype.itemsize / 2**30


def scale_figures(row: Row, flops: float) -> None:
    """A scale row's TF/s from its ms and the call's causal FLOPs, and its peak split into the
    outputs and gradients (``outputs_gib``, set) and the rest, alone and over the inputs."""
    if row.ms is not None:
        row.tflops_per_gpu = _significant(flops / row.ms / 1e9)
    if row.peak_gib is not None:
        row.extra_gib = _significant(row.peak_gib - row.outputs_gib)
        row.extra_vs_inputs = round(row.extra_gib / row.outputs_gib, 3)  # the inputs' bytes are the outputs'


def relate_scale(rows: list[Row]) -> None:
    """Each scale row's ms per causal FLOP and peak per token over those of the smallest size
    measured with its heads and mode: 1 where time grows as the causal FLOPs and memory as the
    tokens (a mode's kernel may change with the size; the ratios follow the mode)."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if row.scale and row.tflops_per_gpu:
            groups.setdefault((row.heads, row.mode), []).append(row)
    for group in groups.values():
        smallest = min(group, key=lambda r: r.outputs_gib)  # of one heads, outputs grow as the tokens
        for row in group:
            row.flop_time_vs_smallest = round(smallest.tflops_per_gpu / row.tflops_per_gpu, 3)
            if row.peak_gib is not None and smallest.peak_gib:
                per_token, smallest_per_token = (r.peak_gib / r.outputs_gib for r in (row, smallest))
                row.token_peak_vs_smallest = round(per_token / smallest_per_token, 3)


# --------------------------------------------------------------------------- the run


def run_benchmark(setup: Setup, selected: list[Workload], on_row: Callable[[Row], None]) -> None:
    """Every selected (heads, workload, mode, placement), heads outermost: the compiled hcp
    modules of one head configuration serve all its workloads (a stream compiles its own);
    with ``--mixed`` one stream through the selected workloads per heads, with ``--scale`` the
    scale table's sizes instead. ``on_row`` gets each row as it is measured (on every rank)."""
    for heads in setup.args.heads:
        torch._dynamo.reset()  # drop the previous head configuration's graphs
        if setup.args.scale:
            run_scale(setup, heads, on_row)
            continue
        if setup.args.mixed:
            run_mixed(setup, selected, heads, on_row)
            continue
        compiled: dict[tuple, Callable[..., Tensor]] = {}  # by (placement, window, recompute_exchange)
        for workload in selected:
            if setup.args.stream:
                run_stream(setup, workload, heads, on_row)
            else:
                run_workload(setup, Batch.make(workload, heads, setup), compiled, on_row)
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()  # the next workload's sizes differ


def run_workload(
    setup: Setup, batch: Batch, compiled: dict[tuple, Callable[..., Tensor]],
    on_row: Callable[[Row], None],
) -> None:
    """The selected modes on one batch: the one-GPU modes on rank 0 alone, then the CP modes."""
    args, workload, heads = setup.args, batch.workload, batch.heads
    setup.say(f"{workload.name} {heads}: {len(workload.lengths)} documents, longest "
              f"{batch.longest}, {batch.q.shape[0]} tokens, window {workload.window}")
    flops = batch.flops()

    def measured(mode: str, placement: str, kernel: str, mesh: str, gpus: int,
                 run: Callable[[], Measurement], *, together: bool, recompute: bool = False) -> None:
        row = Row(workload.name, heads, mode, placement, kernel, mesh_label(setup, mesh, gpus), gpus,
                  recompute_exchange=recompute)
        row = record(row, run, setup, together=together)
        if gpus > 1 and args.share_gpu:  # the ranks took turns on one GPU: the time is no speed
            row.ms = row.first_call_s = None
        if row.ms is not None:
            row.tflops_per_gpu = _significant(flops / gpus / row.ms / 1e9)
        on_row(row)

    if any(m in args.modes for m in ONE_GPU_MODES):
        if setup.leads:
            for mode, run, kernel in (("one-gpu-flex", one_gpu_flex, "flex"),
                                      ("one-gpu-flash", one_gpu_flash, "flash"),
                                      ("one-gpu-sdpa", one_gpu_sdpa, "sdpa"),
                                      ("one-gpu-hcp", one_gpu_hcp, hcp_kernel(workload, heads, setup, cp=False))):
                if mode in args.modes and not skipped(mode, [workload], setup):
                    measured(mode, "-", kernel, "1", 1, lambda run=run: run(batch, setup), together=False)
        dist.barrier()  # the other ranks wait here while rank 0 runs alone
    kernel = hcp_kernel(workload, heads, setup)
    for placement, recompute in itertools.product(args.placements, args.recompute_exchange):
        for mode in ("hcp-eager", "hcp-compiled"):
            if mode not in args.modes:
                continue
            function = None
            if mode == "hcp-compiled":
                key = (placement, workload.window, recompute)
                if key not in compiled:
                    compiled[key] = compile_hcp(setup, *key)
                function = compiled[key]
            measured(mode, placement, kernel, f"{args.ulysses}x{args.ring}", setup.world,
                     lambda: hcp_mode(batch, setup, placement, function, recompute), together=True,
                     recompute=recompute)
    if "torch-native-cp" in args.modes and len(workload.lengths) == 1 and heads == "mha":
        measured("torch-native-cp", "head-tail", "sdpa", str(setup.world), setup.world,
                 lambda: torch_native_cp(batch, setup), together=True)


def mesh_label(setup: Setup, mesh: str, gpus: int) -> str:
    if gpus > 1 and setup.args.share_gpu:
        mesh += " shared"
    if gpus > 1 and setup.fake:
        mesh += f" rank {setup.rank} alone"
    return mesh


def skipped(mode: str, batches: Sequence[Workload], setup: Setup) -> bool:
    """Whether a one-GPU mode cannot run some of ``batches`` here (it says why)."""
    reason = None
    if mode == "one-gpu-sdpa" and any(len(w.lengths) > 1 or w.window_left >= 0 for w in batches):
        reason = "a dense call is exact only for one document without a window"
    if mode == "one-gpu-flash" and setup.device.type != "cuda":
        reason = "flash needs CUDA"
    if reason is not None:
        setup.say(f"  {mode}: skipped, {reason}")
    return reason is not None


def run_stream(setup: Setup, workload: Workload, heads: str, on_row: Callable[[Row], None]) -> None:
    """A stream of ``--stream`` steps of ``workload`` through each selected mode
    (:func:`stream_modes`)."""
    args = setup.args
    steps = [workload.step(s) for s in range(args.stream)]  # the data loader's work, untimed
    traced = [workload.step(s) for s in range(args.stream, args.stream + 2)]  # --trace: new batches
    documents = [len(w.lengths) for w in steps]
    setup.say(f"{workload.name} {heads}: a stream of {args.stream} batches of {sum(workload.lengths)} tokens "
              f"({min(documents)}..{max(documents)} documents, longest {max(max(w.lengths) for w in steps)}), "
              f"{args.layers} attention calls each, window {workload.window}")
    stream_modes(setup, workload.name, [workload], steps, traced, heads, on_row)


def run_mixed(setup: Setup, compositions: list[Workload], heads: str, on_row: Callable[[Row], None]) -> None:
    """A stream of ``--stream`` steps that meets ``compositions`` in a random order
    (:func:`mixed_steps`), ``torch._dynamo.reset()`` before every ``--mixed-reset``-th step,
    through each selected mode (:func:`stream_modes`): the row "mixed"."""
    args = setup.args
    batches = mixed_steps(compositions, args.stream + 2)  # --trace: two more new batches
    resets = reset_steps(args.stream, args.mixed_reset)
    setup.say(f"{MIXED} {heads}: a stream of {args.stream} batches of {', '.join(w.name for w in compositions)} "
              f"in a random order, {args.layers} attention calls each, torch._dynamo.reset() before steps "
              f"{', '.join(map(str, resets)) or '(none)'}")
    stream_modes(setup, MIXED, compositions, batches[:args.stream], batches[args.stream:], heads, on_row,
                 resets=resets)


def mixed_steps(compositions: Sequence[Workload], count: int, seed: int = 0) -> list[Workload]:
    """``count`` steps' batches: rounds in which every composition comes once, each round in a
    random order (``random.Random(seed)``), so that two rounds meet each at least twice; step s
    draws a new batch of its composition (:meth:`Workload.step` s: a step index no other
    composition's batch uses, so no batch repeats another's lengths, W1's one document aside).
    The first steps of a longer count are these."""
    rng, order = random.Random(seed), []
    while len(order) < count:
        round_ = list(compositions)
        rng.shuffle(round_)
        order += round_
    return [workload.step(s) for s, workload in enumerate(order[:count])]


def reset_steps(steps: int, every: int) -> list[int]:
    """The steps before which a mixed stream resets Dynamo: every ``every``-th after the
    first (each mode's stream starts reset); none for 0."""
    return list(range(every, steps, every)) if every else []


def stream_modes(
    setup: Setup, name: str, compositions: list[Workload], steps: list[Workload], traced: list[Workload],
    heads: str, on_row: Callable[[Row], None], *, resets: Sequence[int] = (),
) -> None:
    """``steps`` (batches of ``compositions``) through each selected mode as a stream, a row
    named ``name`` each (the one-GPU modes on rank 0 alone, then the CP modes), each from a
    clean slate: Dynamo's graphs and hcp's batch caches are dropped before it, so that its
    compiles, graph builds and masks are its own (Inductor's and Triton's caches on disk stay: a
    second run compiles faster). ``traced``: the two batches of ``--trace``; ``resets``: as
    :func:`stream`. A row named :data:`MIXED` keeps its steps' workloads and its figures per
    workload (:func:`summarize_compositions`)."""
    args = setup.args
    q_heads = HEADS[heads][0]
    flops = [args.layers * causal_flops(list(w.lengths), q_heads, args.head_dim, w.window_left) for w in steps]
    mixed = name == MIXED

    def measured(mode: str, placement: str, kernel: str, mesh: str, gpus: int, make: Callable[[], Prepare], *,
                 together: bool, bhtd: bool = False, recompute: bool = False,
                 context: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        plan_ahead = args.plan_ahead and mode in ("hcp-eager", "hcp-compiled")
        row = Row(name, heads, mode, placement, kernel, mesh_label(setup, mesh, gpus), gpus,
                  recompute_exchange=recompute, stream_steps=args.stream, stream_layers=args.layers,
                  plan_ahead=plan_ahead, step_workloads=[w.name for w in steps] if mixed else None,
                  mixed_reset=args.mixed_reset if mixed else None)

        def run() -> Measurement:
            torch._dynamo.reset()
            forget_batches()
            if together and setup.fake and setup.device.type == "cuda":
                fill_free_memory(setup.device)
            label = f"{name}_{heads}_{mode}_{placement}_u{args.ulysses}r{args.ring}_stream"
            trace = (traced, args.trace / f"{label}_rank{setup.rank}.json.gz") if args.trace else None
            ahead = plans_ahead(setup, steps + traced if trace else steps, placement) if plan_ahead else None
            return stream(setup, steps, heads, make(), together=together, bhtd=bhtd,
                          context=context() if context is not None else None, ahead=ahead, traced=trace,
                          resets=resets)

        row = record(row, run, setup, together=together)
        if gpus > 1 and args.share_gpu:  # the ranks took turns on one GPU: the times are no speed
            row.step_ms = row.prepare_ms = None
        summarize_stream(row, flops)
        summarize_compositions(row)
        on_row(row)

    def kernels(cp: bool) -> str:
        """hcp's kernel for the compositions, each that some takes (a/b)."""
        return "/".join(dict.fromkeys(hcp_kernel(w, heads, setup, cp=cp) for w in compositions))

    if any(m in args.modes for m in ONE_GPU_MODES):
        if setup.leads:
            one_gpu = (("one-gpu-flex", "flex", lambda: flex_stream(setup), True),
                       ("one-gpu-flash", "flash", flash_stream, False),
                       ("one-gpu-sdpa", "sdpa", sdpa_stream, True),
                       ("one-gpu-hcp", kernels(cp=False), lambda: hcp_stream(args.kernel), False))
            for mode, kernel, make, bhtd in one_gpu:
                if mode in args.modes and not skipped(mode, compositions, setup):
                    measured(mode, "-", kernel, "1", 1, make, together=False, bhtd=bhtd)
        dist.barrier()  # the other ranks wait here while rank 0 runs alone
    kernel, mesh = kernels(cp=True), f"{args.ulysses}x{args.ring}"
    for placement, recompute in itertools.product(args.placements, args.recompute_exchange):
        if "hcp-eager" in args.modes:
            measured("hcp-eager", placement, kernel, mesh, setup.world,
                     lambda: hcp_cp_stream(setup, placement, None), together=True, recompute=recompute,
                     context=lambda: hcp_compile.context_parallel(setup.hcp_mesh(), kernel=args.kernel,
                                                                  placement=placement, recompute_exchange=recompute))
        if "hcp-compiled" in args.modes:
            measured("hcp-compiled", placement, kernel, mesh, setup.world,
                     lambda: hcp_cp_stream(setup, placement,
                                           lambda window: compile_hcp(setup, placement, window, recompute)),
                     together=True, recompute=recompute)


def relate(rows: list[Row]) -> None:
    """Fill each row's efficiency (best one-GPU ms / (GPUs x ms); of a stream, its time
    instead of ms) and memory ratios against the fastest one-GPU row of its workload and heads
    (and stream), where the rows hold one; a stream's steady efficiency is its steady TF/s per
    GPU over the best one-GPU steady TF/s; and the scale rows' ratios to their smallest size
    (:func:`relate_scale`)."""
    best: dict[tuple, Row] = {}
    steadiest: dict[tuple, Row] = {}
    for row in rows:
        if row.mode not in ONE_GPU_MODES:
            continue
        key, time = _group(row), _time(row)
        if time is not None and (key not in best or time < _time(best[key])):
            best[key] = row
        if row.steady_tflops_per_gpu is not None and (
                key not in steadiest or row.steady_tflops_per_gpu > steadiest[key].steady_tflops_per_gpu):
            steadiest[key] = row
    for row in rows:
        base, fastest, time = best.get(_group(row)), steadiest.get(_group(row)), _time(row)
        row.efficiency = round(_time(base) / (row.gpus * time), 3) if base and time is not None else None
        row.steady_efficiency = (round(row.steady_tflops_per_gpu / fastest.steady_tflops_per_gpu, 3)
                                 if fastest and row.steady_tflops_per_gpu is not None else None)
        row.peak_vs_one_gpu = (round(row.peak_gib / base.peak_gib, 2)
                               if base and row.peak_gib is not None and base.peak_gib else None)
        row.saved_vs_one_gpu = (round(row.saved_gib / base.saved_gib, 2)
                                if base and row.saved_gib is not None and base.saved_gib else None)
    relate_scale(rows)


def _group(row: Row) -> tuple:
    """The rows measured on the same work, which efficiencies relate."""
    return row.workload, row.heads, row.stream_steps, row.stream_layers, row.mixed_reset, row.scale


def _time(row: Row) -> float | None:
    return row.stream_s if row.stream_steps else row.ms


def ordered(rows: list[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: (r.workload, list(HEADS).index(r.heads), r.stream_steps or 0,
                                       r.stream_layers or 0, MODES.index(r.mode), r.placement, r.mesh,
                                       r.recompute_exchange))


def table(rows: list[Row]) -> str:
    """The rows of one batch repeated, then the streams' rows, the mixed streams' figures per
    workload and the scale rows (a table each, where there are)."""
    rows = ordered(rows)
    repeated = [r for r in rows if not r.stream_steps and not r.scale]
    streams, scaled = [r for r in rows if r.stream_steps], [r for r in rows if r.scale]
    tables = []
    if repeated or not (streams or scaled):
        headers = ["workload", "heads", "mode", "placement", "recompute", "kernel", "mesh", "ms", "TF/s/GPU",
                   "eff", "peak GiB", "peak/1GPU", "saved GiB", "saved/1GPU", "exposed ms", "exposed %", "error"]
        body = [[r.workload, r.heads, r.mode, r.placement, "yes" if r.recompute_exchange else "",
                 r.kernel, r.mesh, r.ms, r.tflops_per_gpu,
                 r.efficiency, r.peak_gib, r.peak_vs_one_gpu, r.saved_gib, r.saved_vs_one_gpu,
                 r.exposed_comm_ms, r.exposed_comm_pct,
                 (r.error or "")[:60]] for r in repeated]
        tables.append(tabulate(body, headers=headers, missingval="-"))
    if streams:
        headers = ["workload", "heads", "steps x layers", "mode", "placement", "recompute", "kernel", "mesh",
                   "total s", "TF/s/GPU", "steady TF/s/GPU", "eff", "steady eff", "one-time %", "first step s",
                   "prepare ms", "plan ahead", "traced step / busy / plan ms", "graphs", "peak GiB", "peak/1GPU",
                   "cumulative s by tenth of the steps", "error"]
        body = [[r.workload, r.heads, _steps_label(r), r.mode, r.placement,
                 "yes" if r.recompute_exchange else "", r.kernel, r.mesh, r.stream_s, r.tflops_per_gpu,
                 r.steady_tflops_per_gpu, r.efficiency, r.steady_efficiency, r.one_time_pct, r.first_step_s,
                 r.prepare_ms, "yes" if r.plan_ahead else "",
                 f"{r.traced_step_ms} / {r.traced_busy_ms} / {r.traced_plan_ms}" if r.traced_step_ms else None,
                 r.graphs, r.peak_gib, r.peak_vs_one_gpu,
                 " ".join(f"{c:.3g}" for c in r.cumulative_s) if r.cumulative_s else None,
                 (r.error or "")[:60]] for r in streams]
        tables.append(tabulate(body, headers=headers, missingval="-"))
    mixed = [r for r in streams if r.first_extra_s]
    if mixed:
        tables.append(mixed_table(mixed, streams))
    if scaled:
        tables.append(scale_table(scaled))
    return "\n\n".join(tables)


def _steps_label(row: Row) -> str:
    reset = f", reset every {row.mixed_reset}" if row.mixed_reset else ""
    return f"{row.stream_steps}x{row.stream_layers}{reset}"


def mixed_table(mixed: list[Row], streams: list[Row]) -> str:
    """The mixed streams' targets: overall over steady TF/s, the first step against flash's
    first in the same stream (of ``streams``), and per workload its first step after the
    stream's first beyond its median."""
    flash_first = {_group(r): r.first_step_s for r in streams if r.mode == "one-gpu-flash" and r.first_step_s}
    names = list(dict.fromkeys(name for r in mixed for name in r.first_extra_s))
    headers = ["heads", "steps x layers", "mode", "kernel", "overall/steady", "first step s",
               "first - flash's first s", *names]
    body = [[r.heads, _steps_label(r), r.mode, r.kernel, round(r.tflops_per_gpu / r.steady_tflops_per_gpu, 3),
             r.first_step_s,
             _significant(r.first_step_s - flash_first[_group(r)]) if _group(r) in flash_first else None,
             *(r.first_extra_s.get(name) for name in names)] for r in mixed]
    caption = "mixed streams; per workload: its first step after the stream's first minus its median step, s"
    return f"{caption}\n{tabulate(body, headers=headers, missingval='-')}"


def scale_table(scaled: list[Row]) -> str:
    """The scale rows by heads, mode and size: time, TF/s, the peak beyond q, k, v and dout split
    into the outputs and gradients and the rest, and the ratios to the smallest size."""
    scaled = sorted(scaled, key=lambda r: (list(HEADS).index(r.heads), MODES.index(r.mode), r.outputs_gib))
    headers = ["workload", "heads", "mode", "kernel", "ms", "TF/s", "ms per FLOP / smallest's", "peak GiB",
               "out+grads GiB", "extra GiB", "extra/inputs", "peak per token / smallest's", "error"]
    body = [[r.workload, r.heads, r.mode, r.kernel, r.ms, r.tflops_per_gpu, r.flop_time_vs_smallest, r.peak_gib,
             r.outputs_gib, r.extra_gib, r.extra_vs_inputs, r.token_peak_vs_smallest, (r.error or "")[:60]]
            for r in scaled]
    caption = "one call fwd+bwd, one GPU; peak beyond q, k, v and dout"
    return f"{caption}\n{tabulate(body, headers=headers, missingval='-')}"


def write_json(path: Path, runs: list[dict], rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"runs": runs, "rows": [asdict(r) for r in ordered(rows)]}
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")  # default: the Path options


def read_json(path: Path) -> tuple[list[dict], list[Row]]:
    data = json.loads(path.read_text())
    names = {f.name for f in fields(Row)}
    return data["runs"], [Row(**{k: v for k, v in r.items() if k in names}) for r in data["rows"]]


def merge(paths: list[Path]) -> tuple[list[dict], list[Row]]:
    """The runs and rows of several JSON files; a row measured again (same workload, heads,
    mode, placement and mesh) is taken from the later file."""
    runs, by_key = [], {}
    for path in paths:
        file_runs, rows = read_json(path)
        runs += file_runs
        by_key.update({r.key(): r for r in rows})
    rows = list(by_key.values())
    relate(rows)
    return runs, rows


def plot(rows: list[Row], path: Path) -> None:
    """The rows of one batch repeated: efficiency against the best one GPU, one group of bars
    per (workload, heads), one bar per mode (with placement and mesh). Below, for every stream
    (workload, heads, steps x layers): each mode's cumulative time against the step, labelled
    with its steady TF/s per GPU and one-time share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ordered(rows)
    repeated = [r for r in rows if not r.stream_steps and not r.scale]  # the scale table has no plot
    streams = list(dict.fromkeys(_group(r) for r in rows if r.stream_steps))
    groups = list(dict.fromkeys((r.workload, r.heads) for r in repeated))
    series = list(dict.fromkeys(_label(r) for r in repeated))
    wide = max(8.0, 0.25 * len(groups) * len(series))
    fig, axes = plt.subplots(bool(repeated) + len(streams), 1, squeeze=False,
                             figsize=(wide, 4.5 * bool(repeated) + 4.0 * len(streams)))
    fig.subplots_adjust(hspace=0.45)
    axes = list(axes[:, 0])
    if repeated:
        _efficiency_bars(axes.pop(0), repeated, groups, series)
    colors = {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys(_label(r) for r in rows if r.stream_steps))}
    for ax, group in zip(axes, streams):
        workload, heads, steps, layers, reset, _ = group
        for row in rows:
            if _group(row) == group and row.step_ms:
                cumulative = list(itertools.accumulate((ms / 1e3 for ms in row.step_ms), initial=0.0))
                ax.plot(range(len(cumulative)), cumulative, color=colors[_label(row)],
                        label=f"{_label(row)}: steady {row.steady_tflops_per_gpu} TF/s/GPU, "
                              f"one-time {row.one_time_pct} %")
        reset = f", Dynamo reset every {reset} steps" if reset else ""
        ax.set_title(f"{workload} {heads}: a stream of {steps} batches x {layers} layers{reset}", fontsize="medium")
        ax.set_xlabel("steps done")
        ax.set_ylabel("cumulative s")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")


def _efficiency_bars(ax, rows: list[Row], groups: list[tuple[str, str]], series: list[str]) -> None:
    efficiency = {(r.workload, r.heads, _label(r)): r.efficiency for r in rows}
    width = 0.8 / len(series)
    for i, label in enumerate(series):
        values = [efficiency.get((*g, label)) or 0.0 for g in groups]  # failed or not run: no bar
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width,
               label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{w}\n{h}" for w, h in groups])
    ax.set_ylabel("efficiency vs best one GPU")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _label(row: Row) -> str:
    if row.mode in ONE_GPU_MODES:
        return row.mode
    placement = "" if row.mode == "torch-native-cp" else f" {row.placement}"
    return f"{row.mode}{placement} {row.mesh}" + " recompute" * row.recompute_exchange


def metadata(setup: Setup) -> dict:
    cuda = setup.device.type == "cuda"
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "devices": setup.world,
        "fake_rank": setup.rank if setup.fake else None,
        "options": {k: v for k, v in vars(setup.args).items() if k != "merge"},
    }


def parse_list(text: str, allowed: Sequence[str], option: str, parser: argparse.ArgumentParser) -> list[str]:
    """A comma-separated selection; a workload may be named by its family ("W2": both sizes)."""
    picked: list[str] = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        matches = [a for a in allowed if a == word or a.startswith(f"{word}-")]
        if not matches:
            parser.error(f"{option}: unknown {word!r}; expected some of {', '.join(allowed)}")
        picked += [m for m in matches if m not in picked]
    return picked


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--ulysses", type=int, help="default: the world size over --ring")
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--workloads", default=",".join(n for n in workloads() if n not in ONLY_WHEN_NAMED),
                        help="comma-separated names or families (W2)")
    parser.add_argument("--heads", default="gqa,mha", help="comma-separated: gqa (32/8), mha (32/32)")
    parser.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default: all that "
                                         "apply; one GPU: the one-GPU modes)")
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--kernel", default="auto", choices=KERNEL_CHOICES, help="hcp's attention kernel")
    parser.add_argument("--recompute-exchange", default="off", choices=("off", "on", "both"),
                        help="the hcp modes' recompute_exchange option; both: a row with each")
    parser.add_argument("--inner", help="the hcp backend's inner compiler (default: inductor on CUDA, "
                                        "aot_eager on CPU)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--stream", type=int, metavar="N",
                        help="instead of one batch repeated, a stream of N steps, every step a new batch of "
                             "the workload's distribution through --layers attention calls, fwd+bwd "
                             "(no --warmup, --iters, profile)")
    parser.add_argument("--layers", type=int, metavar="L",
                        help="with --stream: the attention calls (layers) per step, sharing its batch (default 1)")
    parser.add_argument("--mixed", type=int, metavar="N",
                        help="a stream of N steps in one process through the --workloads (default: W1..W4 at "
                             "128K and 256K) in a random order (seeded), each step a new batch, with --layers; "
                             "one row 'mixed' per mode")
    parser.add_argument("--mixed-reset", type=int, default=25, metavar="K",
                        help="with --mixed: torch._dynamo.reset() before every K-th step (0: never; default 25)")
    parser.add_argument("--scale", metavar="SIZES",
                        help="instead: one fwd+bwd call of each one-GPU mode (hcp, flex, flash) on W2 lengths at "
                             "each of these token counts (e.g. 128K,256K,512K,1M): time and peak memory beyond "
                             "q, k, v and dout (one process)")
    parser.add_argument("--plan-ahead", action="store_true",
                        help="with --stream: the CP modes take each step's prepared batch from a DataLoader "
                             "worker (hcp_compile.prepare_batch), as a trainer can, instead of planning it "
                             "on the step")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step (exposed comm)")
    parser.add_argument("--share-gpu", action="store_true",
                        help="every rank on cuda:0, collectives over gloo: the CP modes' per-rank peak "
                             "memory on a machine of one GPU, without their times (implies --no-profile)")
    parser.add_argument("--fake-rank", type=int, metavar="R",
                        help="run alone as rank R of the --ulysses x --ring world over torch's fake process "
                             "group (collectives move no data): the CP modes' work on that rank without "
                             "communication, an upper bound on their efficiency (one process, no torchrun)")
    parser.add_argument("--memory-peak", action="store_true",
                        help="record the CUDA allocator's history over each mode's peak-memory call and print "
                             "where its peak's memory lies")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="also trace the host in the profiled step, keep every rank's trace in DIR and "
                             "print where rank 0's step went")
    parser.add_argument("--shrink", type=int, default=1,
                        help="divide token counts, document lengths and the window by this (CPU smoke tests)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/speed_u{A}r{R}.json)")
    parser.add_argument("--plot", type=Path,
                        help="also plot the efficiencies (and the streams' cumulative times) into this PNG "
                             "(needs matplotlib)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="merge these results into --out (and --plot) instead of measuring")
    args = parser.parse_args()
    if args.merge and args.out is None:
        parser.error("--merge needs --out")
    args.workloads = parse_list(args.workloads, list(workloads()), "--workloads", parser)
    args.heads = parse_list(args.heads, list(HEADS), "--heads", parser)
    args.placements = parse_list(args.placements, PLACEMENTS, "--placements", parser)
    if args.modes is not None:
        args.modes = parse_list(args.modes, MODES, "--modes", parser)
    if args.scale is not None:
        check_scale(args, parser)
    if args.mixed is not None:
        if args.stream is not None:
            parser.error("--mixed N is a stream of N steps: it takes no --stream")
        if args.mixed < 2 * len(args.workloads):
            parser.error(f"--mixed {args.mixed}: expected at least 2 steps per workload (the first and a later "
                         f"one of each), {2 * len(args.workloads)} for {len(args.workloads)} workloads")
        if args.mixed_reset < 0:
            parser.error(f"--mixed-reset {args.mixed_reset}: expected 0 (never) or more")
        args.stream = args.mixed  # a stream, with the stream's options and checks
    if args.stream is None and args.layers is not None:
        parser.error("--layers counts the attention calls of a stream's step: it needs --stream")
    if args.stream is None and args.plan_ahead:
        parser.error("--plan-ahead prepares a stream's batches: it needs --stream")
    if args.stream is not None:
        if args.stream < 2:
            parser.error(f"--stream {args.stream}: expected at least 2 steps (the last half is the steady part)")
        args.layers = 1 if args.layers is None else args.layers
        if args.layers < 1:
            parser.error(f"--layers {args.layers}: expected at least 1")
        if args.modes is not None and "torch-native-cp" in args.modes:
            parser.error("--stream: torch-native-cp has no stream (its one document is the same batch every "
                         "step); leave it out")
        args.no_profile = True
    args.inner = args.inner or ("inductor" if args.device == "cuda" else "aot_eager")
    args.recompute_exchange = {"off": [False], "on": [True], "both": [False, True]}[args.recompute_exchange]
    if args.memory_peak:
        if args.device != "cuda":
            parser.error("--memory-peak records the CUDA allocator: it needs --device cuda")
        if args.stream is not None or args.scale is not None:
            parser.error("--memory-peak records a mode's call on one batch: it takes no --stream, --mixed "
                         "or --scale")
    if args.share_gpu:
        if args.device != "cuda":
            parser.error("--share-gpu shares a GPU: it needs --device cuda")
        args.no_profile = True  # the exposed communication of ranks taking turns means nothing
    if args.fake_rank is not None:
        if args.share_gpu:
            parser.error("--fake-rank runs one process: it takes no --share-gpu")
        if args.ulysses is None:
            parser.error("--fake-rank needs --ulysses (and --ring): there is no world to divide")
        if not 0 <= args.fake_rank < args.ulysses * args.ring:
            parser.error(f"--fake-rank {args.fake_rank}: expected a rank of the {args.ulysses} x {args.ring} "
                         f"mesh, 0..{args.ulysses * args.ring - 1}")
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            parser.error("--fake-rank runs one process alone: launch it with python (or torchrun "
                         "--nproc-per-node 1), not several processes")
        if args.modes is not None and "torch-native-cp" in args.modes:
            parser.error("--fake-rank: torch-native-cp cannot run over a fake process group; leave it out")
        args.no_profile = args.no_profile or args.trace is None  # no communication to find exposed
    return args


def check_scale(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--scale``: its sizes in K tokens, smallest first, into ``args.scale``; its modes (the
    one-GPU hcp, flex and flash); one process, no stream, no plot."""
    try:
        args.scale = sorted({parse_size(word.strip()) for word in args.scale.split(",") if word.strip()})
    except ValueError as error:
        parser.error(f"--scale: {error}")
    if not args.scale:
        parser.error("--scale: expected some token counts, such as 128K,256K,512K,1M")
    if args.stream is not None or args.mixed is not None:
        parser.error("--scale measures one call per size: it takes no --stream or --mixed")
    if args.fake_rank is not None or args.share_gpu or int(os.environ.get("WORLD_SIZE", 1)) > 1:
        parser.error("--scale runs on one GPU: launch one process, without --fake-rank or --share-gpu")
    if args.plot is not None:
        parser.error("--scale: its table has no plot; leave out --plot")
    wrong = [m for m in args.modes or () if m not in SCALE_MODES]
    if wrong:
        parser.error(f"--scale: {', '.join(wrong)} cannot run; expected some of {', '.join(SCALE_MODES)}")
    args.modes = args.modes or list(SCALE_MODES)
    args.no_profile = True


def report(rows: list[Row], runs: list[dict], args: argparse.Namespace) -> None:
    print(table(rows), flush=True)
    write_json(args.out, runs, rows)
    print(f"wrote {args.out}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


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


def main() -> None:
    args = parse_args()
    if args.merge:
        runs, rows = merge(args.merge)
        report(rows, runs, args)
        return
    cuda = args.device == "cuda"
    local_rank = 0 if args.share_gpu else int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    fake = args.fake_rank is not None
    if fake:
        init_fake(args.fake_rank, args.ulysses * args.ring)
    else:
        # plain NCCL: with a mixed cpu/cuda group Inductor cannot tell the collectives' device and
        # estimates them as free, which leaves its overlap scheduling nothing to hide (NCCL refuses
        # two ranks on one GPU: --share-gpu takes gloo)
        backend = "nccl" if cuda and not args.share_gpu else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:  # plain python: a world of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    args.ulysses = args.ulysses or world // args.ring
    if args.ulysses * args.ring != world:
        raise SystemExit(f"--ulysses {args.ulysses} x --ring {args.ring} must equal the world size {world}")
    if args.modes is None:
        args.modes = [m for m in (ONE_GPU_MODES if world == 1 else MODES)
                      if not ((fake or args.stream) and m == "torch-native-cp")]
    run = "_scale" if args.scale else f"_mixed{args.stream}x{args.layers}" if args.mixed else (
        f"_stream{args.stream}x{args.layers}" if args.stream else "")
    suffix = run + (f"_rank{args.fake_rank}_alone" if fake else "")
    args.out = args.out or Path(f"benchmarks/results/speed_u{args.ulysses}r{args.ring}{suffix}.json")
    setup = Setup(args, device, getattr(torch, args.dtype), dist.get_rank(), world, fake)
    runs = [metadata(setup)]
    rows: list[Row] = []
    by_name = workloads(args.shrink)

    def on_row(row: Row) -> None:
        if not setup.leads:
            return
        rows.append(row)
        relate(rows)
        write_json(args.out, runs, rows)  # after every row: a run cut short keeps its rows
        if row.error:
            result = row.error[:200]
        elif row.scale:
            result = (f"{row.ms} ms, {row.tflops_per_gpu} TF/s, peak {row.peak_gib} GiB beyond q, k, v, dout: "
                      f"out+grads {row.outputs_gib}, extra {row.extra_gib} ({row.extra_vs_inputs} x the inputs)")
        elif row.stream_steps:
            result = (f"{row.stream_s} s, {row.tflops_per_gpu} TF/s per GPU, steady {row.steady_tflops_per_gpu}, "
                      f"efficiency {row.efficiency} (steady {row.steady_efficiency}), one-time {row.one_time_pct} %, "
                      f"first step {row.first_step_s} s, prepare {row.prepare_ms} ms per step, {row.graphs} graphs, "
                      f"peak {row.peak_gib} GiB"
                      + (f", first step after the stream's first beyond its median, s: {row.first_extra_s}"
                         if row.first_extra_s else ""))
        else:
            result = (f"{row.ms} ms, {row.tflops_per_gpu} TF/s per GPU, efficiency {row.efficiency}, "
                      f"peak {row.peak_gib} GiB, saved {row.saved_gib} GiB, exposed comm {row.exposed_comm_ms} ms"
                      + (f", first call {row.first_call_s} s" if row.first_call_s is not None else ""))
        setup.say(f"  {row.mode} {row.placement}{' recompute' * row.recompute_exchange} ({row.kernel}): {result}")

    alone = f"rank {setup.rank} of " if fake else ""
    setup.say(f"{alone}{world} x {runs[0]['device']}, torch {torch.__version__}, mesh ulysses "
              f"{args.ulysses} x ring {args.ring}, modes {args.modes}")
    run_benchmark(setup, [by_name[n] for n in args.workloads], on_row)
    if setup.leads:
        report(rows, runs, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
