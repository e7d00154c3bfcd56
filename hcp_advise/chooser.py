"""The chooser: the valid meshes and placements, each one's prediction (its slowest rank), the
recommendation."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from hcp_compile.batch import layout
from hcp_compile.batch.layout import window_by_position
from hcp_compile.batch.placements import PLACEMENTS, placement_rule
from hcp_compile.batch.schedule import head_groups, rank_kv_heads
from hcp_compile.batch.traffic import CallShape, call_traffic
from hcp_compile.kernels import KERNELS, measured
from hcp_compile.validation import InputError, check_head_split

from . import host_measured
from .communication import exchange_bytes, exchange_times, hop_times, rank_sizes, ring_link
from .compute import block_work, compute_times, cuts_short_segments, one_gpu_call
from .host import host_counts, host_leads, host_times
from .host_measured import HostRecord
from .measurements import MEASURE, KernelTable, kernel_table
from .overlap import predict_rank
from .passes import active_steps, pass_times
from .records import (
    Advice, DEFAULT_DEVICE, Links, MODEL_ERROR, MODEL_ERROR_WINDOW, Option, Prediction, RankPrediction, SCHEME,
)


def mesh_options(world: int, gpus_per_node: int, heads_q: int, heads_kv: int,
                 placements: Sequence[str] = tuple(PLACEMENTS)) -> list[Option]:
    """Every ``ulysses x ring = world`` that :func:`split_refusal` lets run (its Ulysses group lies
    inside one node and can split the heads), with every placement."""
    _check_positive(world=world, gpus_per_node=gpus_per_node, heads_q=heads_q, heads_kv=heads_kv)
    if isinstance(placements, str) or not placements:
        raise InputError(f"placements: expected a non-empty list of names of {sorted(PLACEMENTS)}, "
                         f"got {placements!r}")
    if heads_q % heads_kv:
        raise InputError(f"heads: {heads_q} query heads are not a multiple of {heads_kv} "
                         "key/value heads; pass --heads HQ/HKV with HKV dividing HQ")
    for name in placements:
        if name not in PLACEMENTS:
            raise InputError(f"placements: expected names of {sorted(PLACEMENTS)}, got {name!r}")
    meshes = [(a, world // a) for a in splits(world) if split_refusal(a, gpus_per_node, heads_q, heads_kv) is None]
    return [Option(a, r, p) for a, r in meshes for p in placements]


def splits(world: int) -> list[int]:
    """The Ulysses sizes of every ``ulysses x ring = world``, smallest first."""
    return [a for a in range(1, world + 1) if world % a == 0]


def split_refusal(ulysses: int, gpus_per_node: int, heads_q: int, heads_kv: int) -> str | None:
    """Why a mesh of Ulysses size ``ulysses`` cannot run (None: it can): a Ulysses group is
    ``ulysses`` consecutive ranks, inside one node, and splits the heads
    (:func:`validation.check_head_split`)."""
    if gpus_per_node % ulysses:
        return (f"a Ulysses group of {ulysses} GPUs does not fit evenly in a node of {gpus_per_node} "
                "(--gpus-per-node)")
    try:
        check_head_split(heads_q, heads_kv, ulysses)
    except InputError:
        if heads_q % ulysses:
            return f"ulysses {ulysses} does not divide the {heads_q} query heads"
        return f"the {heads_kv} key/value heads neither divide ulysses {ulysses} nor are a multiple of it"
    return None


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name}: expected a positive int, got {value!r}")


def predict_batch(cu_seqlens: Tensor, option: Option, gpus_per_node: int, call: CallShape,
                  kernel: str, table: KernelTable, links: Links,
                  host: HostRecord | None = None) -> tuple[RankPrediction, float, float]:
    """The slowest rank's prediction for one batch, the mean rank's compute and the layout's
    balance (:func:`balance`); ``host``: the measured host constants (None: that part not
    modelled)."""
    ulysses, ring = option.ulysses, option.ring
    # laid out for the window, as shard_plan(..., window=) and the trainer lay a windowed model out
    batch = layout.batch_layout(cu_seqlens, ulysses, ring, placement_rule(option.placement), call.window)
    work = block_work(batch, call.window, cuts_short_segments(kernel))
    groups = head_groups(rank_kv_heads(call.heads_kv, ulysses), ulysses)
    link = ring_link(ulysses, ring, gpus_per_node)
    ranks = []
    for r in range(ring):
        sizes = [rank_sizes(batch, r, a) for a in range(ulysses)]
        moved = [exchange_bytes(s, call, ulysses, ring) for s in sizes]
        slowest = tuple(max(column) for column in zip(*moved))
        exchange = exchange_times(slowest, links, groups)
        active = active_steps(work, r, sizes[0], ring)
        steps = len(active)  # the schedule's: a window may end it early (layout.window_steps)
        hops = hop_times(sizes[0], call, ulysses, ring, link, links, groups, steps)
        ring_bytes = call_traffic(SCHEME, sizes[0], call, ulysses, ring, steps).ring
        for a in range(ulysses):
            compute = compute_times(work, r, a, call, kernel, table)
            passes = pass_times(sizes[a], active, call, ulysses, kernel)
            issued = host_times(host_counts(sizes[a], r, ring, kernel, call.heads_kv, steps), host)
            lead = host_leads(sizes[a], r, ring, kernel, call.heads_kv, host, steps)
            step, a2a, exposed_ring, wait = predict_rank(compute, exchange, hops, groups, issued, passes, lead)
            ranks.append(RankPrediction(step, compute.total, a2a, exposed_ring, sum(moved[a]),
                                        ring_bytes.forward_bytes + ring_bytes.backward_bytes,
                                        issued.forward + issued.backward, wait, passes.total))
    return max(ranks, key=lambda p: p.step), sum(p.compute for p in ranks) / len(ranks), balance(batch)


def balance(batch: layout.BatchLayout) -> float:
    """The largest rank's tokens, pads included, over the mean real tokens per rank: every rank
    holds ``batch.local_tokens`` (layout.py), so this is how much more than an even share of the
    batch a rank's activations hold."""
    real = int(batch.lengths.sum())
    return int(batch.local_tokens) * batch.ulysses * batch.ring / real if real else 1.0


