"""The run of benchmarks.speed: every selected (heads, workload, mode, placement) on one batch
repeated, as a stream or a mixed stream, or the scale table's one call per size; each row
handed on as it is measured."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

import hcp_compile
from benchmarks.cp_throughput import causal_flops, time_fwd_bwd
from benchmarks.speed_measure import record
from benchmarks.speed_modes import (
    compile_hcp, fill_free_memory, hcp_kernel, hcp_mode, one_gpu_call, one_gpu_flash, one_gpu_flex, one_gpu_hcp,
    one_gpu_sdpa, torch_native_cp,
)
from benchmarks.speed_rows import (
    ONE_GPU_MODES, Measurement, Row, row_scheme, scale_figures, significant, summarize_compositions, summarize_stream,
)
from benchmarks.speed_setup import Batch, Setup
from benchmarks.speed_streams import (
    Prepare, flash_stream, flex_stream, forget_batches, hcp_cp_stream, hcp_stream, plans_ahead, sdpa_stream, stream,
)
from benchmarks.speed_workloads import HEADS, Workload, log_uniform, mixed_steps, reset_steps

# the row (workload) of a --mixed stream
MIXED = "mixed"


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
                  recompute_exchange=recompute, scheme=row_scheme(args, mode))
        row = record(row, run, setup, together=together)
        if gpus > 1 and args.share_gpu:  # the ranks took turns on one GPU: the time is no speed
            row.ms = row.first_call_s = None
        if row.ms is not None:
            row.tflops_per_gpu = significant(flops / gpus / row.ms / 1e9)
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
                  recompute_exchange=recompute, scheme=row_scheme(args, mode), stream_steps=args.stream,
                  stream_layers=args.layers,
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
                      outputs_gib=significant(outputs_gib(tokens, heads, setup)))
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
