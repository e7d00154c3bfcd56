"""Cases run under context parallelism inside the worker processes of
``hcp_compile/testing/worlds.py``.

Every case has a stable ``id`` and a ``run(world)`` that executes on every rank and returns a
dict of CPU tensors / plain values (or raises: the harness records the exception). The
assertions live in the test modules, which rebuild the same case list with :func:`suite` and
regenerate the same seeded inputs.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import weakref
import zlib
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor

import hcp_compile as hc
from hcp_compile import hierarchical
from hcp_compile.batch import layout
from hcp_compile.batch.placements import DEFAULT_PLACEMENT, PLACEMENTS
from hcp_compile.exchange.schemes import SCHEMES
from hcp_compile.kernels import KERNELS, BlockRequest, resolve_kernel, torch_kernel
from hcp_compile.testing.worlds import World
from traffic import CollectiveTraffic

MESHES = ((1, 2), (2, 1), (2, 2), (1, 4), (4, 1))  # (ulysses, ring)
ERROR_MESH = (2, 2)
HEAD_DIM = 8


def mesh_id(mesh: tuple[int, int]) -> str:
    return f"u{mesh[0]}xr{mesh[1]}"


def cu_seqlens(lengths: tuple[int, ...]) -> Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32)


def kernels_that_run(window: tuple[int, int] = (-1, -1), *, window_by_position: bool = False,
                     device: str = "cpu", dtype: torch.dtype = torch.float32, heads: tuple[int, int] = (4, 2),
                     head_dim: int = HEAD_DIM) -> list[str]:
    """The registered kernels (``KERNELS``) whose ``supports`` takes such a call, in registry
    order: what a test meant for every kernel parametrizes over, so a new kernel is tested
    by its registry line alone."""
    request = BlockRequest(torch.device(device), dtype, head_dim, *heads, window, window_by_position)
    return [name for name, kernel in KERNELS.items() if kernel.supports(request) is None]


def auto_kernel(device: str = "cpu", dtype: torch.dtype = torch.float32, head_dim: int = HEAD_DIM) -> str:
    """The kernel ``kernel="auto"`` (every test's default) resolves an unwindowed call to."""
    return resolve_kernel("auto", BlockRequest(torch.device(device), dtype, head_dim, 4, 2))


def seeded(name: str, *shape: int, salt: int = 0) -> Tensor:
    """Deterministic fp32 standard normals, identical in every process for the same name."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + salt)
    return torch.randn(*shape, generator=generator)


# --------------------------------------------------------------------------------------------
# correctness: CP attention vs the single-device reference
# --------------------------------------------------------------------------------------------

DOC_MIXES = {
    "mixed": (0, 1, 7, 3, 13, 0, 2, 29, 0),  # empty, 1-token, odd and longer docs
    "long": (97,),  # one document spread over every rank
    "8.8": (8, 8),  # with "16.0": same shard sizes on every mesh of MESHES
    "16.0": (16, 0),
    # short documents and one long one: local, group and ring placements on a 2 x 2 mesh
    "many": (3, 2, 4, 1, 2, 3, 5, 2, 1, 3, 2, 4, 6, 2, 3, 40, 1, 2, 5, 3, 2, 4, 1, 3),
    # every document whole on one rank, with pads, on 1 x 2, 2 x 1 and 2 x 2: nothing is
    # exchanged there, so no rank issues a collective (schedule.exchanged_head_groups)
    "short": (0, 1) + (2,) * 32 + (0,),
}
MATRIX_DOCS = ("mixed", "long")
HEADS = ((4, 4), (4, 2), (4, 1))  # (Hq, Hkv): MHA, GQA, MQA (Hkv < ulysses for ulysses >= 2)
MASKS = {
    "causal": (True, (-1, -1)),
    "full": (False, (-1, -1)),
    "causal-w4.0": (True, (4, 0)),
    "full-w3.5": (False, (3, 5)),
}


@dataclass(frozen=True)
class AttentionCase:
    docs: str  # a key of DOC_MIXES
    heads_q: int
    heads_kv: int
    causal: bool
    window: tuple[int, int] = (-1, -1)
    scale: float | None = None
    head_dim: int = HEAD_DIM
    placement: str = "balanced"
    max_seqlen_k_slack: int = 0  # max_seqlen_k = max_seqlen_q + this: only a bound, not an error

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.window != (-1, -1):
            mask += f"-w{self.window[0]}.{self.window[1]}"
        scale = "" if self.scale is None else f"-scale{self.scale}"
        dim = "" if self.head_dim == HEAD_DIM else f"-d{self.head_dim}"
        placement = "" if self.placement == "balanced" else f"-{self.placement}"
        slack = f"-maxk+{self.max_seqlen_k_slack}" if self.max_seqlen_k_slack else ""
        return f"{self.docs}-h{self.heads_q}.{self.heads_kv}-{mask}{scale}{dim}{placement}{slack}"

    @property
    def lengths(self) -> tuple[int, ...]:
        return DOC_MIXES[self.docs]

    @property
    def mask_args(self) -> dict:
        return {"causal": self.causal, "window": self.window, "scale": self.scale}

    def inputs(self) -> dict[str, Tensor]:
        """Global fp32 q, k, v and the output gradient, the same in every process."""
        tokens = sum(self.lengths)
        shapes = {"q": self.heads_q, "k": self.heads_kv, "v": self.heads_kv, "dout": self.heads_q}
        return {name: seeded(f"{self.id}/{name}", tokens, heads, self.head_dim)
                for name, heads in shapes.items()}

    def run(self, world: World) -> dict:
        with hc.context_parallel(world.mesh, placement=self.placement):
            return self.attend(world, cu_seqlens(self.lengths), max(self.lengths))

    def attend(self, world: World, cu: Tensor, max_seqlen: int, measure: bool = False) -> dict:
        """Forward and backward of this case's inputs, sharded with garbage in the pads, in the
        active context; returns the local results, where the local rows come from, and, for the
        cases :func:`recompute_exchange_cases` compares, the shapes of the tensors saved for the
        backward that are not q, k, v or the output (the probe's saved-tensor hooks change what
        eager CP keeps, so the other cases run without them); with ``measure``, what the
        collectives of the forward and of the backward sent (:func:`traffic_record`)."""
        plan = hc.shard_plan(cu, world.mesh, placement=self.placement)
        x = self.inputs()
        q, k, v = (shard_with_garbage_pads(plan, x[n], f"{self.id}/{n}", world.rank).requires_grad_()
                   for n in ("q", "k", "v"))
        forward, backward = CollectiveTraffic(), CollectiveTraffic()
        probed = self.id in probed_case_ids()
        with saved_for_backward() if probed else contextlib.nullcontext([]) as saved, \
                forward if measure else contextlib.nullcontext():
            out = self.forward(q, k, v, cu, max_seqlen)
        dout = shard_with_garbage_pads(plan, x["dout"], f"{self.id}/dout", world.rank)
        with backward if measure else contextlib.nullcontext():
            self.backward(out, dout)
        measured = {"forward": traffic_record(forward, world),
                    "backward": traffic_record(backward, world)} if measure else {}
        return {
            "out": out.detach(), **self.gradients(q, k, v),
            "global_index": plan.global_index, "unsharded_out": plan.unshard(out.detach()),
            "saved_besides_inputs": saved_besides(saved, (q, k, v, out)), **measured,
        }

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int) -> Tensor:
        return hc.varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen + self.max_seqlen_k_slack,
                                   causal=self.causal, softmax_scale=self.scale, window_size=self.window)

    def backward(self, out: Tensor, dout: Tensor) -> None:
        out.backward(dout)

    def gradients(self, q: Tensor, k: Tensor, v: Tensor) -> dict[str, Tensor]:
        return {"dq": q.grad, "dk": k.grad, "dv": v.grad}


@dataclass(frozen=True)
class RetainedGraphCase(AttentionCase):
    """The backward run twice through a retained graph: eager CP keeps its exchanged tensors
    for the second (it frees them during the last), and the gradients add up to twice the
    reference's (halved here)."""

    @property
    def id(self) -> str:
        return f"retained-graph-{super().id}"

    def backward(self, out: Tensor, dout: Tensor) -> None:
        out.backward(dout, retain_graph=True)
        out.backward(dout)

    def gradients(self, q: Tensor, k: Tensor, v: Tensor) -> dict[str, Tensor]:
        return {"dq": q.grad / 2, "dk": k.grad / 2, "dv": v.grad / 2}


@dataclass(frozen=True)
class GroupReleaseCase(AttentionCase):
    """Eager CP's backward, watched: when a head group's ring backward starts, no earlier
    group's exchanged q, KV and output (the ring's inputs) may be alive any more; autograd's
    saved tensors would keep them to the end of the backward (docs/design.md §4)."""

    @property
    def id(self) -> str:
        return f"group-release-{super().id}"

    def run(self, world: World) -> dict:
        watched: list[weakref.ref] = []
        alive: list[int] = []  # per ring backward: the earlier groups' inputs still alive
        original = hierarchical.ring_backward

        def watching(dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, *rest):
            alive.append(sum(ref() is not None for ref in watched))
            watched.extend(weakref.ref(t) for t in (q, kv, out))
            return original(dout, q, kv, out, *rest)

        hierarchical.ring_backward = watching
        try:
            return {**super().run(world), "earlier_groups_alive": alive}
        finally:
            hierarchical.ring_backward = original


@dataclass(frozen=True)
class CheckpointedCase(AttentionCase):
    """The attention under activation checkpointing (non-reentrant), whose saved-tensor hooks
    must see what eager CP keeps: the backward runs the forward again, collectives included."""

    @property
    def id(self) -> str:
        return f"checkpointed-{super().id}"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int) -> Tensor:
        return torch.utils.checkpoint.checkpoint(super().forward, q, k, v, cu, max_seqlen, use_reentrant=False)


