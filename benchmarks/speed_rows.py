"""What benchmarks.speed measures: a mode's :class:`Measurement`, the :class:`Row` it becomes,
and the figures derived from rows (a stream's, a scale row's, and the efficiencies and memory
ratios that relate rows of the same work)."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

ONE_GPU_MODES = ("one-gpu-flex", "one-gpu-flash", "one-gpu-sdpa", "one-gpu-hcp")
MODES = (*ONE_GPU_MODES, "hcp-eager", "hcp-compiled", "torch-native-cp")


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
    scheme: str = "ring"  # hcp's collective scheme (--scheme; the CP modes')
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
        return (self.workload, self.heads, self.mode, self.placement, self.mesh, self.recompute_exchange, self.scheme,
                self.stream_steps, self.stream_layers, self.plan_ahead, self.mixed_reset, self.scale)


@dataclass
class TracedStep:
    """One step of a stream under the profiler (``--trace``): its host-clock time, the time some
    kernel ran, and the plan's (host) part; the rest of the step the GPU waited for the host
    (in a fake-rank or one-GPU stream there is no communication to wait for)."""

    step_ms: float
    busy_ms: float
    plan_ms: float
    summary: str


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
    traced: TracedStep | None = None  # --trace with --stream


def row_scheme(args, mode: str) -> str:
    """The collective scheme a row of ``mode`` ran (--scheme for hcp's CP modes)."""
    return args.scheme if mode in ("hcp-eager", "hcp-compiled") else "ring"


def significant(value: float) -> float:
    return float(f"{value:.4g}")  # readable for GPU sizes and tiny CPU smoke tests alike


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
    row.stream_s = significant(total)
    row.tflops_per_gpu, row.steady_tflops_per_gpu = significant(overall), significant(steady)
    row.one_time_pct = round(100 * (1 - overall / steady), 1)
    row.first_step_s = significant(seconds[0])
    row.cumulative_s = [significant(cumulative[-(-n * tenth // 10) - 1]) for tenth in range(1, 11)]


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
        extra[name] = significant((later[0] - statistics.median(later)) / 1e3) if later else None
    return extra


def scale_figures(row: Row, flops: float) -> None:
    """A scale row's TF/s from its ms and the call's causal FLOPs, and its peak split into the
    outputs and gradients (``outputs_gib``, set) and the rest, alone and over the inputs."""
    if row.ms is not None:
        row.tflops_per_gpu = significant(flops / row.ms / 1e9)
    if row.peak_gib is not None:
        row.extra_gib = significant(row.peak_gib - row.outputs_gib)
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
        key, time = work_key(row), _time(row)
        if time is not None and (key not in best or time < _time(best[key])):
            best[key] = row
        if row.steady_tflops_per_gpu is not None and (
                key not in steadiest or row.steady_tflops_per_gpu > steadiest[key].steady_tflops_per_gpu):
            steadiest[key] = row
    for row in rows:
        base, fastest, time = best.get(work_key(row)), steadiest.get(work_key(row)), _time(row)
        row.efficiency = round(_time(base) / (row.gpus * time), 3) if base and time is not None else None
        row.steady_efficiency = (round(row.steady_tflops_per_gpu / fastest.steady_tflops_per_gpu, 3)
                                 if fastest and row.steady_tflops_per_gpu is not None else None)
        row.peak_vs_one_gpu = (round(row.peak_gib / base.peak_gib, 2)
                               if base and row.peak_gib is not None and base.peak_gib else None)
        row.saved_vs_one_gpu = (round(row.saved_gib / base.saved_gib, 2)
                                if base and row.saved_gib is not None and base.saved_gib else None)
    relate_scale(rows)


def work_key(row: Row) -> tuple:
    """What identifies the rows measured on the same work, which efficiencies relate."""
    return row.workload, row.heads, row.stream_steps, row.stream_layers, row.mixed_reset, row.scale


def _time(row: Row) -> float | None:
    return row.stream_s if row.stream_steps else row.ms
