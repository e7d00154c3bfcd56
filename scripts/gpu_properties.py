"""GPU property suite: random packed batches through every kernel and every context-parallel
mode, against an fp32 per-document reference.

    python -m scripts.gpu_properties                         # one H200: 5 minutes, seed 0
    python -m scripts.gpu_properties --minutes 8 --seed 3
    python -m scripts.gpu_properties --replay '<a reproducer line's JSON>'
    python -m scripts.gpu_properties --kernels cudnn --minutes 3   # one kernel, on cases it claims
    python -m scripts.gpu_properties --device cpu --minutes 1   # the harness on CPU (fp32, bf16)

Each case is a random batch: document lengths from a mixture of 0- and 1-token documents
(alone, they make batches whose longest document has 1 token), tiny (2-16) and short ones
(17-255: around flex's 128-row mask blocks), lengths on both sides (-1, 0, +1) of every
threshold of the code (flex's mask blocks, the dense kernel's STRIPE_ROWS, MIN_DENSE_ROWS and
its first size-grid steps, the balanced placement's ring-hides-transfers length, each also
times 2R under CP, where a ring document is cut into 2R chunks; and the balanced placement's
"short" bound, 1/8 of a rank's tokens), medium (256-4096) and long ones; GQA ratios 1, 2, 4
and 8 (Hkv from 1, so Hkv < ulysses too), head dims 64, 96, 128 and 256, bf16 and fp16,
causal, full and windowed masks, the default or an explicit softmax scale.
Every case runs forward and backward (``dout`` random) through:

- phase ``single`` (one process): ``torch.ops.hcp.varlen_attention`` with every kernel of
  ``hcp_compile.kernels.KERNELS`` that claims the case (``supports``; the others count as
  "not claimed"; the O(T^2)-memory torch kernel only up to ``torch_max_tokens``, else
  "skipped"), and the public ``hcp_compile.varlen_attention`` (kernel "auto");
- phases ``2x1``, ``1x2`` and ``2x2`` (ulysses x ring; 2, 2 and 4 processes sharing the one GPU
  over gloo): context parallelism with a kernel drawn among those that claim the case under
  CP, for each placement of ``hcp_compile.batch.placements.PLACEMENTS``, eagerly
  (``context_parallel``) and compiled (``torch.compile(backend=hcp_compile.backend(...))``,
  Inductor on CUDA; one compiled module per static configuration, the batch's sizes
  dynamic, so later batches of a configuration reuse its graph: configurations are drawn
  again from earlier cases with ``REUSE_PROBABILITY``).

The bound (per tensor: out, dq, dk, dv; max abs error against the reference, computed in fp32
from the same bf16/fp16 inputs, in float64 for fp32 inputs):

    error <= ERROR_FACTOR * baseline_error + FLOOR_ULPS * eps(dtype) * max(max |reference|, 1)

``baseline_error`` is what torch's own SDPA makes on the same data in the same dtype (per
document, those of one length as one batch; flash where it runs, the memory-efficient kernel
under a window's mask; KV heads repeated, their gradients summed in fp32 as flash does),
against the same reference. ERROR_FACTOR = 4: the ring merges fp32 partial results of
low-precision blocks, which measured up to 1.7x single-device error on the H200 (docs/benchmarks.md, GPU
check), and both sides are maxima over many elements; a real bug (a key too many or too few,
a wrong merge or scale) shows as errors of many ulps. The floor, one ulp at the larger of the
tensor's magnitude and the inputs' (1), keeps the bound meaningful where SDPA happens to be
exact (1-token documents: out = v, dq = 0, which the kernels compute from sums in another
order) or nearly so (tiny batches, fp32 on CPU). The baseline error enters at most
BASELINE_MAX_ULPS ulps: a baseline beyond that is itself reported as a failure (the reference
or torch is off, and the bound would be meaningless).

Also checked: no NaN/Inf in any result, and (under CP) pad rows give output and gradients
exactly 0, with 7 written into the pads of the inputs and of ``dout``.

A failure prints a reproducer (the check's JSON: lengths, heads, head dim, dtype, causal,
window, scale, phase = mesh, placement, mode, kernel, seed and case index, which seed the
data) as a ``--replay`` command line. A world that hangs or dies is killed, the check in
flight recorded as failed, and the phase goes on from the next check in a new world.

Compiles take most of a short budget: flex's graphs per configuration and first row shapes,
Inductor's per CP configuration and placement (25-50 s for a new one on the H200, its ranks
compiling at once); so do gloo's host-staged exchanges of large batches. Each phase gets an
equal share of ``--minutes`` (a case started in time runs to its end); more minutes, or other
seeds, cover more.

Prints per phase the cases (batches) and checks run, passed, failed, not claimed, skipped,
the worst error / bound per phase, mode and kernel, and every failure; writes the same to
``$OUT/gpu_properties.txt`` and ``$OUT/gpu_properties.json`` when ``OUT`` is set; exits 1 on
any failure. ``--device cpu`` runs the same phases on tiny batches (fp32 and bf16; kernels
torch, dense and flex; inner compiler aot_eager): what ``tests/test_gpu_properties.py``
checks the harness with.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import logging
import math
import multiprocessing
import os
import random
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import Tensor, nn

import hcp_compile
from hcp_compile.batch.layout import window_by_position
from hcp_compile.batch.placements import PLACEMENTS
from hcp_compile.batch.placements.balanced import DEFAULT_COST
from hcp_compile.compiled.backend import INNER_COMPILERS
from hcp_compile.kernels import KERNELS, BlockRequest, dense, flex_mask
from examples._common import DTYPES, GRADIENTS, PAD_FILL, PackedBatch, Result, free_port, under_torchrun

# phase -> (ulysses, ring); "single" runs the kernels on one device, the others CP
PHASES: dict[str, tuple[int, int]] = {"single": (1, 1), "2x1": (2, 1), "1x2": (1, 2), "2x2": (2, 2)}
ERROR_FACTOR = 4.0
FLOOR_ULPS = 1.0
BASELINE_MAX_ULPS = 16.0
# the fault --inject-fault adds to one element of every hcp result's dk: far above any bound
FAULT_ULPS = 1000.0
# chance that a case takes the static configuration (heads, head dim, dtype, mask, scale,
# CP kernel) of an earlier case of its phase: compiled graphs and flex's and cuDNN's
# per-configuration builds then serve several batches, and more cases fit in the budget
REUSE_PROBABILITY = {"single": 0.8, "cp": 0.8}
# with --kernels: configurations drawn per case until one of the kernels claims one
CLAIM_ATTEMPTS = 100
ABORT_EXIT = 3  # a rank's exit code after an exception in a run: its world cannot go on
COLLECTIVE_TIMEOUT_S = 120  # gloo's timeout: longer than rank 0's reference of one case
PEER_GRACE_S = 5  # after one rank of a world ended badly, the others are killed
PHASE_GRACE_S = 120  # how long a phase's last case may run past the phase's share of the budget
FINAL_GRACE_S = 150  # ... and past the whole budget
RECOMPILE_LIMIT = 64  # Dynamo: one compiled attention code object serves every configuration


# --------------------------------------------------------------------------- what is drawn


@dataclass(frozen=True)
class Profile:
    """What a device's cases are drawn from."""

    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    ratios: tuple[int, ...]  # Hq / Hkv
    max_heads_q: int
    max_tokens: dict[str, int]  # per phase kind ("single", "cp")
    max_elements: dict[str, int]  # tokens * Hq * head dim, per phase kind
    min_tokens: int
    max_docs: int
    components: tuple[str, ...]  # of LENGTH_COMPONENTS
    short_max: int
    window_sides: tuple[int, ...]
    torch_max_tokens: int  # the torch kernel materializes heads x 1024 x keys scores
    chunk_elements: int  # reference and baseline: query rows per chunk x keys x heads


