"""Hypothesis strategies of packed batches (a test dependency: only this module imports it).

A case's document lengths come from a mixture of 1-3 components: 0- and 1-token documents
(alone, they make batches whose longest document has 1 token), tiny (2-16) and short ones (up to
the profile's ``short_max``: around flex's 128-row mask blocks), lengths on both sides (-1, 0,
+1) of every threshold of the code (:func:`code_thresholds`), medium (256-4096) and long ones.
Under CP a quarter of the batches hold short documents only (the balanced placement keeps them
whole on their ranks: nothing exchanged, the compiled graph without collectives), and half the
others one more document at the balanced placement's "short" bound or one past it. Heads: GQA
ratios of the profile with Hkv from 1 (so Hkv < ulysses too); causal, full and windowed masks;
the default or an explicit softmax scale; the profile's dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import torch
from hypothesis import assume
from hypothesis import strategies as st

from hcp_compile.batch.placements.balanced import DEFAULT_COST
from hcp_compile.exchange.schemes import DEFAULT_SCHEME, SCHEMES
from hcp_compile.kernels import KERNELS, dense, flex_mask

from .cases import PropertyCase, claim
from .profiles import PROFILES, Profile, run_kind

MASK_KINDS = ("causal",) * 4 + ("full",) * 2 + ("causal-window",) * 3 + ("window",) * 2  # weighted
SCALES = (None, None, 0.5, 2.0)  # times 1 / sqrt(head_dim)


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
        edges.append(ring_hides_from(ring))
        edges += [2 * ring * edge for edge in edges]
    return sorted(set(edges))


@functools.cache
def ring_hides_from(ring: int) -> int:
    """The shortest document whose ring transfers hide under its attention (balanced.py)."""
    low, high = 1, 1 << 24
    while low < high:
        mid = (low + high) // 2
        if bool(DEFAULT_COST.ring_hides_transfers(torch.tensor([mid]), ring)):
            high = mid
        else:
            low = mid + 1
    return low


def log_uniform(low: int, high: int) -> st.SearchStrategy[int]:
    """Integers in ``[low, high]``, uniform in log scale (as many 300s as 3000s)."""
    return st.floats(math.log(low), math.log(high + 1), exclude_max=True).map(
        lambda x: min(high, int(math.exp(x))))


# one document's length per mixture component: (profile, ring, most tokens) -> strategy
LENGTH_COMPONENTS: dict[str, Callable[[Profile, int, int], st.SearchStrategy[int]]] = {
    "empty": lambda p, ring, most: st.sampled_from((0, 1)),
    "tiny": lambda p, ring, most: st.integers(2, 16),
    "short": lambda p, ring, most: st.integers(17, p.short_max),
    "edge": lambda p, ring, most: st.builds(lambda t, d: t + d, st.sampled_from(code_thresholds(ring)),
                                            st.sampled_from((-1, 0, 1))),
    "medium": lambda p, ring, most: log_uniform(256, 4096),
    "long": lambda p, ring, most: log_uniform(4096, max(4096, most)),
}


@st.composite
def document_lengths(draw: st.DrawFn, profile: Profile, mesh: tuple[int, int], max_tokens: int) -> tuple[int, ...]:
    """Document lengths (the module docstring's mixture), at most ``max_tokens`` in all."""
    ranks, ring = mesh[0] * mesh[1], mesh[1]
    components = profile.components
    only_short = ranks > 1 and draw(st.integers(0, 3)) == 0
    if only_short:
        components = tuple(c for c in components if c in ("empty", "tiny", "short"))
    names = draw(st.lists(st.sampled_from(components), min_size=1, max_size=3, unique=True))
    per_component = {name: LENGTH_COMPONENTS[name](profile, ring, max_tokens) for name in names}
    target = draw(log_uniform(profile.min_tokens, max_tokens))
    lengths: list[int] = []
    for _ in range(2 * profile.max_docs):  # draws that do not fit are dropped
        if sum(lengths) >= target or len(lengths) >= profile.max_docs:
            break
        length = draw(per_component[draw(st.sampled_from(names))])
        if sum(lengths) + length <= max_tokens:
            lengths.append(length)
    if ranks > 1 and not only_short and draw(st.booleans()):
        # short <=> length * ranks * 8 <= total, the total including the document itself
        per = round(1 / DEFAULT_COST.short_fraction) * ranks - 1
        edge = sum(lengths) // per + draw(st.sampled_from((-1, 0, 1, 2)))
        if edge > 0 and sum(lengths) + edge <= max_tokens:
            lengths.append(edge)
    if sum(lengths) == 0:
        lengths.append(1)
    return tuple(draw(st.permutations(lengths)))


def head_pairs(profile: Profile, ulysses: int) -> list[tuple[int, int]]:
    """(Hq, Hkv) with Hq / Hkv a ratio of the profile and Hq divisible by ``ulysses``."""
    return [(kv * ratio, kv) for kv in profile.kv_heads for ratio in profile.ratios
            if kv * ratio <= profile.max_heads_q and kv * ratio % ulysses == 0]


@st.composite
def windows(draw: st.DrawFn, profile: Profile) -> tuple[bool, tuple[int, int]]:
    """(causal, window): causal, full, causal-windowed or windowed (either side unbounded)."""
    kind = draw(st.sampled_from(MASK_KINDS))
    side = st.sampled_from(profile.window_sides)
    if kind == "causal-window":  # a right side changes nothing under the causal mask
        window = (draw(side), draw(st.sampled_from((-1, 0)) | side))
    elif kind == "window":
        left = draw(st.just(-1) | side)
        window = (left, draw(side) if left == -1 else draw(st.just(-1) | side))
    else:
        window = (-1, -1)
    return kind.startswith("causal"), window


@st.composite
def property_cases(draw: st.DrawFn, device: str, mesh: tuple[int, int], kernels: Sequence[str]) -> PropertyCase:
    """A case on ``mesh`` ((1, 1): one device) that one of ``kernels`` (names of ``KERNELS`` or
    "auto") claims, its kernel drawn among those that do."""
    profile = PROFILES[device]
    heads_q, heads_kv = draw(st.sampled_from(head_pairs(profile, mesh[0])))
    head_dim = draw(st.sampled_from(profile.head_dims))
    causal, window = draw(windows(profile))
    scale = draw(st.sampled_from(SCALES))
    dtype = draw(st.sampled_from(profile.dtypes))
    # under CP a window's layout (shard_plan's window) turns ring documents' chunks
    layout_window = mesh != (1, 1) and window[0] >= 0 and draw(st.booleans())
    scheme = draw(st.sampled_from(sorted(SCHEMES))) if mesh[1] > 1 else DEFAULT_SCHEME  # schemes differ on a ring
    args = PropertyCase((1,), heads_q, heads_kv, head_dim, dtype, causal, window,
                        None if scale is None else scale * head_dim ** -0.5, "", mesh, 0, layout_window, scheme)
    claiming = [k for k in kernels if claim(k, args, device) is None]
    assume(claiming)  # a kernel that takes none of the calls: hypothesis says so (Unsatisfiable)
    case = dataclasses.replace(args, kernel=draw(st.sampled_from(claiming)))
    return draw(batches_of(case, device))


def max_tokens(case: PropertyCase, device: str) -> int:
    """The most tokens a batch of the case's configuration may hold on ``device``."""
    profile, kind = PROFILES[device], run_kind(case.mesh)
    most = min(profile.max_tokens[kind], profile.max_elements[kind] // (case.heads_q * case.head_dim))
    return min(most, profile.torch_max_tokens) if case.kernel == "torch" else most


def batches_of(case: PropertyCase, device: str) -> st.SearchStrategy[PropertyCase]:
    """A new batch (lengths and data) of the case's configuration: under CP, later batches of a
    configuration run in the graph its first one compiled."""
    lengths = document_lengths(PROFILES[device], case.mesh, max_tokens(case, device))
    return st.builds(functools.partial(dataclasses.replace, case), lengths=lengths,
                     data_seed=st.integers(0, 2**31 - 1))


def every_kernel() -> tuple[str, ...]:
    """"auto" and every kernel of the registry."""
    return ("auto", *KERNELS)
