"""``python -m hcp_advise --measure``: this GPU's kernel times with the runtime's kernels
(``torch.ops.hcp.varlen_attention`` with each of ``hcp_compile.kernels.KERNELS``) on the
compositions and a few call sizes the compute part reads, and its NVLink where a second GPU is
visible, in about 2 minutes; stored for later calls (measurements.py).

Each timing is the wall time of forward + backward calls on new batches after a warm-up batch
(which builds what a kernel builds per shape), as scripts/measure_kernels.py times its main table:
a small call's time then holds its host's, which the host part, where it is modelled, counts
again (the GPU waiting for the host's launches): a small call on such a GPU is predicted somewhat
long; where it is not (a GPU without host times in host_measured.json) the kernel times carry
some of it.
"""

from __future__ import annotations

import datetime
import itertools
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hcp_compile.batch.packing import log_uniform_lengths
from hcp_compile.batch.traffic import CallShape
from hcp_compile.kernels import FALLBACK, KERNELS, BlockRequest
from hcp_compile.kernels.measured import LOG_UNIFORM, ONE_DOCUMENT, SHORT, WINDOW
from hcp_compile.validation import InputError

from .compute import visible_pairs
from .measurements import Timing, entry_of, store
from .records import FLOPS_PER_PAIR_HEAD_DIM

SIZES = (4096, 16384, 65536)  # tokens per call: the compute part interpolates between them by a call's work
BATCHES = 3  # timed batches of new lengths per measurement, after one warm-up batch
BUDGET_S = 90.0  # no kernel measurement starts after this; with one running and the links, about 2 minutes
# the document lengths of each composition, as scripts/measure_kernels.py draws them
RANGES = {LOG_UNIFORM: (256, 32768), SHORT: (128, 2048), WINDOW: (256, 32768)}
LINK_BYTES = 256 << 20  # per transfer: long enough that the latency is a small part of it


def batches(composition: str, tokens: int, count: int) -> list[list[int]]:
    """``count`` batches of ``tokens`` tokens of the composition's document lengths, new lengths
    in each (a stream, as a trainer's); one document is one shape."""
    if composition == ONE_DOCUMENT:
        return [[tokens]] * count
    low, high = RANGES[composition]
    return [log_uniform_lengths(tokens, low, high, seed=i) for i in range(count)]


def causal_flops(lengths: Sequence[int], call: CallShape, window: int) -> float:
    """Forward + backward FLOPs of one call on documents of ``lengths``: each visible pair (the
    advisor's own count, :func:`compute.visible_pairs`) at ``14 * head_dim`` per query head."""
    n = torch.tensor(list(lengths), dtype=torch.int64)
    zero = torch.zeros_like(n)
    return float(visible_pairs(zero, n, zero, n, window).sum()) * FLOPS_PER_PAIR_HEAD_DIM * call.head_dim * call.heads_q


def kernels_to_measure(kernel: str, request: BlockRequest) -> list[str]:
    """``kernel``; for ``"auto"`` every kernel but the torch reference that can run ``request``,
    the runtime's fallbacks first (if the budget runs out, what ``"auto"`` takes unmeasured is timed)."""
    if kernel != "auto":
        if kernel not in KERNELS:
            raise InputError(f"kernel: expected 'auto' or one of {sorted(KERNELS)}, got {kernel!r}")
        return [kernel]
    able = [name for name, k in KERNELS.items() if name != "torch" and k.supports(request) is None]
    order = FALLBACK["cuda"]
    return sorted(able, key=lambda name: order.index(name) if name in order else len(order))


def seconds_of(kernel: str, stream: list[list[int]], call: CallShape, window: int, device: torch.device) -> float:
    """Wall seconds of one forward + backward call of ``kernel`` on each batch of ``stream`` after
    the first (the warm-up); every batch has the first one's token count."""
    tokens = sum(stream[0])
    q = torch.randn(tokens, call.heads_q, call.head_dim, device=device, dtype=call.dtype, requires_grad=True)
    k, v = (torch.randn(tokens, call.heads_kv, call.head_dim, device=device, dtype=call.dtype, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)

    def step(lengths: list[int]) -> None:
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        out, _ = torch.ops.hcp.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), True,
                                                call.head_dim ** -0.5, window, -1 if window < 0 else 0, kernel)
        out.backward(dout)

    step(stream[0])
    _synchronize(device)
    started = time.perf_counter()
    for lengths in stream[1:]:
        step(lengths)
    _synchronize(device)
    return time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_timings(kernels: Sequence[str], call: CallShape, device: torch.device, *, window: int = -1,
                   sizes: Sequence[int] = SIZES, budget_s: float = BUDGET_S,
                   log: Callable[[str], object] = print) -> tuple[list[Timing], list[str]]:
    """Each kernel's :class:`Timing` on each composition and size, kernel by kernel; the window's
    composition (``window`` keys back, >= 0) for the kernels that take a causal window (on a mesh
    without a ring any of them runs it; a ring needs one that masks by position, which the
    advisor picks by ``Kernel.masks_by_position``). Returns also a line for each measurement
    that failed or did not start within ``budget_s`` seconds; ``log`` gets every line as it
    comes."""
    started = time.perf_counter()
    timings: list[Timing] = []
    skipped: list[str] = []
    compositions = [ONE_DOCUMENT, LOG_UNIFORM, SHORT] + ([WINDOW] if window >= 0 else [])
    windowed = BlockRequest(device, call.dtype, call.head_dim, call.heads_q, call.heads_kv, (window, 0))
    for kernel, composition, tokens in itertools.product(kernels, compositions, sizes):
        if composition == WINDOW and KERNELS[kernel].supports(windowed) is not None:
            continue
        what = f"{kernel} on {composition}, {tokens} tokens"
        if time.perf_counter() - started > budget_s:
            skipped.append(f"{what}: not measured, past the {budget_s:.0f} s budget")
            log(skipped[-1])
            continue
        stream, keys_back = batches(composition, tokens, BATCHES + 1), window if composition == WINDOW else -1
        try:
            seconds = seconds_of(kernel, stream, call, keys_back, device)
        except (RuntimeError, ValueError) as error:  # out of memory, a kernel that cannot run the call
            skipped.append(f"{what}: failed, {type(error).__name__}: {str(error)[:160]}")
            log(skipped[-1])
            continue
        flops = sum(causal_flops(lengths, call, keys_back) for lengths in stream[1:])
        timings.append(Timing(kernel, composition, tokens, len(stream) - 1, flops, seconds))
        log(f"{what}: {seconds * 1e3:.1f} ms, {flops / seconds / 1e12:.1f} TFLOP/s")
    return timings, skipped