PROFILES = {
    "cuda": Profile(
        dtypes=("bfloat16", "float16"), head_dims=(64, 96, 128, 256), kv_heads=(1, 2, 4, 8),
        ratios=(1, 2, 4, 8), max_heads_q=32, max_tokens={"single": 65536, "cp": 32768},
        max_elements={"single": 1 << 28, "cp": 1 << 25}, min_tokens=16, max_docs=256,
        components=("empty", "tiny", "short", "edge", "medium", "long"), short_max=255,
        window_sides=(0, 1, 7, 64, 127, 128, 129, 1000, 2048, 4096), torch_max_tokens=16384,
        chunk_elements=1 << 28,
    ),
    "cpu": Profile(
        dtypes=("float32", "bfloat16"), head_dims=(8, 16), kv_heads=(1, 2), ratios=(1, 2, 4),
        max_heads_q=8, max_tokens={"single": 96, "cp": 96}, max_elements={"single": 1 << 14, "cp": 1 << 14},
        min_tokens=4, max_docs=12, components=("empty", "tiny", "short"), short_max=40,
        window_sides=(0, 1, 2, 5, 9), torch_max_tokens=1 << 20, chunk_elements=1 << 22,
    ),
}


@dataclass(frozen=True)
class AttentionArgs:
    """The attention arguments besides the batch."""

    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str
    causal: bool
    window: tuple[int, int]
    scale: float | None  # softmax_scale (None: 1 / sqrt(head_dim))


@dataclass(frozen=True)
class Config(AttentionArgs):
    """A case's static configuration: what a compiled graph or a kernel build is made for."""

    kernel: str = ""  # the CP kernel ("" in phase single, which runs them all)


@dataclass(frozen=True, kw_only=True)
class Case(AttentionArgs):
    """One random batch and its attention arguments."""

    phase: str
    seed: int
    index: int
    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.scale is None else self.scale

    @property
    def data_seed(self) -> int:
        """Seeds q, k, v and dout: the same tensors in every process and in a replay."""
        return zlib.crc32(f"{self.seed}/{self.phase}/{self.index}".encode())

    def describe(self) -> str:
        mask = ("causal" if self.causal else "full") + (f" window {self.window}" if self.window != (-1, -1) else "")
        scale = "" if self.scale is None else f" scale {self.scale:.4g}"
        return (f"{self.tokens} tokens in {len(self.lengths)} docs (longest {max(self.lengths)}), "
                f"heads {self.heads_q}/{self.heads_kv} x {self.head_dim}, {self.dtype}, {mask}{scale}")


@dataclass(frozen=True)
class Run:
    """One way of running a case: ``mode`` "baseline" (torch's SDPA: the bound's input, itself
    checked against the reference), "kernel" (phase single), "eager" or "compiled" (CP)."""

    mode: str
    kernel: str
    placement: str = ""

    @property
    def label(self) -> str:
        return " ".join(x for x in (self.mode, self.kernel, self.placement) if x)


@dataclass(frozen=True)
class Check:
    """A case and one run of it: what a reproducer names."""

    case: Case
    run: Run

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self.case), **dataclasses.asdict(self.run)},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Check":
        fields = json.loads(text)
        fields["lengths"], fields["window"] = tuple(fields["lengths"]), tuple(fields["window"])
        run = Run(*(fields.pop(f.name) for f in dataclasses.fields(Run)))
        return cls(Case(**fields), run)

    def command(self, device: str) -> str:
        device_arg = "" if device == "cuda" else f" --device {device}"
        return f"python -m scripts.gpu_properties{device_arg} --replay '{self.to_json()}'"


def phase_kind(phase: str) -> str:
    return "single" if phase == "single" else "cp"


def kernel_request(config: Config | Case, device: str, ring: int) -> BlockRequest:
    """What a call of ``config`` asks of a kernel under a ring of ``ring`` ranks (1: a single
    device or a mesh without a ring)."""
    return BlockRequest(torch.device(device), DTYPES[config.dtype], config.head_dim, config.heads_q,
                        config.heads_kv, config.window, window_by_position(config.window, ring))


def claim(kernel: str, config: Config | Case, device: str, ring: int) -> str | None:
    """None when ``kernel`` claims the case under a ring of ``ring`` ranks, else its reason
    ("auto" claims everything)."""
    if kernel == "auto":
        return None
    return KERNELS[kernel].supports(kernel_request(config, device, ring))


def draw(seed: int, phase: str, index: int, device: str, kernels: tuple[str, ...] = ()) -> tuple[Case, list[Run]]:
    """Case ``index`` of ``phase`` and its runs; the same in every process. ``kernels``: only
    these (and cases one of them claims); empty: every kernel."""
    profile = PROFILES[device]
    ulysses, ring = PHASES[phase]
    config = _config(seed, phase, index, device, kernels)
    kind = phase_kind(phase)
    max_tokens = min(profile.max_tokens[kind], profile.max_elements[kind] // (config.heads_q * config.head_dim))
    if config.kernel == "torch":
        max_tokens = min(max_tokens, profile.torch_max_tokens)
    rng = random.Random(f"{seed}/{phase}/{index}/lengths")
    lengths = draw_lengths(rng, profile, ulysses, ring, max_tokens)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(AttentionArgs)}
    case = Case(phase=phase, seed=seed, index=index, lengths=tuple(lengths), **fields)
    if kind == "single":
        runs = [Run("kernel", name) for name in (*KERNELS, "auto") if not kernels or name in kernels]
    else:
        runs = [Run(mode, config.kernel, placement)
                for placement in PLACEMENTS for mode in ("eager", "compiled")]
    return case, [Run("baseline", "sdpa"), *runs]