@dataclass(frozen=True)
class BackwardOnAnotherThreadCase(CheckpointedCase):
    """Checkpointed, with the backward on a thread of its own, as CUDA's autograd engine runs
    it: the layer's forward recomputed there sees no ``context_parallel`` of its thread and must
    still run as CP (the block open in the calling thread; Note [the context in a backward])."""

    @property
    def id(self) -> str:
        return f"backward-thread-{super().id}"

    def backward(self, out: Tensor, dout: Tensor) -> None:
        raised: list[BaseException] = []

        def run() -> None:
            try:
                out.backward(dout)
            except BaseException as error:  # noqa: BLE001 - re-raised on the calling thread
                raised.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if raised:
            raise raised[0]


@dataclass(frozen=True)
class ReentrantBackwardOnAnotherThreadCase(BackwardOnAnotherThreadCase):
    """As :class:`BackwardOnAnotherThreadCase` under reentrant checkpointing (transformers'
    gradient checkpointing default), whose recompute runs a nested backward there."""

    @property
    def id(self) -> str:
        return f"reentrant-{super().id}"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int) -> Tensor:
        return torch.utils.checkpoint.checkpoint(super(CheckpointedCase, self).forward, q, k, v, cu, max_seqlen,
                                                 use_reentrant=True)


@dataclass(frozen=True)
class InPlaceUpdateCase(AttentionCase):
    """Two calls in one ``context_parallel`` block: first the ``previous`` batch, then this
    case's, written into the same ``cu_seqlens`` tensor in place. Shapes and max_seqlen are
    equal, so only the tensor's version tells the batches apart (the context caches schedules
    per cu_seqlens tensor); the second result must be this case's."""

    previous: str = "8.8"

    @property
    def id(self) -> str:
        return f"in-place-from-{self.previous}-{super().id}"

    def run(self, world: World) -> dict:
        cu = cu_seqlens(DOC_MIXES[self.previous])
        longest = max(*DOC_MIXES[self.previous], *self.lengths)
        with hc.context_parallel(world.mesh, placement=self.placement):
            replace(self, docs=self.previous).attend(world, cu, longest)
            cu.copy_(cu_seqlens(self.lengths))
            return self.attend(world, cu, longest)


