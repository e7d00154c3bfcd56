"""Speed of hierarchical CP against the best one-GPU kernel and PyTorch's native context
parallelism, on packed workloads (issue 9): one table, one JSON file, optionally one plot.

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
- W3-128K: lengths log-uniform in 128..2K, 128K tokens;
- W4-128K, W4-256K: the W2 batches under a sliding window (left 4096, right 0).

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
(GPUs x ms); peak GiB = the largest ``max_memory_allocated`` of a rank during the timed steps
beyond what it held before (the inputs), and its ratio to the best one-GPU mode's; saved GiB =
the largest memory a rank's forward allocates and still holds when it returns (the output and
what the backward needs: what a model holds per layer until its backward), and its ratio; exposed
comm = in one profiled step of rank 0, the time some NCCL kernel runs while no other kernel
does, in ms and in % of the traced step (first kernel start to last kernel end). A failing mode
(compile error, OOM, unsupported) is a row with its error; the run goes on. The JSON file is
rewritten after every row, so a run cut short keeps what it measured. ``--trace DIR`` also
traces the host in the profiled step (of every mode, the one-GPU ones included), keeps each
rank's trace in DIR and prints the step's span, busy time and top kernels. ``--share-gpu``
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
"""

from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import itertools
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import hcp_compile
from benchmarks.common import exposed_length, kernel_intervals, kernel_summary, log_uniform_lengths
from benchmarks.cp_throughput import causal_flops, time_fwd_bwd
from hcp_compile.kernels import KERNEL_CHOICES, BlockRequest, resolve_kernel

HEADS = {"gqa": (32, 8), "mha": (32, 32)}
ONE_GPU_MODES = ("one-gpu-flex", "one-gpu-flash", "one-gpu-sdpa", "one-gpu-hcp")
MODES = (*ONE_GPU_MODES, "hcp-eager", "hcp-compiled", "torch-native-cp")
PLACEMENTS = ("balanced", "zigzag")
WINDOW_LEFT = 4096
NO_WINDOW = (-1, -1)


@dataclass(frozen=True)
class Workload:
    name: str
    lengths: tuple[int, ...]
    window_left: int = -1  # -1: no window

    @property
    def window(self) -> tuple[int, int]:
        return (self.window_left, 0) if self.window_left >= 0 else NO_WINDOW


def workloads(shrink: int = 1) -> dict[str, Workload]:
    """The workloads by name; token counts, length ranges and the window divided by ``shrink``
    (tiny CPU runs keep the names)."""

    def tokens(k: int) -> int:
        return k * 1024 // shrink

    def size(n: int) -> int:
        return max(1, n // shrink)

    log_uniform = {k: tuple(log_uniform_lengths(tokens(k), size(256), size(32768), seed=0))
                   for k in (128, 256)}
    short = tuple(log_uniform_lengths(tokens(128), size(128), size(2048), seed=1))
    result = [Workload(f"W1-{k}K", (tokens(k),)) for k in (128, 256)]
    result += [Workload(f"W2-{k}K", log_uniform[k]) for k in (128, 256)]
    result.append(Workload("W3-128K", short))
    result += [Workload(f"W4-{k}K", log_uniform[k], size(WINDOW_LEFT)) for k in (128, 256)]
    return {w.name: w for w in result}


@dataclass
class Row:
    """One (workload, heads, mode, placement, mesh) measurement; efficiency and
    peak_vs_one_gpu are filled by :func:`relate` from the rows at hand."""

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

    def key(self) -> tuple[str | bool, ...]:
        return self.workload, self.heads, self.mode, self.placement, self.mesh, self.recompute_exchange


@dataclass
class Measurement:
    ms: float
    peak_gib: float | None = None
    saved_gib: float | None = None
    exposed_comm_ms: float | None = None
    exposed_comm_pct: float | None = None
    first_call_s: float | None = None


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
        lengths = torch.tensor(workload.lengths)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(setup.device, torch.int32)
        tokens, head_dim = int(lengths.sum()), setup.args.head_dim
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
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    warmup = max(0, setup.args.warmup - first_call)
    ms = time_fwd_bwd(fn, inputs, warmup, setup.args.iters, barrier=not alone)
    peak = (torch.cuda.max_memory_allocated() - held) / 2**30 if cuda else None
    profiled = profile is not None and cuda and not setup.args.no_profile
    exposed = exposed_communication(fn, inputs, setup, profile, alone) if profiled else (None, None)
    saved = held_after_forward(fn, inputs) if cuda else None
    return Measurement(ms, peak, saved, *exposed, first_call_s)


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
    """One fwd+bwd under the profiler on every rank (``alone``: on this one); from rank 0's
    trace, the time some NCCL kernel runs while no other kernel does: ms, and % of the traced
    step (first kernel start to last kernel end). None on the other ranks. With ``--trace DIR``
    the host is traced too, every rank's trace is kept as ``DIR/<name>_rank<r>.json.gz`` and
    rank 0 prints where its step's time went (:func:`kernel_summary`)."""
    from torch.profiler import ProfilerActivity, profile

    folder = setup.args.trace
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if folder else [])
    if not alone:
        dist.barrier()
    with profile(activities=activities) as prof:
        fn(*inputs).sum().backward()
        torch.cuda.synchronize()
    rank = setup.rank
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "trace.json"
        if folder:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{name}_rank{rank}.json.gz"
        prof.export_chrome_trace(str(path))  # once: a profile exports one trace
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
        error = f"{type(exc).__name__}: {exc}".strip()[:2000]
        out_of_memory = isinstance(exc, torch.cuda.OutOfMemoryError)
    if out_of_memory:  # here, once the exception and the tensors of its frames are gone
        gc.collect()
        torch.cuda.empty_cache()
    if together and setup.world > 1 and not setup.fake:
        report = [None] * setup.world
        dist.all_gather_object(report, (error, (measured.peak_gib, measured.saved_gib) if measured else None))
        error = next((e for e, _ in report if e), None)
        if measured is not None and measured.peak_gib is not None:
            measured.peak_gib, measured.saved_gib = (max(m[i] for _, m in report if m) for i in (0, 1))
    if error is not None:
        row.error = error
    elif measured is not None:
        row.ms = _significant(measured.ms)
        row.peak_gib = None if measured.peak_gib is None else _significant(measured.peak_gib)
        row.saved_gib = None if measured.saved_gib is None else _significant(measured.saved_gib)
        row.exposed_comm_ms, row.exposed_comm_pct = measured.exposed_comm_ms, measured.exposed_comm_pct
        row.first_call_s = measured.first_call_s
    return row