@functools.cache
def _config(seed: int, phase: str, index: int, device: str, kernels: tuple[str, ...] = ()) -> Config:
    """A fresh configuration, or (``REUSE_PROBABILITY``) that of an earlier case. With
    ``kernels``, configurations none of them claims are drawn again (up to ``CLAIM_ATTEMPTS``
    times), and under CP the kernel is drawn among them."""
    rng = random.Random(f"{seed}/{phase}/{index}/config")
    if index > 0 and rng.random() < REUSE_PROBABILITY[phase_kind(phase)]:
        return _config(seed, phase, rng.randrange(index), device, kernels)
    cp = phase != "single"
    for attempt in range(CLAIM_ATTEMPTS if kernels else 1):
        # the first draw continues the case's own stream: without --kernels, a seed draws what it did before
        draws = rng if attempt == 0 else random.Random(f"{seed}/{phase}/{index}/config/{attempt}")
        config = _fresh_config(draws, phase, device)
        claiming = [k for k in (kernels or ("auto", *KERNELS)) if claim(k, config, device, PHASES[phase][1]) is None]
        if claiming:
            return config if not cp else dataclasses.replace(config, kernel=draws.choice(claiming))
    raise ValueError(f"--kernels: none of {list(kernels)} claims any of {CLAIM_ATTEMPTS} cases drawn for phase "
                     f"{phase} on {device}; name kernels that run there (e.g. torch or flex on cpu)")


def _fresh_config(rng: random.Random, phase: str, device: str) -> Config:
    profile = PROFILES[device]
    heads_q, heads_kv = _heads(rng, profile, PHASES[phase][0])
    head_dim = rng.choice(profile.head_dims)
    kind = rng.choices(("causal", "full", "causal-window", "window"), (4, 2, 3, 2))[0]
    side = lambda: rng.choice(profile.window_sides)  # noqa: E731
    if kind == "causal-window":  # a right side changes nothing under the causal mask
        window = (side(), rng.choice((-1, 0, side())))
    elif kind == "window":
        left = rng.choice((-1, side()))
        window = (left, side() if left == -1 else rng.choice((-1, side())))
    else:
        window = (-1, -1)
    scale = rng.choice((None, None, 0.5, 2.0))
    return Config(heads_q, heads_kv, head_dim, rng.choice(profile.dtypes), kind.startswith("causal"),
                  window, None if scale is None else scale * head_dim ** -0.5, "")


def _heads(rng: random.Random, profile: Profile, ulysses: int) -> tuple[int, int]:
    """(Hq, Hkv) with Hq / Hkv a ratio of the profile and Hq divisible by ``ulysses``."""
    while True:
        heads_kv, ratio = rng.choice(profile.kv_heads), rng.choice(profile.ratios)
        heads_q = heads_kv * ratio
        if heads_q <= profile.max_heads_q and heads_q % ulysses == 0:
            return heads_q, heads_kv


def code_thresholds(ring: int) -> list[int]:
    """Document lengths where the code changes behaviour: flex's mask blocks, the dense
    kernel's stripe rows, its smallest dense segment and the first steps of its size grid (the
    rows it rounds to), and the length from which the balanced placement sends a document
    round a ring of ``ring`` ranks because its transfers hide. Under CP a ring document's
    blocks have 1/2R of its rows: each threshold times 2R too."""
    grid = [dense.MIN_DENSE_ROWS, 2 * dense.MIN_DENSE_ROWS]
    grid += [dense.dense_rows(rows + 1, up=True) for rows in grid]
    edges = [flex_mask.BLOCK_SIZE * m for m in (1, 2, 3)] + [dense.STRIPE_ROWS, *grid]
    if ring > 1:
        edges.append(_ring_hides_from(ring))
        edges += [2 * ring * edge for edge in edges]
    return sorted(set(edges))


@functools.cache
def _ring_hides_from(ring: int) -> int:
    """The shortest document whose ring transfers hide under its attention (balanced.py)."""
    low, high = 1, 1 << 24
    while low < high:
        mid = (low + high) // 2
        if bool(DEFAULT_COST.ring_hides_transfers(torch.tensor([mid]), ring)):
            high = mid
        else:
            low = mid + 1
    return low


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))


# one document's length, per mixture component: (rng, profile, ring, max_tokens) -> length
LENGTH_COMPONENTS: dict[str, Callable[[random.Random, Profile, int, int], int]] = {
    "empty": lambda rng, p, ring, most: rng.choice((0, 1)),
    "tiny": lambda rng, p, ring, most: rng.randint(2, 16),
    "short": lambda rng, p, ring, most: rng.randint(17, p.short_max),
    "edge": lambda rng, p, ring, most: rng.choice(code_thresholds(ring)) + rng.choice((-1, 0, 1)),
    "medium": lambda rng, p, ring, most: _log_uniform(rng, 256, 4096),
    "long": lambda rng, p, ring, most: _log_uniform(rng, 4096, max(4096, most)),
}


def draw_lengths(rng: random.Random, profile: Profile, ulysses: int, ring: int, max_tokens: int) -> list[int]:
    """Document lengths from a random mixture of 1-3 components, up to a random total of at
    most ``max_tokens``; under CP, a quarter of the batches of short documents only (which the
    balanced placement mostly keeps whole on their ranks: nothing exchanged, the compiled
    graph without collectives), and half the others with one more document at the balanced
    placement's "short" bound (at most 1/8 of a rank's tokens) or one past it."""
    ranks = ulysses * ring
    components = profile.components
    only_short = ranks > 1 and rng.random() < 0.25
    if only_short:
        components = tuple(c for c in components if c in ("empty", "tiny", "short"))
    names = rng.sample(components, rng.randint(1, min(3, len(components))))
    weights = [rng.random() + 0.1 for _ in names]
    target = _log_uniform(rng, profile.min_tokens, max_tokens)
    lengths: list[int] = []
    for _ in range(8 * profile.max_docs):  # draws that do not fit are dropped
        if sum(lengths) >= target or len(lengths) >= profile.max_docs:
            break
        length = LENGTH_COMPONENTS[rng.choices(names, weights)[0]](rng, profile, ring, max_tokens)
        if sum(lengths) + length <= max_tokens:
            lengths.append(length)
    if ranks > 1 and not only_short and rng.random() < 0.5:
        # short <=> length * ranks * 8 <= total, total including the document itself
        per = round(1 / DEFAULT_COST.short_fraction) * ranks - 1
        edge = sum(lengths) // per + rng.choice((-1, 0, 1, 2))
        if edge > 0 and sum(lengths) + edge <= max_tokens:
            lengths.append(edge)
    if sum(lengths) == 0:
        lengths.append(1)
    rng.shuffle(lengths)
    return lengths


# --------------------------------------------------------------------------- data, reference