@dataclass(frozen=True)
class GroupPairCase(AttentionCase):
    """The same attention with the mesh given as a pair ``(ulysses_group, ring_group)`` of
    process groups (to ``shard_plan`` and ``context_parallel`` alike) instead of a DeviceMesh,
    and with the per-call agreement across ranks turned off."""

    @property
    def id(self) -> str:
        return f"group-pair-{super().id}"

    def run(self, world: World) -> dict:
        pair_world = replace(world, mesh=short_timeout_groups(world, seconds=60))
        with hc.context_parallel(pair_world.mesh, agree_across_ranks=False, placement=self.placement):
            return self.attend(pair_world, cu_seqlens(self.lengths), max(self.lengths))


@dataclass(frozen=True)
class RecomputeExchangeCase(AttentionCase):
    """The same attention with ``context_parallel(recompute_exchange=True)``: the backward
    exchanges q, KV and the output again instead of the forward saving its exchanged copies."""

    @property
    def id(self) -> str:
        return f"recompute-exchange-{super().id}"

    @property
    def default_case(self) -> AttentionCase:
        return AttentionCase(**{f.name: getattr(self, f.name) for f in fields(AttentionCase)})

    def run(self, world: World) -> dict:
        with hc.context_parallel(world.mesh, placement=self.placement, recompute_exchange=True):
            return self.attend(world, cu_seqlens(self.lengths), max(self.lengths))