def predict(batches: Sequence[Tensor], option: Option, gpus_per_node: int, call: CallShape,
            kernel: str, table: KernelTable, links: Links, host: HostRecord | None = None,
            one_gpu_s: float = 0.0) -> Prediction:
    """``option``'s prediction: the slowest rank of each batch, averaged over ``batches``, with the
    kernel times of ``table`` (:func:`measurements.kernel_table`); ``one_gpu_s``: one GPU's time
    for the batches (the mean :class:`OneGpuCall` seconds), which its efficiency divides."""
    slowest, means, balances = zip(*(predict_batch(b, option, gpus_per_node, call, kernel, table, links, host)
                                     for b in batches))

    def average(values: Sequence[float]) -> float:
        return sum(values) / len(values)

    groups = head_groups(rank_kv_heads(call.heads_kv, option.ulysses), option.ulysses)
    return Prediction(
        option, kernel, groups, ring_link(option.ulysses, option.ring, gpus_per_node),
        average([p.step for p in slowest]), average([p.compute for p in slowest]), average(means),
        average([p.exposed_all_to_all for p in slowest]), average([p.exposed_ring for p in slowest]),
        average([p.all_to_all_bytes for p in slowest]), average([p.ring_bytes for p in slowest]),
        average([p.host for p in slowest]), average([p.host_wait for p in slowest]),
        average([p.passes for p in slowest]), one_gpu_s, average(balances),
    )


def cuda_kernel(table: KernelTable, windowed: bool = False, by_position: bool = True) -> str:
    """The kernel ``kernel="auto"`` takes under CP by ``table``'s measurements (the runtime's
    own where they are its stored ones) with every measured kernel installed: the best mean over
    the unwindowed compositions (docs/design.md §8.2); under a window the best measured on the
    windowed composition, among the kernels that mask a window by positions in the document
    where the mesh's ring steps need that (``by_position``: a ring of several ranks,
    ``layout.window_by_position``; ``Kernel.masks_by_position``)."""
    rates = table.throughputs(measured.WINDOW if windowed else None)
    able = {name: value for name, value in rates.items()
            if not (windowed and by_position) or (name in KERNELS and KERNELS[name].masks_by_position)}
    if not able:
        raise InputError(f"window: no kernel measured on {table.device_kind!r} ({table.source}) masks a window "
                         f"by positions in the document, as ring steps need; run `{MEASURE} --window N` on that GPU")
    return max(able, key=able.__getitem__)