def make_batch(case: Case, device: torch.device) -> PackedBatch:
    """Random normal q, k, v and dout, drawn on ``device`` from the case's data seed."""
    generator = torch.Generator(device=device).manual_seed(case.data_seed)

    def normal(heads: int) -> Tensor:
        x = torch.randn(case.tokens, heads, case.head_dim, generator=generator, device=device)
        return x.to(case.torch_dtype)

    cu = torch.tensor([0, *case.lengths], dtype=torch.int64).cumsum(0).to(device, torch.int32)
    return PackedBatch(cu, max(case.lengths), normal(case.heads_q), normal(case.heads_kv),
                       normal(case.heads_kv), normal(case.heads_q))


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def document_groups(lengths: tuple[int, ...], device: torch.device) -> Iterator[tuple[int, Tensor]]:
    """``(L, rows)`` per document length ``L > 0``: ``rows [n, L]``, the packed rows of the
    ``n`` documents of that length (computed together: batches of many tiny documents)."""
    starts: dict[int, list[int]] = {}
    start = 0
    for length in lengths:
        if length:
            starts.setdefault(length, []).append(start)
        start += length
    for length, firsts in sorted(starts.items()):
        yield length, torch.tensor(firsts, device=device)[:, None] + torch.arange(length, device=device)


def row_chunks(length: int, rows_elements: int, chunk_elements: int) -> Iterator[tuple[int, int]]:
    """Query rows ``[r0, r1)`` of a document group, so that ``rows_elements`` (documents x
    heads) x query rows x keys stays within ``chunk_elements``."""
    rows = max(1, chunk_elements // (rows_elements * length))
    for start in range(0, length, rows):
        yield start, min(length, start + rows)


def visible_keys(r0: int, r1: int, length: int, case: Case) -> tuple[int, int]:
    """The key range any of the document's query rows ``r0:r1`` may see (never empty: a row
    sees itself)."""
    left, right = case.window
    low = max(0, r0 - left) if left >= 0 else 0
    high = r1 if case.causal else length
    if right >= 0:
        high = min(high, r1 + right)
    return low, high


def visible(r0: int, r1: int, k0: int, k1: int, case: Case, device: torch.device) -> Tensor:
    """``[r1 - r0, k1 - k0]`` bool: which keys each query row sees (positions in the
    document; the contract, docs/design.md §1)."""
    rows = torch.arange(r0, r1, device=device)[:, None]
    keys = torch.arange(k0, k1, device=device)[None, :]
    mask = torch.ones(r1 - r0, k1 - k0, dtype=torch.bool, device=device)
    left, right = case.window
    if case.causal:
        mask &= keys <= rows
    if left >= 0:
        mask &= keys >= rows - left
    if right >= 0:
        mask &= keys <= rows + right
    return mask


def heads_first(x: Tensor, group: int = 1) -> Tensor:
    """``[n, L, H, D]`` -> ``[n, H * group, L, D]``, each head repeated ``group`` times (GQA)."""
    return x.transpose(1, 2).repeat_interleave(group, dim=1)


def per_kv_head(x: Tensor, heads_kv: int) -> Tensor:
    """``[n, H, L, D]`` of repeated KV heads -> ``[n, L, heads_kv, D]``, the repeats summed."""
    return x.unflatten(1, (heads_kv, -1)).sum(2).transpose(1, 2)


def reference(batch: PackedBatch, case: Case, chunk_elements: int) -> Result:
    """Attention and its gradients per document, in fp32 (float64 for fp32 inputs) from the
    same inputs, with an explicit forward and backward over chunks of query rows (memory
    bounded by ``chunk_elements`` scores, whatever the document's length)."""
    acc = reference_dtype(case.torch_dtype)
    q, k, v, dout = (t.to(acc) for t in (batch.q, batch.k, batch.v, batch.dout))
    out, dq, dk, dv = (torch.zeros_like(t) for t in (q, q, k, v))
    group, scale = case.heads_q // case.heads_kv, case.softmax_scale
    for length, rows in document_groups(case.lengths, q.device):
        qd, dod = heads_first(q[rows]), heads_first(dout[rows])
        kd, vd = heads_first(k[rows], group), heads_first(v[rows], group)
        dk_rep, dv_rep = torch.zeros_like(kd), torch.zeros_like(vd)
        for r0, r1 in row_chunks(length, rows.shape[0] * case.heads_q, chunk_elements):
            k0, k1 = visible_keys(r0, r1, length, case)
            keys, values = kd[:, :, k0:k1], vd[:, :, k0:k1]
            scores = qd[:, :, r0:r1] @ keys.mT * scale
            p = torch.softmax(scores.masked_fill(~visible(r0, r1, k0, k1, case, q.device), float("-inf")), dim=-1)
            o, do = p @ values, dod[:, :, r0:r1]
            ds = p * (do @ values.mT - (do * o).sum(-1, keepdim=True))
            out[rows[:, r0:r1]] = o.transpose(1, 2)
            dq[rows[:, r0:r1]] = (ds @ keys * scale).transpose(1, 2)
            dk_rep[:, :, k0:k1] += ds.mT @ qd[:, :, r0:r1] * scale
            dv_rep[:, :, k0:k1] += p.mT @ do
        dk[rows], dv[rows] = per_kv_head(dk_rep, case.heads_kv), per_kv_head(dv_rep, case.heads_kv)
    return Result(out, dq, dk, dv)


def sdpa_baseline(batch: PackedBatch, case: Case, chunk_elements: int) -> Result:
    """Torch's own SDPA on the documents in the inputs' dtype (the error the bound is tied
    to), those of one length as one batch: whole documents with ``is_causal`` where there is
    no window, else chunks of query rows with the window's mask; KV heads repeated and their
    gradients summed in fp32, and across chunks (as flash accumulates them)."""
    out, dq = torch.zeros_like(batch.q), torch.zeros_like(batch.q)
    dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (batch.k, batch.v))
    group = case.heads_q // case.heads_kv
    windowed = case.window != (-1, -1)
    for length, rows in document_groups(case.lengths, batch.q.device):
        kd, vd = heads_first(batch.k[rows], group), heads_first(batch.v[rows], group)
        chunks = row_chunks(length, rows.shape[0] * case.heads_q, chunk_elements) if windowed else [(0, length)]
        for r0, r1 in chunks:
            k0, k1 = visible_keys(r0, r1, length, case) if windowed else (0, length)
            qc = heads_first(batch.q[rows[:, r0:r1]]).requires_grad_()
            kc, vc = (x[:, :, k0:k1].requires_grad_() for x in (kd, vd))
            mask = visible(r0, r1, k0, k1, case, qc.device) if windowed else None
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, is_causal=case.causal and not windowed,
                                               scale=case.softmax_scale)
            o.backward(heads_first(batch.dout[rows[:, r0:r1]]))
            out[rows[:, r0:r1]] = o.detach().transpose(1, 2)
            dq[rows[:, r0:r1]] = qc.grad.transpose(1, 2)
            dk[rows[:, k0:k1]] += per_kv_head(kc.grad.float(), case.heads_kv)
            dv[rows[:, k0:k1]] += per_kv_head(vc.grad.float(), case.heads_kv)
    return Result(out, dq, dk.to(case.torch_dtype), dv.to(case.torch_dtype))


# --------------------------------------------------------------------------- judging