def traffic_record(traffic: CollectiveTraffic, world: World) -> dict[str, int]:
    """What a :class:`CollectiveTraffic` measured on the world's two groups."""
    names = {"ulysses": world.mesh.get_group("ulysses").group_name,
             "ring": world.mesh.get_group("ring").group_name}
    return {f"{group}_{what}": getattr(traffic, what)[name]
            for group, name in names.items() for what in ("calls", "bytes")}


@dataclass(frozen=True)
class SchemeCase(AttentionCase):
    """The attention under the collective scheme ``scheme`` (optionally in bf16, and with
    ``recompute_exchange``), what its forward and its backward sent measured apart, and this
    rank's sizes under the plan (what the scheme's counts are computed from)."""

    scheme: str = "allgather"
    dtype: str = "float32"
    recompute_exchange: bool = False

    @property
    def id(self) -> str:
        recompute = "-recompute" if self.recompute_exchange else ""
        dtype = "" if self.dtype == "float32" else f"-{self.dtype}"
        return f"scheme-{self.scheme}{recompute}{dtype}-{super().id}"

    def inputs(self) -> dict[str, Tensor]:
        return {n: t.to(getattr(torch, self.dtype)) for n, t in super().inputs().items()}

    def run(self, world: World) -> dict:
        with hc.context_parallel(world.mesh, placement=self.placement, recompute_exchange=self.recompute_exchange,
                                 scheme=self.scheme):
            result = self.attend(world, cu_seqlens(self.lengths), max(self.lengths), measure=True)
        plan = hc.shard_plan(cu_seqlens(self.lengths), world.mesh, placement=self.placement)
        groups = plan.groups
        sizes = layout.rank_size_values(plan.layout, groups.ring_rank, groups.ulysses_rank)
        summary = plan.summary(self.heads_q, self.heads_kv, self.head_dim, getattr(torch, self.dtype), self.scheme)
        return {**result, "sizes": sizes.tolist(), "ulysses_rank": groups.ulysses_rank,
                "summary": summary, "document_placement": plan.document_placement}


def scheme_cases() -> list[SchemeCase]:
    """Both schemes on batches whose documents go round the ring (their traffic checked), one
    whose window skips ring steps, GQA with two head groups on 2 x 2, bf16 (the ring's sums
    travel in fp32 between its first and last hop), ``recompute_exchange``; and zigzag "8.8",
    whose tokens all go through the exchange and round the ring on every mesh of MESHES (the
    report's "max")."""
    cases = []
    for scheme in SCHEMES:
        cases += [
            SchemeCase("mixed", 4, 2, True, scheme=scheme),
            SchemeCase("many", 8, 4, True, scheme=scheme),
            SchemeCase("long", 4, 1, False, (3, 5), scheme=scheme),
            SchemeCase("long", 4, 2, True, (4, 0), scheme=scheme),
            SchemeCase("long", 4, 2, True, scheme=scheme, dtype="bfloat16"),
            SchemeCase("long", 4, 2, True, placement="zigzag", scheme=scheme, recompute_exchange=True),
            SchemeCase("8.8", 4, 2, True, placement="zigzag", scheme=scheme),
        ]
    return cases


@contextlib.contextmanager
def saved_for_backward() -> Iterator[list[Tensor]]:
    """The tensors autograd saves for the backward inside the block, in a list."""
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def saved_besides(saved: list[Tensor], owners: tuple[Tensor, ...]) -> list[tuple[int, ...]]:
    """Shapes of the saved float tensors with a head dimension (3-D: exchanged q, KV or
    outputs, not the 2-D logsumexps or 1-D tables) whose memory is not one of ``owners``'.
    All-zero tensors do not count: a partitioner computes constants such as the gradients'
    zero pad rows in the forward and saves them, which holds no exchanged data."""
    owned = {t.untyped_storage().data_ptr() for t in owners}
    return [tuple(t.shape) for t in saved
            if t.is_floating_point() and t.dim() >= 3 and bool(t.any())
            and t.untyped_storage().data_ptr() not in owned]


@dataclass(frozen=True)
class SmallQueryBlockCase(AttentionCase):
    """The same attention with the plain kernel cutting every ring step's queries into blocks
    of 3 rows, so blocks start and end inside and between the step's segments."""

    @property
    def id(self) -> str:
        return f"query-block-3-{super().id}"

    def run(self, world: World) -> dict:
        saved = torch_kernel.QUERY_BLOCK
        torch_kernel.QUERY_BLOCK = 3
        try:
            return super().run(world)
        finally:
            torch_kernel.QUERY_BLOCK = saved