def link_figures(devices: int, backend: str = "nccl", size: int = LINK_BYTES) -> tuple[dict[str, float], str]:
    """The NVLink figures of :class:`Links` measured between two of this machine's ``devices``
    GPUs (``backend`` "gloo": between two CPU processes, for tests), and a line saying how; with
    one GPU none, and a line saying so."""
    if devices < 2:
        return {}, "NVLink not measured: one GPU was visible, and an all-to-all or a ring hop needs two"
    with tempfile.TemporaryDirectory() as folder:
        try:
            torch.multiprocessing.spawn(_link_worker, args=(folder, backend, size), nprocs=2)
        except (torch.multiprocessing.ProcessRaisedException, torch.multiprocessing.ProcessExitedException) as error:
            return {}, f"NVLink not measured: {backend} between 2 ranks failed ({str(error).strip()[-200:]})"
        figures = json.loads((Path(folder) / "links.json").read_text())
    return figures, (f"links measured between GPUs 0 and 1 ({backend}; the NVLink figures): all-to-all "
                     f"{figures['all_to_all_bytes_per_s'] / 1e9:.0f} GB/s, ring hop "
                     f"{figures['ring_nvlink_bytes_per_s'] / 1e9:.0f} GB/s per GPU and direction, "
                     f"{figures['nvlink_latency_s'] * 1e6:.0f} us per collective")


def _link_worker(rank: int, folder: str, backend: str, size: int) -> None:
    """One of the two ranks: an all-to-all (half of it leaves each rank, as the model counts the
    bytes a rank sends) and a ring hop of 2 ranks (send and receive at once, as every ring rank
    does), each ``size`` bytes; a 2-byte all-to-all for the latency. Rank 0 writes the figures."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        def buffers(count: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.ones(count, dtype=torch.uint8, device=device),
                    torch.empty(count, dtype=torch.uint8, device=device))

        def all_to_all(count: int) -> Callable[[], object]:
            sent, got = buffers(count)
            return lambda: dist.all_to_all_single(got, sent)

        def hop() -> Callable[[], object]:
            sent, got = buffers(size)
            operations = [dist.P2POp(dist.isend, sent, 1 - rank), dist.P2POp(dist.irecv, got, 1 - rank)]
            return lambda: [work.wait() for work in dist.batch_isend_irecv(operations)]

        figures = {"nvlink_latency_s": _seconds(all_to_all(2), device),
                   "all_to_all_bytes_per_s": size / 2 / _seconds(all_to_all(size), device),
                   "ring_nvlink_bytes_per_s": size / _seconds(hop(), device)}
        if rank == 0:
            (Path(folder) / "links.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def _seconds(run: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """Mean seconds of ``run`` after a warm-up, both ranks starting together."""
    run()
    _synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    _synchronize(device)
    return (time.perf_counter() - started) / repeats


def measure(device_kind: str, kernel: str, call: CallShape, window: int, path: Path,
            log: Callable[[str], object] = print) -> list[str]:
    """Measure this machine's CUDA GPU, of kind ``device_kind``, for ``kernel`` ("auto": every
    kernel that can run ``call``) and write the table to ``path``; the lines saying what was
    measured, what not and why."""
    device = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    kernels = kernels_to_measure(kernel, BlockRequest(device, call.dtype, call.head_dim, call.heads_q, call.heads_kv))
    timings, skipped = kernel_timings(kernels, call, device, window=window, log=log)
    tables = entry_of(timings)
    links, links_note = link_figures(torch.cuda.device_count())
    entry: dict[str, Any] = {
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "setup": (f"python -m hcp_advise --measure: {call.heads_q}/{call.heads_kv} heads of {call.head_dim}, "
                  f"{str(call.dtype).removeprefix('torch.')}, causal, forward + backward, wall time of {BATCHES} "
                  f"new batches after a warm-up one, of {list(SIZES)} tokens"
                  + (f", window {window}" if window >= 0 else "")),
        **tables,
        **({"links": links} if links else {}),
        "links_note": links_note,
    }
    store(path, device_kind, entry)
    kept = "" if links else "; advice for it takes an NVIDIA H200's NVLink figures unless given (the link options)"
    return [f"measured {device_kind}: {len(timings)} timings of {', '.join(kernels)} in "
            f"{time.perf_counter() - started:.0f} s ({len(skipped)} not, as said above), stored in {path}",
            links_note + kept]