@dataclass(frozen=True)
class Verdict:
    """How one run's out, dq, dk and dv compare with the reference."""

    errors: dict[str, float]  # max abs error
    bounds: dict[str, float]
    baseline: dict[str, float]  # SDPA's max abs error (as it enters the bound)
    problems: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def ratio(self) -> float:
        """Worst error / bound (inf for NaN/Inf)."""
        return max((self.errors[n] / self.bounds[n] if self.bounds[n] > 0 else math.inf)
                   if self.errors[n] > 0 else 0.0 for n in GRADIENTS)


def max_abs_error(actual: Tensor, expected: Tensor) -> float:
    """Max |actual - expected| in ``expected``'s dtype; inf if ``actual`` is not finite."""
    if actual.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(actual).all()):
        return math.inf
    return (actual.to(expected.dtype) - expected).abs().max().item()


def ulp_scale(expected: Tensor, dtype: torch.dtype) -> float:
    """One ulp of ``dtype`` at the larger of the tensor's magnitude and the inputs' (1)."""
    magnitude = expected.abs().max().item() if expected.numel() else 0.0
    return torch.finfo(dtype).eps * max(magnitude, 1.0)


def judge(result: Result, expected: Result, baseline: Result | None, dtype: torch.dtype) -> Verdict:
    """``result`` against the reference under the bound of the module docstring; with
    ``baseline`` None, ``result`` is the baseline, held to BASELINE_MAX_ULPS."""
    errors, bounds, base_errors, problems = {}, {}, {}, []
    for name in GRADIENTS:
        got, ref = getattr(result, name), getattr(expected, name)
        ulp = ulp_scale(ref, dtype)
        errors[name] = max_abs_error(got, ref)
        if baseline is None:
            base_errors[name], bounds[name] = errors[name], BASELINE_MAX_ULPS * ulp
        else:
            base = max_abs_error(getattr(baseline, name), ref)
            base_errors[name] = min(base, BASELINE_MAX_ULPS * ulp)  # inf/NaN too: the cap
            bounds[name] = ERROR_FACTOR * base_errors[name] + FLOOR_ULPS * ulp
        if math.isinf(errors[name]):
            problems.append(f"{name} has NaN/Inf")
        elif errors[name] > bounds[name]:
            problems.append(f"{name} error {errors[name]:.3g} > bound {bounds[name]:.3g} "
                            f"(SDPA's error {base_errors[name]:.3g})")
    if result.pad_max != 0:
        problems.append(f"pad rows hold |value| up to {result.pad_max:.3g} (must be 0)")
    return Verdict(errors, bounds, base_errors, tuple(problems))


def inject_fault(result: Result, dtype: torch.dtype) -> Result:
    """``result`` with FAULT_ULPS ulps added to one element of dk (``--inject-fault``)."""
    dk = result.dk.clone()
    dk.view(-1)[0] += FAULT_ULPS * ulp_scale(result.dk.float(), dtype)
    return dataclasses.replace(result, dk=dk)


# --------------------------------------------------------------------------- running


def single_device(batch: PackedBatch, case: Case, kernel: str) -> Result:
    """One kernel through ``torch.ops.hcp.varlen_attention`` ("auto": the public
    ``hcp_compile.varlen_attention``), forward and backward."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v))
    cu, longest = batch.cu_seqlens, batch.max_seqlen
    if kernel == "auto":
        out = hcp_compile.varlen_attention(q, k, v, cu, cu, longest, longest, causal=case.causal,
                                           softmax_scale=case.scale, window_size=case.window)
    else:
        out, _ = torch.ops.hcp.varlen_attention(q, k, v, cu, cu, longest, longest, case.causal,
                                                case.softmax_scale, *case.window, kernel)
    out.backward(batch.dout)
    return Result(out.detach(), q.grad, k.grad, v.grad)


class Attention(nn.Module):
    """The compiled model: only the library's attention call, its arguments as constants."""

    def __init__(self, case: Case):
        super().__init__()
        self.causal, self.scale, self.window = case.causal, case.scale, case.window

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int) -> Tensor:
        return hcp_compile.varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=self.causal,
                                            softmax_scale=self.scale, window_size=self.window)


class CompiledModules:
    """One compiled :class:`Attention` per mask, scale, kernel and placement; the batch's
    token count, ``cu_seqlens`` and ``max_seqlen`` are dynamic, so one graph serves every
    batch of a configuration (a one-document batch compiles once more: Dynamo specializes a
    2-entry ``cu_seqlens``)."""

    def __init__(self, mesh, inner: str):
        self.mesh, self.inner = mesh, inner
        self._modules: dict[tuple, nn.Module] = {}

    def get(self, case: Case, run: Run) -> nn.Module:
        key = (case.causal, case.scale, case.window, run.kernel, run.placement)
        if key not in self._modules:
            backend = hcp_compile.backend(mesh=self.mesh, inner=self.inner, kernel=run.kernel,
                                          placement=run.placement)
            self._modules[key] = torch.compile(Attention(case), backend=backend, fullgraph=True)
        return self._modules[key]


def context_parallel(batch: PackedBatch, case: Case, run: Run, mesh, compiled: CompiledModules) -> Result:
    """CP attention of this rank's shards (7 in the pads of q, k, v and dout), eager or
    compiled, backward, and everything unsharded; ``pad_max``: the largest |value| of the local
    output and gradients on pad rows, over all ranks. Collective."""
    cu = batch.cu_seqlens.clone()  # a batch of its own: nothing cached for another run's plan
    plan = hcp_compile.shard_plan(cu, mesh, placement=run.placement)
    q, k, v = (plan.shard(t, PAD_FILL).requires_grad_() for t in (batch.q, batch.k, batch.v))
    if run.mode == "eager":
        with hcp_compile.context_parallel(mesh, kernel=run.kernel, placement=run.placement):
            out = Attention(case)(q, k, v, cu, batch.max_seqlen)
    else:
        for t in (q, k, v, cu):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        with torch.compiler.config.patch(dynamic_sources="L['max_seqlen']"):
            out = compiled.get(case, run)(q, k, v, cu, batch.max_seqlen)
    out.backward(plan.shard(batch.dout, PAD_FILL))
    local = (out.detach(), q.grad, k.grad, v.grad)
    pad = ~plan.valid.to(q.device).reshape(-1, 1, 1)
    pad_max = torch.stack([torch.where(pad, t, 0).float().abs().amax() for t in local]).amax()
    pad_max = torch.nan_to_num(pad_max, nan=math.inf).reshape(1)
    dist.all_reduce(pad_max, op=dist.ReduceOp.MAX)
    return Result(*(plan.unshard(t) for t in local), pad_max=pad_max.item())


# --------------------------------------------------------------------------- a phase's world