def probed_case_ids() -> set[str]:
    """The cases whose saved tensors the recompute test compares."""
    cases = recompute_exchange_cases()
    return {case.id for case in cases} | {case.default_case.id for case in cases}


def recompute_exchange_cases() -> list[RecomputeExchangeCase]:
    """Each the counterpart of a case of :func:`attention_cases` (its ``default_case``)."""
    return [
        RecomputeExchangeCase("many", 4, 2, True),
        RecomputeExchangeCase("long", 4, 1, True),  # MQA: KV heads repeated on ulysses >= 2
        RecomputeExchangeCase("long", 4, 2, True, placement="zigzag"),
        RecomputeExchangeCase("mixed", 4, 2, False, (3, 5)),
        RecomputeExchangeCase("short", 4, 2, True),  # nothing exchanged on most meshes
    ]


def shard_with_garbage_pads(plan: hc.ShardPlan, x: Tensor, name: str, rank: int) -> Tensor:
    """``plan.shard(x)`` with random values at the pads (as a projection's bias would leave
    there): the pads must still not affect any real output or gradient."""
    local = plan.shard(x)
    garbage = (seeded(f"{name}/pads", *local.shape, salt=rank) * 10).to(local.dtype)
    pads = ~plan.valid.reshape(-1, *([1] * (x.dim() - 1)))
    return torch.where(pads, garbage, local)


def attention_cases() -> list[AttentionCase]:
    matrix = [
        AttentionCase(docs, hq, hkv, causal, window)
        for docs in MATRIX_DOCS
        for hq, hkv in HEADS
        for causal, window in MASKS.values()
    ]
    extras = [
        AttentionCase("long", 4, 2, True, (17, 0)),  # window reaching across zigzag chunks
        AttentionCase("mixed", 4, 1, False, (0, 0)),  # each query sees only itself
        AttentionCase("mixed", 4, 2, True, scale=0.3),
        AttentionCase("mixed", 4, 2, True, max_seqlen_k_slack=5),
        InPlaceUpdateCase("16.0", 4, 2, True),
        GroupPairCase("mixed", 4, 2, True),
        SmallQueryBlockCase("mixed", 4, 2, True, (4, 0)),
        *recompute_exchange_cases(),
        RetainedGraphCase("many", 4, 2, True),
        CheckpointedCase("many", 4, 2, True),
        BackwardOnAnotherThreadCase("many", 4, 2, True),
        ReentrantBackwardOnAnotherThreadCase("many", 4, 2, True),
        GroupReleaseCase("many", 4, 4, True),  # two head groups where A = 2 (two KV heads per rank)
        SmallQueryBlockCase("long", 4, 1, False),
        *(AttentionCase("many", 4, 2, causal, window) for causal, window in MASKS.values()),
        *(AttentionCase("short", 4, hkv, True) for hkv in (2, 1)),
        AttentionCase("short", 4, 2, False, (3, 5)),
    ]
    for placement in PLACEMENTS:  # the matrix runs the default placement; every other one here
        if placement != DEFAULT_PLACEMENT:
            extras += [
                AttentionCase("many", 4, 1, True, placement=placement),
                *(AttentionCase(docs, 4, 2, causal, window, placement=placement)
                  for docs in MATRIX_DOCS for causal, window in MASKS.values()),
                InPlaceUpdateCase("16.0", 4, 2, True, placement=placement),
            ]
    return matrix + extras


# --------------------------------------------------------------------------------------------
# what the collectives carry under each placement
# --------------------------------------------------------------------------------------------

# 64 documents of 2..5 tokens: each at most 1/8 of a rank's tokens on every mesh of MESHES
SHORT_DOCS = tuple(2 + (i * 7) % 4 for i in range(64))
LONG_DOCS = (61, 3, 50)