def advise(batches: Tensor | Sequence[Tensor], *, world: int, gpus_per_node: int, heads_q: int,
           heads_kv: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
           placements: Sequence[str] = tuple(PLACEMENTS), kernel: str = "auto",
           device_kind: str = DEFAULT_DEVICE, links: Links = Links(), mode: str = "hcp-eager",
           window: int = -1, cache_dir: Path | None = None) -> Advice:
    """Predict every valid mesh and placement (:func:`mesh_options`) on ``batches`` (one
    global int32 ``cu_seqlens`` or a sample of them) and rank them, fastest first:
    ``advice.best`` has ``ulysses``, ``ring`` and ``placement`` for ``make_mesh`` and
    ``shard_plan``. ``kernel="auto"``: the one CP's auto takes on ``device_kind``. ``mode``:
    whose host times (hcp_advise/host_measured.json) bound each rank's step; where none were
    measured that part is 0 and ``advice.host_modelled`` False.
    ``window``: a causal sliding window of that many keys back (-1: none), which limits every
    block's pairs and picks the windowed throughputs; the host part is that of calls without
    one. The kernel times: what ``python -m hcp_advise --measure`` stored for ``device_kind`` in
    ``cache_dir`` (None: :func:`measurements.cache_dir`), else the runtime's measured.json; with
    neither an :class:`InputError` says what to run. Predictions closer than the model's measured
    error (``advice.model_error``) are a tie."""
    started = time.perf_counter()
    batches = [batches] if isinstance(batches, Tensor) else list(batches)
    if not batches:
        raise InputError("batches: expected a cu_seqlens tensor or a non-empty list of them")
    for i, cu in enumerate(batches):
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 \
                or bool((cu[1:] < cu[:-1]).any()):
            raise InputError(f"batches[{i}]: expected a 1-D cu_seqlens starting at 0, "
                             "non-decreasing, with at least one document; pass the global "
                             "cumulative document lengths")
    _check_positive(head_dim=head_dim)
    if isinstance(window, bool) or not isinstance(window, int) or window < -1:
        raise InputError(f"window: expected the keys a query sees back (an int >= 0), or -1 for none; got {window!r}")
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"dtype: expected a torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    if mode not in host_measured.MODES:
        raise InputError(f"mode: expected one of {host_measured.MODES} (the modes whose host work the "
                         f"advisor counts), got {mode!r}")
    table = kernel_table(device_kind, cache_dir)
    call = CallShape(heads_q, heads_kv, head_dim, dtype, window=window)
    options = mesh_options(world, gpus_per_node, heads_q, heads_kv, placements)
    if not options:
        raise InputError(f"world: no ulysses x ring = {world} has a Ulysses group inside a node "
                         f"of {gpus_per_node} GPUs that splits {heads_q}/{heads_kv} heads")
    left_out = [(a, world // a, reason) for a in splits(world)
                if (reason := split_refusal(a, gpus_per_node, heads_q, heads_kv)) is not None]

    def by_position(option: Option) -> bool:
        return window_by_position((window, 0) if window >= 0 else (-1, -1), option.ring)

    if kernel != "auto" and kernel in KERNELS and not KERNELS[kernel].masks_by_position:
        unable = sorted({(o.ulysses, o.ring) for o in options if by_position(o)})
        options = [o for o in options if not by_position(o)]  # the meshes that can run it
        if not options:
            raise InputError(f"kernel: {kernel!r} cannot mask a window by positions in the document, as ring "
                             "steps under a window need; pass kernel='auto' or one that can (flex)")
        left_out += [(a, r, f"kernel {kernel!r} cannot mask the window by positions in the document, "
                            f"as a ring of {r} ranks needs") for a, r in unable]
    kernels = {o: cuda_kernel(table, window >= 0, by_position(o)) if kernel == "auto" else kernel for o in options}
    hosts = {k: host_measured.find(device_kind, mode, k) for k in set(kernels.values())}
    # one GPU runs no ring: the kernel auto takes there (by_position False), or the one given
    one_gpu_kernel = cuda_kernel(table, window >= 0, False) if kernel == "auto" else kernel
    one_gpu = tuple(one_gpu_call(b, call, one_gpu_kernel, table) for b in batches)
    one_gpu_s = sum(c.seconds for c in one_gpu) / len(one_gpu)
    predictions = sorted(
        (predict(batches, o, gpus_per_node, call, kernels[o], table, links, hosts[kernels[o]], one_gpu_s)
         for o in options),
        key=lambda p: (p.step_s, p.exposed_s),
    )
    return Advice(tuple(predictions), device_kind, len(batches), time.perf_counter() - started, mode,
                  all(h is not None for h in hosts.values()), table.source,
                  MODEL_ERROR_WINDOW if window >= 0 else MODEL_ERROR, tuple(sorted(left_out)), one_gpu)
