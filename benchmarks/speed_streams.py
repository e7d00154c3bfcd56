"""Streams (``--stream``, ``--mixed``): every step a new batch through ``--layers`` attention
calls, timed on the host clock, and each mode's per-step preparation (flex's block mask, hcp's
``shard_plan``, optionally prepared ahead by a DataLoader worker)."""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import flex_attention

import hcp_compile
from benchmarks.common import kernel_intervals, kernel_summary, union_intervals
from benchmarks.speed_measure import STEP_NOTE, read_trace
from benchmarks.speed_modes import Attend, PackedAttention, dense_causal, document_block_mask, flash_call
from benchmarks.speed_rows import Measurement, TracedStep
from benchmarks.speed_setup import Setup, cu_seqlens, synchronize
from benchmarks.speed_workloads import HEADS, Workload
from hcp_compile.batch.prepared import PreparedBatch


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
        synchronize(device)
        started = time.perf_counter()
        with torch.profiler.record_function("plan"):
            step = Step(workload, cu_seqlens(workload.lengths, device), max(workload.lengths),
                        next(ahead) if ahead is not None else None)
            rows, attend = prepare(step)
            synchronize(device)
        prepared = time.perf_counter()
        layers, dout = inputs.take(rows)
        outs = [attend(*qkv) for qkv in layers]
        torch.autograd.backward(outs, [dout] * len(outs))
        synchronize(device)
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
    trace = read_trace(path)
    comm, compute = kernel_intervals(trace)
    busy = sum(stop - start for start, stop in union_intervals(comm + compute)) / 1e3
    summary = kernel_summary(trace) if comm or compute else "no kernels"
    return TracedStep(step_ms, busy, plan_ms, summary)


def flex_stream(setup: Setup) -> Prepare:
    """torch's flex: every step the batch's block mask, as a trainer must build it (compiled
    on CUDA, as :func:`speed_modes.one_gpu_flex`), then the layers' calls through one compiled
    flex."""
    attend = torch.compile(flex_attention, dynamic=False) if setup.device.type == "cuda" else flex_attention

    def prepare(step: Step) -> tuple[int, Attend]:
        mask = document_block_mask(step.workload, setup.device)
        return step.tokens, lambda q, k, v: attend(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return prepare


def flash_stream() -> Prepare:
    """``aten._flash_attention_forward`` on each step's batch, as
    :func:`speed_modes.one_gpu_flash`."""
    return lambda step: (step.tokens, flash_call(step.cu, step.longest, step.workload.window_left))


def sdpa_stream() -> Prepare:
    """Dense causal SDPA, as :func:`speed_modes.one_gpu_sdpa` (one document: the same batch every
    step)."""
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
    first step), with dynamic shapes as in :func:`speed_modes.hcp_mode`."""
    mesh, eager = setup.hcp_mesh(), functools.cache(PackedAttention)
    compiled_by_window = functools.cache(compile_window) if compile_window is not None else None

    def prepare(step: Step) -> tuple[int, Attend]:
        plan = hcp_compile.shard_plan(step.prepared if step.prepared is not None else step.cu, mesh,
                                      placement=placement, window=setup.layout_window(step.workload.window))
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
    """Empty what hcp keeps of the batches it has seen (``hcp_compile.clear_batch_cache``):
    every mode's stream draws the same batches, which must be new to each mode as a trainer's
    are. What it keeps per configuration (compiled kernels) stays."""
    hcp_compile.clear_batch_cache()


class PlannedSteps(torch.utils.data.Dataset):
    """Each step's batch prepared on the host for one rank (``hcp_compile.prepare_batch``), as a
    trainer's DataLoader worker builds it while the previous steps run (``--plan-ahead``)."""

    def __init__(self, steps: list[Workload], setup: Setup, placement: str):
        # plain values: the dataset travels to the worker process
        self.steps, self.placement = steps, placement
        self.ulysses, self.ring, self.rank = setup.args.ulysses, setup.args.ring, setup.rank
        self.layout_windows = [setup.layout_window(w.window) for w in steps]

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> PreparedBatch:
        workload = self.steps[index]
        return hcp_compile.prepare_batch(
            cu_seqlens(workload.lengths, torch.device("cpu")), ulysses=self.ulysses, ring=self.ring,
            placement=self.placement, rank=self.rank, window=workload.window,
            layout_window=self.layout_windows[index])


def plans_ahead(setup: Setup, steps: list[Workload], placement: str) -> Iterator[PreparedBatch]:
    """The steps' prepared batches from one DataLoader worker process, two steps ahead (the
    worker stops when the iterator is dropped)."""
    loader = torch.utils.data.DataLoader(
        PlannedSteps(steps, setup, placement),
        batch_size=None, num_workers=1, prefetch_factor=2)
    return iter(loader)