def _significant(value: float) -> float:
    return float(f"{value:.4g}")  # readable for GPU sizes and tiny CPU smoke tests alike


# --------------------------------------------------------------------------- the modes


def one_gpu_flex(batch: Batch, setup: Setup) -> Measurement:
    """torch's flex_attention on the whole batch, compiled. On CPU it runs uncompiled and
    fails: torch's flex has no backward there (the smoke test records that error)."""
    # flex's layout [1, H, T, D], made before the timing as hcp's [T, H, D] is
    q, k, v = (t.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for t in batch.qkv)
    mask = document_block_mask(batch.workload, setup.device)
    cuda = setup.device.type == "cuda"
    attend = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention
    gqa = q.shape[1] != k.shape[1]
    return measure(lambda q, k, v: attend(q, k, v, block_mask=mask, enable_gqa=gqa), [q, k, v], setup,
                   alone=True, first_call=cuda, profile=one_gpu_trace(batch, setup, "one-gpu-flex"))


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
    q, k, v = (t.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for t in batch.qkv)
    gqa = q.shape[1] != k.shape[1]
    return measure(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa),
                   [q, k, v], setup, alone=True, profile=one_gpu_trace(batch, setup, "one-gpu-sdpa"))


def one_gpu_hcp(batch: Batch, setup: Setup) -> Measurement:
    """hcp's single-device ``varlen_attention`` (no context parallelism) on the whole batch,
    with the kernel ``--kernel`` resolves to."""
    q, k, v = (t.clone().requires_grad_() for t in batch.qkv)
    attend = PackedAttention(batch.workload.window)
    return measure(lambda q, k, v: attend(q, k, v, batch.cu, batch.longest), [q, k, v], setup, alone=True,
                   profile=one_gpu_trace(batch, setup, "one-gpu-hcp"))


def one_gpu_flash(batch: Batch, setup: Setup) -> Measurement:
    """``aten._flash_attention_forward`` (differentiable) on the whole batch, as hcp's flash
    kernel calls it: KV heads as they are, the window as flash's left/right sizes."""
    q, k, v = (t.clone().requires_grad_() for t in batch.qkv)
    left, _ = batch.workload.window
    window = {"window_size_left": left, "window_size_right": 0} if left >= 0 else {}
    cu, longest = batch.cu, batch.longest

    def attend(q, k, v):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, **window
        )[0]

    return measure(attend, [q, k, v], setup, alone=True, profile=one_gpu_trace(batch, setup, "one-gpu-flash"))