@dataclass(frozen=True)
class TrafficCase:
    """Forward and backward of one attention call, counting the elements every all-to-all
    sends to other ranks, per group."""

    lengths: tuple[int, ...]
    placement: str

    @property
    def id(self) -> str:
        kind = "short" if self.lengths == SHORT_DOCS else "long"
        return f"traffic-{kind}-{self.placement}"

    def run(self, world: World) -> dict:
        cu = cu_seqlens(self.lengths)
        plan = hc.shard_plan(cu, world.mesh, placement=self.placement)
        tokens = sum(self.lengths)
        q, k, v = (plan.shard(seeded(f"{self.id}/{n}", tokens, h, HEAD_DIM)).requires_grad_()
                   for n, h in (("q", 4), ("k", 2), ("v", 2)))
        with CollectiveTraffic() as traffic, hc.context_parallel(world.mesh, placement=self.placement):
            out = hc.varlen_attention(q, k, v, cu, cu, max(self.lengths), max(self.lengths), causal=True)
            out.sum().backward()
        ring, ulysses = world.mesh.get_group("ring"), world.mesh.get_group("ulysses")
        return {"ring": traffic.sent[ring.group_name], "ulysses": traffic.sent[ulysses.group_name],
                "document_placement": plan.document_placement}


def traffic_cases() -> list[TrafficCase]:
    return [TrafficCase(lengths, placement) for lengths in (SHORT_DOCS, LONG_DOCS)
            for placement in ("balanced", "zigzag")]


# --------------------------------------------------------------------------------------------
# the shard plan on a real mesh
# --------------------------------------------------------------------------------------------

PAD_VALUE = -7.0


@dataclass(frozen=True)
class PlanCase:
    lengths: tuple[int, ...]
    placement: str = "balanced"

    @property
    def id(self) -> str:
        return f"plan-{self.placement}-" + ".".join(map(str, self.lengths))

    def inputs(self) -> dict[str, Tensor]:
        tokens = sum(self.lengths)
        return {"x": seeded(f"{self.id}/x", tokens, 3), "w": seeded(f"{self.id}/w", tokens, 3)}

    def run(self, world: World) -> dict:
        plan = hc.shard_plan(cu_seqlens(self.lengths), world.mesh, placement=self.placement)
        x = self.inputs()
        local = plan.shard(x["x"], pad_value=PAD_VALUE)
        leaf = local.clone().requires_grad_()
        (plan.unshard(leaf) * x["w"]).sum().backward()
        return {
            "local_tokens": plan.local_tokens, "global_index": plan.global_index,
            "valid": plan.valid, "position_ids": plan.position_ids, "sharded": local,
            "unsharded": plan.unshard(local), "unshard_grad": leaf.grad,
        }


def plan_cases() -> list[PlanCase]:
    fixed = [*DOC_MIXES.values(), (1,), (0, 5), (3, 3, 3), (8, 8, 8, 8)]
    generator = torch.Generator().manual_seed(1234)
    random = [
        tuple(torch.randint(0, 30, (int(n),), generator=generator).tolist())
        for n in torch.randint(1, 8, (6,), generator=generator)
    ]
    return [PlanCase(lengths, placement) for lengths in fixed + random for placement in PLACEMENTS]


# --------------------------------------------------------------------------------------------
# invalid input under CP: every rank must raise, none may hang
# --------------------------------------------------------------------------------------------

ERROR_DOCS = (5, 0, 9)


class ErrorSetup:
    """Valid local shards for ``ERROR_DOCS`` (Hq=4, Hkv=2) and a call that overrides any
    argument of ``varlen_attention``."""

    def __init__(self, world: World, heads_q: int = 4, heads_kv: int = 2):
        self.world, self.rank = world, world.rank
        self.cu = cu_seqlens(ERROR_DOCS)
        self.plan = hc.shard_plan(self.cu, world.mesh)
        self.q, self.k, self.v = (self.plan.shard(t) for t in self.global_qkv(heads_q, heads_kv))
        self.longest = max(ERROR_DOCS)
        # the same documents in another order: the same local token count, another batch
        self.permuted = cu_seqlens(tuple(reversed(ERROR_DOCS)))

    @staticmethod
    def global_qkv(heads_q: int = 4, heads_kv: int = 2) -> tuple[Tensor, Tensor, Tensor]:
        """The global q, k, v the shards are cut from, the same in every process."""
        tokens, name = sum(ERROR_DOCS), f"errors-h{heads_q}.{heads_kv}"
        return tuple(seeded(f"{name}/{n}", tokens, heads, HEAD_DIM)
                     for n, heads in (("q", heads_q), ("k", heads_kv), ("v", heads_kv)))

    def attend(self, options: dict | None = None, context=None, **overrides):
        """``varlen_attention`` on the valid inputs with ``overrides``, inside ``context`` or
        a new ``context_parallel(mesh, **options)``."""
        args = {"q": self.q, "k": self.k, "v": self.v, "cu_seqlens_q": self.cu,
                "cu_seqlens_k": self.cu, "max_seqlen_q": self.longest,
                "max_seqlen_k": self.longest, "causal": True, **overrides}
        with context or hc.context_parallel(self.world.mesh, **(options or {})):
            return hc.varlen_attention(**args)