@dataclass(frozen=True)
class WorldConfig:
    """What every rank of one phase's world is told."""

    phase: str
    device: str
    seed: int
    inner: str
    deadline: float  # time.time() after which no case starts (but a world's first)
    max_cases: int | None  # cases this world may start
    start: tuple[int, int]  # (case index, run position) to start at
    out_dir: str
    port: int
    inject_fault: bool = False
    replay: str = ""  # a check's JSON: run that alone
    kernels: tuple[str, ...] = ()  # --kernels (empty: all)

    @property
    def world_size(self) -> int:
        ulysses, ring = PHASES[self.phase]
        return ulysses * ring


class Rank:
    """One rank's side of a world: draws the cases, runs them, and (rank 0) judges them and
    appends one JSON line per check to ``results.jsonl``. Before each run rank 0 writes
    ``inflight.json`` (the parent's record of a world that died in it); a rank whose run
    raises under CP writes ``error.rank<R>.json`` and exits with ABORT_EXIT, since the other
    ranks may wait in a collective that it left."""

    def __init__(self, rank: int, config: WorldConfig, mesh):
        self.rank, self.config, self.mesh = rank, config, mesh
        self.device = torch.device("cuda", 0) if config.device == "cuda" else torch.device("cpu")
        self.out = Path(config.out_dir)
        self.compiled = CompiledModules(mesh, config.inner) if mesh is not None else None
        self.profile = PROFILES[config.device]
        self.inflight: dict = {}

    # -- the loop

    def serve(self) -> None:
        for case, runs, first in self.cases():
            started = time.monotonic()
            self.mark(case, -1, runs)
            batch = self.guarded(lambda: make_batch(case, self.device))
            results = {}
            for position in range(first, len(runs)):
                self.mark(case, position, runs)
                results[position] = self.attempt(batch, case, runs[position], position)
            if self.rank == 0:
                self.judge_case(batch, case, runs, results, started)
            self.mark(case, len(runs), runs)
            del batch, results

    def cases(self) -> Iterator[tuple[Case, list[Run], int]]:
        """The cases to run and the run position to start each at; whether to go on is rank
        0's decision, broadcast (so every rank stops after the same case)."""
        if self.config.replay:
            check = Check.from_json(self.config.replay)
            yield check.case, [check.run], 0
            return
        index, position = self.config.start
        started = 0
        while self.agree(started == 0 or (
                time.time() < self.config.deadline
                and (self.config.max_cases is None or started < self.config.max_cases))):
            case, runs = draw(self.config.seed, self.config.phase, index, self.config.device, self.config.kernels)
            yield case, runs, position
            index, position, started = index + 1, 0, started + 1

    def agree(self, go: bool) -> bool:
        if self.mesh is None:
            return go
        flag = torch.tensor([int(go)])
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    # -- one run

    def attempt(self, batch: PackedBatch, case: Case, run: Run, position: int) -> Result | str | None:
        """The run's unsharded result (rank 0; None elsewhere, and for the baseline, which
        rank 0 computes when judging), or why it did not run ("not claimed: ...",
        "skipped: ...") or (phase single) what it raised ("raised: ...")."""
        if run.mode == "baseline":
            return None
        if run.mode == "kernel":
            reason = claim(run.kernel, case, self.config.device, ring=1)
            if reason is not None:
                return f"not claimed: {run.kernel} {reason}"
            if run.kernel == "torch" and case.tokens > self.profile.torch_max_tokens:
                return f"skipped: the torch kernel runs up to {self.profile.torch_max_tokens} tokens here"
            try:
                return single_device(batch, case, run.kernel)
            except Exception:  # noqa: BLE001 - a result to report; the device may still be usable
                message = traceback.format_exc()
                if not self.device_works():
                    self.abort(message)
                return "raised: " + message
        result = self.guarded(lambda: context_parallel(batch, case, run, self.mesh, self.compiled))
        return result if self.rank == 0 else None

    def guarded(self, step: Callable):
        """``step()``; an exception ends this rank's world (others may wait on it)."""
        try:
            return step()
        except Exception:  # noqa: BLE001 - reported by the parent, from the error file
            self.abort(traceback.format_exc())

    def device_works(self) -> bool:
        try:
            return torch.ones(1, device=self.device).add(1).item() == 2
        except Exception:  # noqa: BLE001 - a CUDA error that poisoned the context
            return False

    def abort(self, message: str) -> None:
        """Write this rank's error (and where it was: the check in flight) and end the world."""
        error = {"rank": self.rank, **self.inflight, "message": message}
        _write_json(self.out / f"error.rank{self.rank}.json", error)
        print(f"[{self.config.phase} #{self.inflight['index']}] rank {self.rank} raised; this world ends:\n"
              f"{message}", flush=True)
        os._exit(ABORT_EXIT)  # no teardown: a collective of the process group may never return

    # -- judging (rank 0)

    def judge_case(self, batch: PackedBatch, case: Case, runs: list[Run], results: dict, started: float) -> None:
        judging = time.monotonic()
        try:
            expected = reference(batch, case, self.profile.chunk_elements)
            baseline = sdpa_baseline(batch, case, self.profile.chunk_elements)
        except Exception:  # noqa: BLE001 - the harness failed on this case: report it
            message = traceback.format_exc()
            for position in results:
                self.record(Check(case, runs[position]), "failed", detail=message,
                            problem=f"the reference or the baseline raised {last_line(message)}")
            return
        failed = 0
        for position, result in results.items():
            check = Check(case, runs[position])
            if check.run.mode == "baseline":
                verdict = judge(baseline, expected, None, case.torch_dtype)
            elif isinstance(result, str):
                status, _, reason = result.partition(": ")
                if status == "raised":
                    self.record(check, "failed", problem=last_line(reason), detail=reason)
                    failed += 1
                else:
                    self.record(check, status.replace(" ", "_"), problem=reason)
                continue
            else:
                if self.config.inject_fault:
                    result = inject_fault(result, case.torch_dtype)
                verdict = judge(result, expected, baseline, case.torch_dtype)
            failed += not verdict.passed
            self.record(check, "passed" if verdict.passed else "failed", verdict,
                        "; ".join(verdict.problems))
        now = time.monotonic()
        print(f"[{case.phase} #{case.index}] {case.describe()}: {len(results)} runs, {failed} failed "
              f"({now - started:.1f} s, {now - judging:.1f} of them judging)", flush=True)

    def record(self, check: Check, status: str, verdict: Verdict | None = None, problem: str = "",
               detail: str = "") -> None:
        line = record_line(check, status, verdict, problem, self.config.device, detail)
        with open(self.out / "results.jsonl", "a") as file:
            file.write(json.dumps(line) + "\n")
        if status == "failed":
            print(f"FAIL [{check.case.phase} #{check.case.index} {check.run.label}] {problem}\n"
                  f"  reproduce: {check.command(self.config.device)}", flush=True)
        if self.config.replay:
            print(format_verdict(line), flush=True)

    def mark(self, case: Case, position: int, runs: list[Run]) -> None:
        """The check in flight (position -1: preparing the case; len(runs): done), which rank 0
        also writes to ``inflight.json``."""
        check = Check(case, runs[min(max(position, 0), len(runs) - 1)])
        self.inflight = {"index": case.index, "position": position, "runs": len(runs), "check": check.to_json()}
        if self.rank == 0:
            _write_json(self.out / "inflight.json", self.inflight)


