"""How benchmarks.speed measures a mode on one batch repeated: its time, peak and saved
memory, its exposed communication in a profiled step, and :func:`record`, which makes the
measurement (or the mode's error) a row."""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks.common import exposed_length, kernel_intervals, kernel_summary, live_at_peak
from benchmarks.cp_throughput import time_fwd_bwd
from benchmarks.speed_rows import Measurement, Row, significant
from benchmarks.speed_setup import Batch, Setup, synchronize

# the note a stream's failing step adds to its exception, which the row's error starts with
STEP_NOTE = "at step"


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
        synchronize(setup.device)
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
        trace = read_trace(path)
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


def read_trace(path: Path) -> dict:
    """A Chrome trace the profiler exported (gzipped where ``path`` ends in .gz)."""
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


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
        rounded = {name: None if value is None else significant(value)
                   for name, value in (("ms", measured.ms), ("peak_gib", measured.peak_gib),
                                       ("saved_gib", measured.saved_gib), ("prepare_ms", measured.prepare_ms))}
        row.ms, row.peak_gib, row.saved_gib, row.prepare_ms = rounded.values()
        row.exposed_comm_ms, row.exposed_comm_pct = measured.exposed_comm_ms, measured.exposed_comm_pct
        row.first_call_s = measured.first_call_s
        if measured.step_ms is not None:
            row.step_ms = [significant(t) for t in measured.step_ms]
            row.graphs = measured.graphs
        if measured.traced is not None:
            traced = measured.traced
            row.traced_step_ms, row.traced_busy_ms, row.traced_plan_ms = (
                significant(v) for v in (traced.step_ms, traced.busy_ms, traced.plan_ms))
            setup.say(f"  traced step: {traced.summary}")
    return row


def _largest(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else max(values)