@dataclass(frozen=True)
class ErrorCase:
    """``action`` runs on every rank. Ranks in ``bad_ranks`` (all when None: a batch rule
    broken on any rank raises on every rank) must raise ``error`` with ``match`` in the
    message; the others (a rank's own input failed outside the batch rules) a RuntimeError
    naming another rank."""

    id: str
    action: Callable[[ErrorSetup], object] = field(compare=False)
    error: type[BaseException] = hc.InputError
    match: str = ""
    bad_ranks: tuple[int, ...] | None = None
    heads: tuple[int, int] = (4, 2)

    def run(self, world: World) -> dict:
        self.action(ErrorSetup(world, *self.heads))
        return {}

    def expects_own_error(self, rank: int) -> bool:
        return self.bad_ranks is None or rank in self.bad_ranks


def only_on(rank: int, bad, good):
    """``bad`` on global rank ``rank`` alone (one rank gets invalid input), ``good`` elsewhere."""
    return bad if dist.get_rank() == rank else good


def short_timeout_groups(world: World, seconds: float) -> tuple:
    """``(ulysses_group, ring_group)`` of this rank with a short collective timeout, so that a
    hang turns into a timely error. Every rank creates every group, in the same order."""
    timeout = datetime.timedelta(seconds=seconds)
    mine = {}
    for r in range(world.ring):
        ranks = [r * world.ulysses + a for a in range(world.ulysses)]
        group = dist.new_group(ranks, timeout=timeout, backend="gloo")
        if world.rank in ranks:
            mine["ulysses"] = group
    for a in range(world.ulysses):
        ranks = [r * world.ulysses + a for r in range(world.ring)]
        group = dist.new_group(ranks, timeout=timeout, backend="gloo")
        if world.rank in ranks:
            mine["ring"] = group
    return mine["ulysses"], mine["ring"]


Q_NOT_A_SHARD = "q: under context parallelism must hold this rank's token count"


def _bad_rank_after_cached_call(s: ErrorSetup):
    """A valid call first (its validation and schedule are cached), then rank 1 alone passes
    a wrongly sized q to the same context: all ranks must still raise together."""
    groups = short_timeout_groups(s.world, seconds=4)
    context = hc.context_parallel(groups)
    s.attend(context=context)
    s.attend(context=context, q=only_on(1, s.q[:-1], s.q))


def _attend_as_is(s: ErrorSetup):
    return s.attend()


# a batch rule broken on one rank: every rank raises its error (the agreed verdict names it)
ONE_BAD_RANK = ErrorCase("one-rank-q-wrong-size", lambda s: s.attend(q=only_on(1, s.q[:-1], s.q)),
                         match=Q_NOT_A_SHARD)