def record_line(check: Check, status: str, verdict: Verdict | None, problem: str, device: str,
                detail: str = "") -> dict:
    """One check's JSON line (``detail``: a traceback, for failures that raised)."""
    line = {"phase": check.case.phase, "index": check.case.index, "mode": check.run.mode,
            "kernel": check.run.kernel, "placement": check.run.placement, "status": status,
            "problem": problem, "detail": detail or problem, "check": check.to_json(),
            "replay": check.command(device)}
    if verdict is not None:
        line.update(ratio=verdict.ratio, errors=verdict.errors, bounds=verdict.bounds,
                    baseline=verdict.baseline)
    return line


def format_verdict(line: dict) -> str:
    """A replayed check's details."""
    parts = [f"{line['status'].upper()}: {line['phase']} #{line['index']} {line['mode']} {line['kernel']} "
             f"{line['placement']}".rstrip()]
    if "errors" in line:
        rows = [[n, line["errors"][n], line["baseline"][n], line["bounds"][n]] for n in GRADIENTS]
        parts.append(tabulate(rows, headers=["tensor", "max abs error", "SDPA's error", "bound"], floatfmt=".3g"))
    if line["detail"]:
        parts.append(line["detail"])
    return "\n".join(parts)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else text


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)  # readers never see half a file