class PackedAttention(nn.Module):
    """The single-device call that the hcp modes run on shards (compiled: rewritten). The
    window is an attribute, not an argument: a module's ints stay constants in the graph, while
    an int argument that changes between calls would be traced as a symbol, and the backend
    needs the window at compile time."""

    def __init__(self, window: tuple[int, int]):
        super().__init__()
        self.window = window

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        return hcp_compile.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                            causal=True, window_size=self.window)


def hcp_mode(
    batch: Batch, setup: Setup, placement: str, compiled: Callable[..., Tensor] | None,
    recompute_exchange: bool,
) -> Measurement:
    """hcp on this rank's shard: eagerly in ``context_parallel``, or through ``compiled`` (a
    compiled :class:`PackedAttention` of the batch's window, with the same
    ``recompute_exchange``)."""
    mesh, args = setup.hcp_mesh(), setup.args
    if setup.fake and setup.device.type == "cuda":
        fill_free_memory(setup.device)
    plan = hcp_compile.shard_plan(batch.cu, mesh, placement=placement)
    local = [plan.shard(t).requires_grad_() for t in batch.qkv]
    profile = trace_name(batch, setup, "hcp-compiled" if compiled is not None else "hcp-eager", placement)
    if compiled is None:
        attend = PackedAttention(batch.workload.window)
        with hcp_compile.context_parallel(mesh, kernel=args.kernel, placement=placement,
                                          recompute_exchange=recompute_exchange):
            return measure(lambda q, k, v: attend(q, k, v, batch.cu, batch.longest), local, setup,
                           profile=profile)
    # the token count, the document count and the longest document vary across workloads:
    # traced as symbols, so that one graph per (placement, window) serves them all (but a
    # one-document batch, whose 2-entry cu_seqlens gets specialized, has a graph of its own)
    for t in (*local, batch.cu):
        torch._dynamo.maybe_mark_dynamic(t, 0)

    def step(q, k, v):
        with torch.compiler.config.patch(dynamic_sources="L['max_seqlen']"):
            return compiled(q, k, v, batch.cu, batch.longest)

    return measure(step, local, setup, first_call=True, profile=profile)


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


def hcp_kernel(batch: Batch, kernel: str, cp: bool = True) -> str:
    """The kernel hcp runs this batch with (the choice context_parallel and the backend make,
    or the single-device op's with ``cp=False``); the option itself when none can (the mode
    then fails and its row says why)."""
    request = BlockRequest.of(batch.q, batch.k, batch.workload.window, context_parallel=cp)
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


# --------------------------------------------------------------------------- the run


def run_benchmark(setup: Setup, selected: list[Workload], on_row: Callable[[Row], None]) -> None:
    """Every selected (heads, workload, mode, placement), heads outermost: the compiled hcp
    modules of one head configuration serve all its workloads. ``on_row`` gets each row as it
    is measured (on every rank)."""
    for heads in setup.args.heads:
        torch._dynamo.reset()  # drop the previous head configuration's graphs
        compiled: dict[tuple, Callable[..., Tensor]] = {}  # by (placement, window, recompute_exchange)
        for workload in selected:
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
        if gpus > 1 and args.share_gpu:
            mesh += " shared"
        if gpus > 1 and setup.fake:
            mesh += f" rank {setup.rank} alone"
        row = Row(workload.name, heads, mode, placement, kernel, mesh, gpus,
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
                                      ("one-gpu-hcp", one_gpu_hcp, hcp_kernel(batch, args.kernel, cp=False))):
                if mode not in args.modes:
                    continue
                if mode == "one-gpu-sdpa" and (len(workload.lengths) > 1 or workload.window_left >= 0):
                    setup.say(f"  {mode}: skipped, a dense call is exact only for one document without a window")
                    continue
                if mode == "one-gpu-flash" and setup.device.type != "cuda":
                    setup.say(f"  {mode}: skipped, flash needs CUDA")
                    continue
                measured(mode, "-", kernel, "1", 1, lambda run=run: run(batch, setup), together=False)
        dist.barrier()  # the other ranks wait here while rank 0 runs alone
    kernel = hcp_kernel(batch, args.kernel)
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


def relate(rows: list[Row]) -> None:
    """Fill each row's efficiency (best one-GPU ms / (GPUs x ms)) and memory ratio against the
    fastest one-GPU row of its workload and heads, where the rows hold one."""
    best: dict[tuple[str, str], Row] = {}
    for row in rows:
        key = (row.workload, row.heads)
        if row.mode in ONE_GPU_MODES and row.ms is not None and (key not in best or row.ms < best[key].ms):
            best[key] = row
    for row in rows:
        base = best.get((row.workload, row.heads))
        row.efficiency = round(base.ms / (row.gpus * row.ms), 3) if base and row.ms is not None else None
        row.peak_vs_one_gpu = (round(row.peak_gib / base.peak_gib, 2)
                               if base and row.peak_gib is not None and base.peak_gib else None)
        row.saved_vs_one_gpu = (round(row.saved_gib / base.saved_gib, 2)
                                if base and row.saved_gib is not None and base.saved_gib else None)