def error_cases() -> list[ErrorCase]:
    """For ``ERROR_MESH`` (ulysses=2, ring=2, 4 ranks)."""
    two_d = lambda s: s.cu.reshape(1, -1)  # noqa: E731
    decreasing = torch.tensor([0, 9, 5, 14], dtype=torch.int32)
    return [
        ErrorCase("cu-int64", lambda s: s.attend(cu_seqlens_q=s.cu.long(), cu_seqlens_k=s.cu.long()),
                  match="cu_seqlens_q: expected dtype torch.int32"),
        ErrorCase("cu-2d", lambda s: s.attend(cu_seqlens_q=two_d(s), cu_seqlens_k=two_d(s)),
                  match="cu_seqlens_q: expected a 1-D tensor"),
        ErrorCase("cu-not-from-0", lambda s: s.attend(cu_seqlens_q=s.cu + 1, cu_seqlens_k=s.cu + 1),
                  match="cu_seqlens_q, cu_seqlens_k: must start at 0"),
        ErrorCase("cu-decreasing", lambda s: s.attend(cu_seqlens_q=decreasing, cu_seqlens_k=decreasing),
                  match="cu_seqlens_q: must be non-decreasing"),
        ErrorCase("cu-last-entry-too-large",
                  lambda s: s.attend(cu_seqlens_q=cu_seqlens(ERROR_DOCS + (9,)),
                                     cu_seqlens_k=cu_seqlens(ERROR_DOCS + (9,))),
                  match="q, k, v: under context parallelism must hold this rank's token count"),
        ErrorCase("q-not-sharded", lambda s: s.attend(q=seeded("g", sum(ERROR_DOCS), 4, HEAD_DIM)),
                  match="got 14 tokens where this cu_seqlens sharded over ulysses=2 x ring=2"),
        ErrorCase("k-v-not-sharded", lambda s: s.attend(k=s.k[:-2], v=s.v[:-2]),
                  match="k, v: under context parallelism must hold this rank's token count"),
        ErrorCase("hq-not-divisible-by-ulysses", _attend_as_is, heads=(3, 1),
                  match="q: 3 query heads cannot be split over ulysses=2"),
        ErrorCase("hkv-neither-divides-nor-divisible", _attend_as_is, heads=(6, 3),
                  match="k: 3 key/value heads must divide or be divisible by ulysses=2"),
        ErrorCase("cu-q-differs-from-cu-k",
                  lambda s: s.attend(cu_seqlens_k=cu_seqlens((9, 0, 5))), match="cu_seqlens_k"),
        ErrorCase("max-seqlen-too-small",
                  lambda s: s.attend(max_seqlen_q=s.longest - 1, max_seqlen_k=s.longest - 1),
                  match="max_seqlen_q, max_seqlen_k: must be at least the longest document's length, got 8"),
        ErrorCase("max-seqlen-k-too-small", lambda s: s.attend(max_seqlen_k=s.longest - 1),
                  match="max_seqlen_k: must be at least the longest document's length, got 8"),
        ErrorCase("window-negative", lambda s: s.attend(window_size=(-2, 0)), match="window_size"),
        ErrorCase("window-not-a-pair", lambda s: s.attend(window_size=(3,)), match="window_size"),
        ErrorCase("kernel-unknown", lambda s: s.attend(options={"kernel": "fast"}),
                  match="kernel: expected one of"),
        ErrorCase("placement-unknown", lambda s: s.attend(options={"placement": "round"}),
                  match="placement: expected one of"),
        ErrorCase("plan-placement-differs", lambda s: s.attend(options={"placement": "zigzag"}),
                  match="placement='balanced', but the attention runs on ulysses=2 x ring=2 "
                        "with placement='zigzag'"),
        ErrorCase("one-rank-other-batch-same-token-count",
                  lambda s: s.attend(cu_seqlens_q=only_on(2, s.permuted, s.cu),
                                     cu_seqlens_k=only_on(2, s.permuted, s.cu)),
                  match="given different batches"),
        # the backward's exchanges would differ in layout and size: refused before any
        ErrorCase("one-rank-other-recompute-exchange",
                  lambda s: s.attend(options={"recompute_exchange": s.world.rank == 2}),
                  match="given different batches or options"),
        ErrorCase("kernel-flash-on-cpu", lambda s: s.attend(options={"kernel": "flash"}),
                  match="kernel='flash' needs CUDA"),
        ErrorCase("make-mesh-world-size", lambda s: hc.make_mesh(ulysses=1, ring=2, device_type="cpu"),
                  error=ValueError, match="world size is 4 but ulysses * ring = 1 * 2 = 2"),
        ErrorCase("shard-plan-cu-int64", lambda s: hc.shard_plan(s.cu.long(), s.world.mesh),
                  match="cu_seqlens: expected dtype torch.int32"),
        ErrorCase("plan-shard-token-count", lambda s: s.plan.shard(seeded("x", 13, 2)),
                  match="x: expected the global packed tensor with 14 tokens"),
        ErrorCase("one-rank-cu-int64",
                  lambda s: s.attend(cu_seqlens_q=only_on(3, s.cu.long(), s.cu)),
                  match="cu_seqlens_q: expected dtype", bad_ranks=(3,)),
        ErrorCase("one-rank-unshard-wrong-size",
                  lambda s: s.plan.unshard(only_on(1, s.q[:-1], s.q)),
                  match="x_local: expected this rank's shard", bad_ranks=(1,)),
        # last: if it hangs, the short-timeout groups it uses may be broken afterwards
        ErrorCase("one-rank-bad-after-cached-call", _bad_rank_after_cached_call, match=Q_NOT_A_SHARD),
    ]


def suite(mesh: tuple[int, int]) -> list:
    """Every case run in the world of ``mesh``, in order."""
    cases = [*attention_cases(), *scheme_cases(), *plan_cases(), *traffic_cases(), ONE_BAD_RANK]
    if mesh == ERROR_MESH:
        cases += error_cases()
    return cases