def _rank_main(rank: int, config: WorldConfig) -> None:
    """A world's process: device, process group (gloo, every rank on the one GPU), mesh."""
    torch.set_float32_matmul_precision("highest")  # the reference: no TF32
    # Inductor cannot pickle the rewritten graphs' cache keys (torch 2.11): it says so, with a
    # traceback, per rank and graph, and compiles them uncached
    logging.getLogger("torch._inductor.codecache").setLevel(logging.ERROR)
    # flex runs uncompiled on CPU (so it says, once per process), compiled on CUDA
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._dynamo.config.accumulated_recompile_limit = 8 * RECOMPILE_LIMIT
    if config.inner == "inductor":  # the ranks compile at once: share the cores
        torch._inductor.config.compile_threads = max(1, (os.cpu_count() or 1) // config.world_size)
    if config.device == "cuda":
        torch.cuda.set_device(0)
    mesh = None
    if config.phase != "single":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(config.port))
        dist.init_process_group("gloo", rank=rank, world_size=config.world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        ulysses, ring = PHASES[config.phase]
        mesh = hcp_compile.make_mesh(ulysses=ulysses, ring=ring, device_type=config.device)
    Rank(rank, config, mesh).serve()
    if mesh is not None:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the parent


def run_world(config: WorldConfig, hard_deadline: float) -> list[int | None]:
    """Start the world's ranks, wait until they end (or the deadline, or a grace period after
    one ended badly), kill what still runs; the ranks' exit codes (None: killed)."""
    context = multiprocessing.get_context("forkserver")
    # the ranks fork from a server that imported these once (seconds of CPU per process)
    context.set_forkserver_preload(["torch", "torch.distributed", "hcp_compile"])
    procs = [context.Process(target=_rank_main, args=(rank, config), name=f"hcp-props-{config.phase}-{rank}")
             for rank in range(config.world_size)]
    try:
        for proc in procs:
            proc.start()
        deadline = hard_deadline
        while time.time() < deadline and any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                deadline = min(deadline, time.time() + PEER_GRACE_S)
            time.sleep(0.1)
        return [proc.exitcode for proc in procs]
    finally:
        for proc in procs:  # each by its own handle: only the processes started here
            if proc.pid is not None and proc.exitcode is None:
                proc.kill()
            if proc.pid is not None:
                proc.join()


def world_failure(out: Path, codes: list[int | None], device: str) -> tuple[dict, tuple[int, int]]:
    """The record of the check a world died in (the first error's, else rank 0's check in
    flight), and where a new world goes on."""
    errors = [json.loads(p.read_text()) for p in sorted(out.glob("error.rank*.json"))]
    for path in out.glob("error.rank*.json"):
        path.unlink()
    inflight = min(errors, key=lambda e: (e["index"], e["position"])) if errors else (
        json.loads((out / "inflight.json").read_text()))
    check = Check.from_json(inflight["check"])
    index, position, runs = inflight["index"], inflight["position"], inflight["runs"]
    if errors:
        problem = " | ".join(f"rank {e['rank']}: {last_line(e['message'])}" for e in errors)
        detail = "\n".join(f"rank {e['rank']}:\n{e['message']}" for e in errors)
    elif None in codes:
        problem = detail = f"did not finish before its phase's deadline (a hang?); exit codes {codes}"
    elif position == runs:
        problem = detail = f"the world died after case {index}; exit codes {codes}"
    else:
        problem = detail = f"the world died; exit codes {codes}"
    line = record_line(check, "failed", None, problem, device, detail)
    if position < 0:
        line["mode"] = "prepare"
    resume = (index, position + 1) if 0 <= position < runs - 1 else (index + 1, 0)
    return line, resume


def run_phase(phase: str, args: argparse.Namespace, soft_deadline: float, hard_deadline: float) -> list[dict]:
    """Every record of one phase: worlds started until its cases end by deadline or count;
    after a world died, a new one goes on from the next check."""
    lines: list[dict] = []
    start = (0, 0)
    with tempfile.TemporaryDirectory(prefix=f"hcp_props_{phase}_") as tmp:
        out = Path(tmp)
        while True:
            # a case resumed after its first runs is started again in the new world
            done = len({line["index"] for line in lines}) - (start[1] > 0)
            config = WorldConfig(phase, args.device, args.seed, args.inner, soft_deadline,
                                 None if args.cases is None else args.cases - done, start, tmp,
                                 free_port(), args.inject_fault, args.replay, args.kernels)
            codes = run_world(config, hard_deadline)
            results = out / "results.jsonl"
            lines += [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
            results.unlink(missing_ok=True)
            if all(code == 0 for code in codes):
                return lines
            if not (out / "inflight.json").exists() and not any(out.glob("error.rank*.json")):
                return lines + [{"phase": phase, "index": -1, "mode": "start", "kernel": "", "placement": "",
                                 "status": "failed", "problem": f"the world did not start; exit codes {codes}",
                                 "detail": "", "check": "", "replay": ""}]
            failure, start = world_failure(out, codes, args.device)
            print(f"FAIL [{phase} #{failure['index']} {failure['mode']} {failure['kernel']} "
                  f"{failure['placement']}] {failure['detail']}\n  reproduce: {failure['replay']}", flush=True)
            lines.append(failure)
            if args.replay or time.time() >= soft_deadline:
                return lines
            if args.cases is not None and len({line["index"] for line in lines}) >= args.cases:
                return lines


# --------------------------------------------------------------------------- the report


STATUSES = ("passed", "failed", "not_claimed", "skipped")


def summarize(lines_by_phase: dict[str, list[dict]], args: argparse.Namespace, seconds: float) -> dict:
    """Counts per phase and in total, the worst error / bound per phase, mode and kernel,
    and every failure."""
    phases = {}
    for phase, lines in lines_by_phase.items():
        counts = {status: sum(line["status"] == status for line in lines) for status in STATUSES}
        phases[phase] = {"mesh": "x".join(map(str, PHASES[phase])) if phase != "single" else "1 device",
                         "cases": len({line["index"] for line in lines if line["index"] >= 0}),
                         "checks": counts["passed"] + counts["failed"], **counts}
    worst: dict[tuple, dict] = {}
    for phase, lines in lines_by_phase.items():
        for line in lines:
            if "ratio" not in line:
                continue
            key = (phase, line["mode"], line["kernel"])
            row = worst.setdefault(key, {"phase": phase, "mode": line["mode"], "kernel": line["kernel"],
                                         "checks": 0, "worst": 0.0})
            row["checks"] += 1
            row["worst"] = max(row["worst"], line["ratio"])
    totals = {key: sum(p[key] for p in phases.values()) for key in ("cases", "checks", *STATUSES)}
    failures = [line for lines in lines_by_phase.values() for line in lines if line["status"] == "failed"]
    return {"seed": args.seed, "minutes": args.minutes, "kernels": list(args.kernels),
            "device": device_name(args.device),
            "torch": torch.__version__, "seconds": round(seconds, 1), "bound": BOUND_TEXT,
            "phases": phases, "totals": totals, "worst": list(worst.values()), "failures": failures}


BOUND_TEXT = (f"error <= {ERROR_FACTOR:g} x SDPA's error + {FLOOR_ULPS:g} ulps x max(|reference|, 1), "
              f"per tensor, max abs; SDPA's error counted up to {BASELINE_MAX_ULPS:g} ulps (the "
              f"baseline rows: SDPA itself within {BASELINE_MAX_ULPS:g} ulps of the reference)")


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def report_text(summary: dict) -> str:
    phase_rows = [[name, p["mesh"], p["cases"], p["checks"], *(p[s] for s in STATUSES)]
                  for name, p in summary["phases"].items()]
    t = summary["totals"]
    phase_rows.append(["total", "", t["cases"], t["checks"], *(t[s] for s in STATUSES)])
    worst_rows = [[w["phase"], w["mode"], w["kernel"], w["checks"], w["worst"]] for w in summary["worst"]]
    parts = [
        f"hcp_compile GPU property suite: seed {summary['seed']}, budget {summary['minutes']:g} min, "
        f"{summary['device']}, torch {summary['torch']}, {summary['seconds']:.0f} s",
        tabulate(phase_rows, headers=["phase", "mesh", "cases", "checks run", *STATUSES]),
        f"bound: {summary['bound']}",
        tabulate(worst_rows, headers=["phase", "mode", "kernel", "checks", "worst error / bound"],
                 floatfmt=".3f"),
    ]
    if summary["failures"]:
        parts.append(f"failures ({len(summary['failures'])}):\n" + "\n".join(
            f"- {f['phase']} #{f['index']} {f['mode']} {f['kernel']} {f['placement']}: {f['problem']}\n"
            f"  {f['replay']}" for f in summary["failures"]))
    parts.append(f"gpu_properties: {t['checks']} checks run in {t['cases']} cases, {t['passed']} passed, "
                 f"{t['failed']} failed, {t['not_claimed']} not claimed, {t['skipped']} skipped: "
                 + ("FAILED" if t["failed"] else "PASS"))
    return "\n\n".join(parts) + "\n"


def write_outputs(text: str, summary: dict) -> None:
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "gpu_properties.txt").write_text(text)
        Path(out_dir, "gpu_properties.json").write_text(json.dumps(summary, indent=1))
        print(f"written to {out_dir}/gpu_properties.txt and .json")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="the time budget, shared by the phases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=tuple(PROFILES), default="cuda")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {tuple(PHASES)}")
    parser.add_argument("--cases", type=int, default=None, help="at most this many cases per phase")
    parser.add_argument("--inner", choices=INNER_COMPILERS, default=None,
                        help="compiler of the rewritten graph (default: inductor on cuda, aot_eager on cpu)")
    parser.add_argument("--replay", default="", help="a reproducer's JSON: run that check alone")
    parser.add_argument("--kernels", default="",
                        help=f"comma-separated, of {('auto', *KERNELS)}: run only these, on cases one of them "
                             "claims (default: every kernel)")
    parser.add_argument("--inject-fault", action="store_true",
                        help=f"add {FAULT_ULPS:g} ulps to one element of every hcp result's dk, to see "
                             "the suite catch a wrong result (it must then fail)")
    args = parser.parse_args(argv)
    args.inner = args.inner or ("inductor" if args.device == "cuda" else "aot_eager")
    if args.replay:
        try:
            args.phases = [Check.from_json(args.replay).case.phase]
        except (ValueError, KeyError, TypeError) as exc:
            parser.error(f"--replay: expected the JSON of a reproducer line ({exc!r})")
    else:
        args.phases = args.phases.split(",")
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        parser.error(f"--phases: unknown {unknown}; choose from {tuple(PHASES)}")
    args.kernels = tuple(k for k in args.kernels.split(",") if k)
    if args.replay and args.kernels:
        parser.error("--kernels: a --replay check runs the kernel its reproducer names; pass one of them")
    unknown = [k for k in args.kernels if k not in ("auto", *KERNELS)]
    if unknown:
        parser.error(f"--kernels: unknown {unknown}; choose from {('auto', *KERNELS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if under_torchrun():
        raise SystemExit("gpu_properties starts its own processes: run it with python, not torchrun")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_properties: CUDA is not available; `--device cpu` runs the harness on CPU", file=sys.stderr)
        return 2
    if not args.replay:  # kernels that claim none of the cases fail here, not inside the worlds
        try:
            for phase in args.phases:
                draw(args.seed, phase, 0, args.device, args.kernels)
        except ValueError as exc:
            print(f"gpu_properties: {exc}", file=sys.stderr)
            return 2
    started = time.time()
    end = started + 60 * args.minutes
    lines_by_phase = {}
    for done, phase in enumerate(args.phases):
        now = time.time()
        soft = now + max(0.0, end - now) / (len(args.phases) - done)
        hard = min(soft + PHASE_GRACE_S, end + FINAL_GRACE_S)
        print(f"phase {phase}: until {max(0.0, soft - now):.0f} s from now", flush=True)
        lines_by_phase[phase] = run_phase(phase, args, soft, hard)
    summary = summarize(lines_by_phase, args, time.time() - started)
    text = report_text(summary)
    print(text, flush=True)
    write_outputs(text, summary)
    return 1 if summary["totals"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