def ordered(rows: list[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: (r.workload, list(HEADS).index(r.heads), MODES.index(r.mode),
                                       r.placement, r.mesh, r.recompute_exchange))


def table(rows: list[Row]) -> str:
    headers = ["workload", "heads", "mode", "placement", "recompute", "kernel", "mesh", "ms", "TF/s/GPU",
               "eff", "peak GiB", "peak/1GPU", "saved GiB", "saved/1GPU", "exposed ms", "exposed %", "error"]
    body = [[r.workload, r.heads, r.mode, r.placement, "yes" if r.recompute_exchange else "",
             r.kernel, r.mesh, r.ms, r.tflops_per_gpu,
             r.efficiency, r.peak_gib, r.peak_vs_one_gpu, r.saved_gib, r.saved_vs_one_gpu,
             r.exposed_comm_ms, r.exposed_comm_pct,
             (r.error or "")[:60]] for r in ordered(rows)]
    return tabulate(body, headers=headers, missingval="-")


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
    """Efficiency against the best one GPU, one group of bars per (workload, heads), one bar
    per mode (with placement and mesh)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ordered(rows)
    groups = list(dict.fromkeys((r.workload, r.heads) for r in rows))
    series = list(dict.fromkeys(_label(r) for r in rows))
    efficiency = {(r.workload, r.heads, _label(r)): r.efficiency for r in rows}
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.25 * len(groups) * len(series)), 4.5))
    for i, label in enumerate(series):
        values = [efficiency.get((*g, label)) or 0.0 for g in groups]  # failed or not run: no bar
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width,
               label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{w}\n{h}" for w, h in groups])
    ax.set_ylabel("efficiency vs best one GPU")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")


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
    parser.add_argument("--workloads", default=",".join(workloads()),
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
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step (exposed comm)")
    parser.add_argument("--share-gpu", action="store_true",
                        help="every rank on cuda:0, collectives over gloo: the CP modes' per-rank peak "
                             "memory on a machine of one GPU, without their times (implies --no-profile)")
    parser.add_argument("--fake-rank", type=int, metavar="R",
                        help="run alone as rank R of the --ulysses x --ring world over torch's fake process "
                             "group (collectives move no data): the CP modes' work on that rank without "
                             "communication, an upper bound on their efficiency (one process, no torchrun)")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="also trace the host in the profiled step, keep every rank's trace in DIR and "
                             "print where rank 0's step went")
    parser.add_argument("--shrink", type=int, default=1,
                        help="divide token counts, document lengths and the window by this (CPU smoke tests)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/speed_u{A}r{R}.json)")
    parser.add_argument("--plot", type=Path,
                        help="also plot the efficiencies into this PNG (needs matplotlib)")
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
    args.inner = args.inner or ("inductor" if args.device == "cuda" else "aot_eager")
    args.recompute_exchange = {"off": [False], "on": [True], "both": [False, True]}[args.recompute_exchange]
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


def report(rows: list[Row], runs: list[dict], args: argparse.Namespace) -> None:
    print(table(rows), flush=True)
    write_json(args.out, runs, rows)
    print(f"wrote {args.out}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


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
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=args.fake_rank, world_size=args.ulysses * args.ring,
                                store=FakeStore())
    else:
        # plain NCCL: with a mixed cpu/cuda group Inductor cannot tell the collectives' device and
        # estimates them as free, which leaves its overlap scheduling nothing to hide (NCCL refuses
        # two ranks on one GPU: --share-gpu takes gloo)
        dist.init_process_group("nccl" if cuda and not args.share_gpu else "gloo")
    world = dist.get_world_size()
    args.ulysses = args.ulysses or world // args.ring
    if args.ulysses * args.ring != world:
        raise SystemExit(f"--ulysses {args.ulysses} x --ring {args.ring} must equal the world size {world}")
    if args.modes is None:
        args.modes = [m for m in (ONE_GPU_MODES if world == 1 else MODES) if not (fake and m == "torch-native-cp")]
    suffix = f"_rank{args.fake_rank}_alone" if fake else ""
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
        result = row.error[:200] if row.error else (
            f"{row.ms} ms, {row.tflops_per_gpu} TF/s per GPU, efficiency {row.efficiency}, "
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
