"""Cases of the compiled path (``torch.compile`` with the ``hcp`` backend), run inside the
worker processes of ``hcp_compile/testing/worlds.py``: ``suite="compile_cases"`` once per mesh of
``COMPILE_MESHES`` (inner compiler ``aot_eager``), ``suite=INDUCTOR_SUITE`` once for the single
Inductor-compiled run.

As in ``cp_cases``, every case has a stable ``id`` and a ``run(world)`` that executes on every
rank and returns a dict of CPU tensors / plain values (or raises); the assertions live in
``test_compile.py``, which rebuilds the same cases and regenerates the same seeded inputs and
models for its float64 references.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar
from unittest import mock

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, fx, nn
from torch.nn.attention.varlen import AuxRequest, varlen_attn

import hcp_compile as hc
from hcp_compile.compiled import inserted
from hcp_compile.batch.layout import Assignment, Kind
from hcp_compile.batch.placements import DEFAULT_PLACEMENT, PLACEMENTS
from hcp_compile.exchange.schemes import DEFAULT_SCHEME, SCHEMES
from cp_cases import (
    AttentionCase, World, cu_seqlens, saved_besides, saved_for_backward, seeded,
    shard_with_garbage_pads,
)
from hcp_compile.testing.worlds import WORLD_DIR_ENV

BACKEND_MODULE = importlib.import_module("hcp_compile.compiled.backend")  # hc.backend is the function

COMPILE_MESHES = ((2, 2), (1, 4), (4, 1))  # (ulysses, ring)
RECOMPUTE_MESHES = ((2, 2), (1, 4))  # the meshes whose compiled attention cases include recompute_exchange
ERROR_MESH = (2, 2)
INDUCTOR_MESH = (2, 2)
SUITE = "compile_cases"
INDUCTOR_SUITE = "compile_cases:inductor_suite"
# whole worlds; generous: measured on 2 cores, at most about 250 s per aot_eager world and
# 100 s for the Inductor one, the cores shared with the rest of the machine
WORLD_DEADLINE_S = 600
INDUCTOR_DEADLINE_S = 600

MODEL_DIM = 16
HEAD_DIM = 8

COMPILE_DOCS = {
    "mixed": (0, 1, 7, 3, 13, 0, 2, 29, 0),  # empty, 1-token, odd and longer docs
    "mixed-permuted": (29, 0, 13, 2, 0, 1, 0, 7, 3),  # same lengths: same local token count
    "four": (5, 13, 1, 20),  # other document count, token count and longest document
    "even": (8, 8, 8, 8),
    "one-97": (97,),  # a single document
    "one-50": (50,),
    "three": (7, 13, 1),
    # every document LOCAL on the 2 x 2 and 1 x 4 meshes: nothing exchanged, so the compiled
    # attention runs the graph built without collectives (hcp_compile.compiled.graph_variants)
    "no-ring": (2,) * 32,
}

# a placement for the graph-variants case alone (registered while it runs)
HEADS_ONLY = "test-heads-only"


def heads_only(lengths: Tensor, ulysses: int, ring: int, *, window: int = -1) -> Assignment:
    """Documents of up to 2 tokens whole on one rank, those up to 20 over one Ulysses group,
    longer ones round the ring: batches of documents of 3..20 tokens then exchange heads with
    no ring section, which the balanced placement does only on batches far larger than a test
    can run (it sends coarse documents round the ring)."""
    index = torch.arange(lengths.shape[0])
    kind = torch.where(lengths > 20, int(Kind.RING), torch.where(lengths > 2, int(Kind.GROUP), int(Kind.LOCAL)))
    return Assignment(kind, index % ring, (index // ring) % ulysses)


# --------------------------------------------------------------------------------------------
# helpers: compile counting, AOT graph capture, collective counts
# --------------------------------------------------------------------------------------------

class CompileCounter:
    """A backend that counts the graphs Dynamo hands it and passes them on."""

    def __init__(self, backend: Callable):
        self.backend = backend
        self.graphs = 0

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


@contextlib.contextmanager
def capture_aot_graphs():
    """Collect the FX graphs that ``inner="aot_eager"`` hands to its forward and backward
    compilers (``boxed_nop``, looked up when the backend compiles), in compile order."""
    from torch._dynamo.backends import debugging

    captured: list[fx.GraphModule] = []
    real = debugging.boxed_nop

    def capturing_nop(gm, example_inputs):
        captured.append(gm)
        return real(gm, example_inputs)

    debugging.boxed_nop = capturing_nop
    try:
        yield captured
    finally:
        debugging.boxed_nop = real


def split_forward_backward(graphs: list[fx.GraphModule]) -> tuple[list, list]:
    """Backward graphs are those with ``tangents_*`` inputs."""
    def is_backward(gm):
        return any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)
    return [g for g in graphs if not is_backward(g)], [g for g in graphs if is_backward(g)]


C10D = torch.ops._c10d_functional
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "_c10d_functional_autograd", "_dtensor")


def _depends_on(node: fx.Node, sources: set[fx.Node]) -> bool:
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in sources:
            return True
        for parent in current.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return False


def _is_zero(split) -> bool:
    return isinstance(split, int) and split == 0


def collective_summary(gm: fx.GraphModule, ulysses_group: str, ring_group: str) -> dict:
    """Counts of the collectives in one AOT graph, by kind, with the properties the tests
    check: each followed by its wait, the split pattern of each kind, and (for backward
    graphs) whether each exchange carries something derived from the incoming gradients."""
    tangents = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    summary = {"ulysses": 0, "ring": 0, "all_reduce": 0, "unwaited": 0, "bad_splits": 0,
               "ulysses_from_tangents": 0, "ring_from_tangents": 0, "other": []}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is AGREE_ON_BATCH:
            summary["all_reduce"] += agreement_all_reduces(node.args[1:4], (ulysses_group, ring_group))
            continue
        if node.op != "call_function" or getattr(node.target, "namespace", None) not in COLLECTIVE_NAMESPACES:
            continue
        if node.target is C10D.wait_tensor.default:
            continue
        if not any(user.target is C10D.wait_tensor.default for user in node.users):
            summary["unwaited"] += 1
        if node.target is C10D.all_reduce.default:
            summary["all_reduce"] += 1
            continue
        if node.target is not C10D.all_to_all_single.default:
            summary["other"].append(str(node.target))
            continue
        _, output_splits, input_splits, group = node.args[:4]
        from_tangents = _depends_on(node, tangents)
        if group == ulysses_group:
            summary["ulysses"] += 1
            summary["ulysses_from_tangents"] += from_tangents
            # a rank sends the same count to every Ulysses rank (its heads for each) and
            # receives each rank's own count, or the other way round for the way back
            even = any(len({str(s) for s in splits}) == 1 for splits in (output_splits, input_splits))
            summary["bad_splits"] += not even
        elif group == ring_group:
            summary["ring"] += 1
            summary["ring_from_tangents"] += from_tangents
            one_send = sum(not _is_zero(s) for s in input_splits) == 1
            one_recv = sum(not _is_zero(s) for s in output_splits) == 1
            summary["bad_splits"] += not (one_send and one_recv)
        else:
            summary["other"].append(f"all_to_all_single on group {group!r}")
    return summary


def group_names(mesh) -> tuple[str | None, str | None]:
    """The names of the mesh's Ulysses and ring groups, None for a group of one rank (no
    collective runs on it)."""
    return tuple(group.group_name if group.size() > 1 else None
                 for group in (mesh.get_group("ulysses"), mesh.get_group("ring")))


# the batch check's agreement runs its all-reduces inside this op (hcp_compile/exchange/agreement.py)
AGREE_ON_BATCH = inserted.agree_on_batch._opoverload


def agreement_all_reduces(arguments: tuple, names: tuple[str | None, str | None]) -> int:
    """The all-reduces an ``hcp::agree_on_batch`` call with ``(ulysses_group, ring_group, agree)``
    runs: one per group of more than one rank (``names``), none without ``agree``."""
    ulysses_group, ring_group, agree = arguments
    return sum(name is not None and name in names for name in (ulysses_group, ring_group)) if agree else 0


def aot_summaries(captured: list[fx.GraphModule], mesh) -> dict:
    forward, backward = split_forward_backward(captured)
    names = group_names(mesh)
    return {
        "aot_graphs": (len(forward), len(backward)),
        "fw": [collective_summary(g, *names) for g in forward],
        "bw": [collective_summary(g, *names) for g in backward],
    }


def shared_dir(name: str) -> Path:
    """A folder of this world that every rank sees (the same path on every rank)."""
    folder = Path(os.environ[WORLD_DIR_ENV]) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def fresh_dynamo() -> None:
    """Every case compiles its own model: no cache entry of an earlier case may count
    against Dynamo's recompile limit (the Block classes of all cases share forward code)."""
    torch._dynamo.reset()


def error_record(exc: BaseException) -> dict:
    return {"types": [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__],
            "message": str(exc)}


# --------------------------------------------------------------------------------------------
# attention alone: compiled vs eager CP vs the float64 reference, batch after batch
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DocsCase(AttentionCase):
    """An :class:`AttentionCase` whose ``docs`` is a key of :data:`COMPILE_DOCS` (the
    reference in ``checks.expected_for`` works unchanged)."""

    @property
    def lengths(self) -> tuple[int, ...]:
        return COMPILE_DOCS[self.docs]


class VarlenAttention(nn.Module):
    """Only the library's attention call, arguments as module constants."""

    def __init__(self, causal: bool, scale: float | None, window: tuple[int, int]):
        super().__init__()
        self.causal, self.scale, self.window = causal, scale, window

    def forward(self, q, k, v, cu, max_seqlen):
        return hc.varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=self.causal,
                                   softmax_scale=self.scale, window_size=self.window)


def sharded_attention(plan: hc.ShardPlan, world: World, x: dict[str, Tensor], cu: Tensor, max_seqlen: int,
                      causal: bool, window: tuple[int, int], compiled: bool) -> dict:
    """Forward and backward of the global batch ``x`` (q, k, v, dout) on this rank's shards
    under ``plan``, eager or compiled (the hcp backend over aot_eager): the local results."""
    q, k, v = (plan.shard(x[n]).requires_grad_() for n in "qkv")
    if compiled:
        fresh_dynamo()
        model = VarlenAttention(causal, None, window)
        out = torch.compile(model, backend=hc.backend(mesh=world.mesh, inner="aot_eager"), fullgraph=True)(
            q, k, v, cu, max_seqlen)
    else:
        with hc.context_parallel(world.mesh):
            out = hc.varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=causal, window_size=window)
    out.backward(plan.shard(x["dout"]))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_attention(batch: AttentionCase, world: World, attend: Callable, cu: Tensor | None = None) -> dict:
    """Forward and backward of ``attend(q, k, v, cu, max_seqlen)`` on the batch's shards
    (garbage in the pads, as in ``cp_cases``); local results, where the rows come from, and
    the saved tensors with a head dimension that are not q, k, v or the output. ``cu``: the
    tensor to write the batch's ``cu_seqlens`` into, in place (default: a new one)."""
    cu = cu_seqlens(batch.lengths) if cu is None else cu.copy_(cu_seqlens(batch.lengths))
    plan = hc.shard_plan(cu, world.mesh, placement=batch.placement)
    x = batch.inputs()
    q, k, v = (shard_with_garbage_pads(plan, x[n], f"{batch.id}/{n}", world.rank).requires_grad_()
               for n in ("q", "k", "v"))
    with saved_for_backward() as saved:
        out = attend(q, k, v, cu, max(batch.lengths))
    out.backward(shard_with_garbage_pads(plan, x["dout"], f"{batch.id}/dout", world.rank))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "global_index": plan.global_index, "local_tokens": plan.local_tokens,
            "saved_besides_inputs": saved_besides(saved, (q, k, v, out))}


@dataclass(frozen=True)
class CompiledAttentionCase:
    """One compiled ``VarlenAttention`` fed the batches ``docs`` in turn (same module, so
    the later batches show whether the compiled graph is reused); each batch also runs
    eagerly under ``context_parallel`` for comparison."""

    name: str
    docs: tuple[str, ...]
    heads_q: int
    heads_kv: int
    causal: bool
    window: tuple[int, int] = (-1, -1)
    scale: float | None = None
    dynamic: bool | None = True
    inner: str = "aot_eager"
    eager: bool = True  # also run eager CP for comparison
    # rank 0 dumps its graphs. Inductor then bypasses its caches on rank 0, and the other
    # ranks compile as users do, through the caches, which also share each kernel's C++
    # build between them (the slowest part of an Inductor compile on 2 cores)
    dump: bool = False
    placement: str = "balanced"
    kernel: str = "auto"
    recompute_exchange: bool = False
    inductor_decompositions: bool = False  # see inductor_decompositions()
    # every batch of the first one's document count written into one cu_seqlens tensor in
    # place: the graph reads cu_seqlens to the host once per tensor and version, so only the
    # version tells these batches apart
    cu_in_place: bool = False
    scheme: str = "ring"  # the collective scheme, compiled and eager
    capture: bool = False  # record the transfers of every AOT forward graph after each batch

    @property
    def id(self) -> str:
        return f"attention-{self.name}"

    def batches(self) -> list[DocsCase]:
        return [DocsCase(docs, self.heads_q, self.heads_kv, self.causal, self.window, self.scale,
                         placement=self.placement)
                for docs in self.docs]

    def run(self, world: World) -> dict:
        with contextlib.ExitStack() as stack:
            if self.inductor_decompositions:
                stack.enter_context(inductor_decompositions())
            if self.placement == HEADS_ONLY:
                stack.enter_context(mock.patch.dict(PLACEMENTS, {HEADS_ONLY: heads_only}))
            return self._run(world)

    def _run(self, world: World) -> dict:
        fresh_dynamo()
        if self.inner == "inductor":
            torch._inductor.config.compile_threads = 1  # no compile pool per rank on 2 cores
        dump = shared_dir(f"dump-{self.id}") if self.dump and world.rank == 0 else None
        counter = CompileCounter(hc.backend(mesh=world.mesh, inner=self.inner,
                                            dump_dir=str(dump) if dump else None,
                                            placement=self.placement, kernel=self.kernel,
                                            recompute_exchange=self.recompute_exchange, scheme=self.scheme))
        module = VarlenAttention(self.causal, self.scale, self.window)
        compiled = torch.compile(module, backend=counter, dynamic=self.dynamic, fullgraph=True)
        result: dict = {"graphs_after": [], "transfers_after": []}
        cu = cu_seqlens(self.batches()[0].lengths) if self.cu_in_place else None
        captured: list[fx.GraphModule] = []
        for index, batch in enumerate(self.batches()):
            # the graph a batch runs may be compiled when it first runs (graph_variants)
            in_place = cu if cu is not None and cu.shape[0] == len(batch.lengths) + 1 else None
            with capture_aot_graphs() if self.capture else contextlib.nullcontext([]) as new:
                got = run_attention(batch, world, compiled, in_place)
            captured += new
            result["graphs_after"].append(counter.graphs)
            forward, _ = split_forward_backward(captured)
            summaries = [collective_summary(g, *group_names(world.mesh)) for g in forward]
            result["transfers_after"].append([(s["ulysses"], s["ring"]) for s in summaries])
            if self.eager:
                with hc.context_parallel(world.mesh, placement=self.placement, kernel=self.kernel,
                                         recompute_exchange=self.recompute_exchange, scheme=self.scheme):
                    eager = run_attention(batch, world, module, in_place)
                got.update({f"eager_{n}": eager[n] for n in ("out", "dq", "dk", "dv")})
            result.update({f"{index}/{n}": value for n, value in got.items()})
        if dump is not None:
            mine = dump / f"rank{world.rank}"
            result["texts"] = {str(p.relative_to(mine)): p.read_text() for p in mine.rglob("*.*")}
            result["group_names"] = group_names(world.mesh)
        return result


@contextlib.contextmanager
def inductor_decompositions() -> Iterator[None]:
    """The backend's ``aot_eager`` inner compiler with Inductor's decompositions: the joint
    graph that Inductor's partitioner cuts (where, e.g., each copy into a send buffer is a node
    of its own, which the partitioner may move into the forward: docs/design.md §4.1), without
    Inductor's code generation, which costs minutes per world on 2 cores."""
    from torch._inductor.decomposition import select_decomp_table

    plain = BACKEND_MODULE._aot_eager

    def decomposing(dump):
        compiler = plain(dump)
        compiler.kwargs["decompositions"] = select_decomp_table()
        return compiler

    with mock.patch.object(BACKEND_MODULE, "_aot_eager", decomposing):
        yield


def attention_cases(mesh: tuple[int, int]) -> list[CompiledAttentionCase]:
    """Every mesh compiles every placement, causal and full masks, a window and a scale, GQA
    and MQA or MHA, paired up in two cases: the eager suite runs every combination on every
    mesh, and a compile costs a 4-rank world tens of seconds on 2 cores. FULL_MESH also
    compiles single-document batches and Dynamo's automatic dynamic shapes."""
    full = mesh == FULL_MESH
    # dynamic=True: the same compiled graph for every batch: other documents with the same
    # local token count, then another count and document count, then single-document batches
    single = ("one-97", "one-50") if full else ()
    # dynamic=None: the first batch compiles static; on FULL_MESH the second changes the local
    # token count, the document count and max_seqlen at once (Dynamo's automatic dynamic
    # recompiles once with all of them dynamic), and no compile follows
    automatic = ("four", "mixed", "mixed-permuted", "even", "three") if full else ("mixed",)
    # MHA where it is one head group (no exchange on 1 x 4, one KV head per rank on 4 x 1),
    # as fast to compile as MQA; on 2 x 2 it makes two groups, which the model cases compile
    heads_kv, name = (1, "mqa") if full else (4, "mha")
    # the windowed case runs flex, the one kernel that caches per block (its masks): ring
    # steps under a window, batch after batch, with the cache keys read from each batch
    # recompute_exchange on FULL_MESH, where GQA 8/4 makes two head groups, each exchanged
    # again, and on 1 x 4, where there is no exchange and only the ring's KV is packed again;
    # its second batch exchanges nothing (the graph without collectives, with recompute)
    recompute = [CompiledAttentionCase("gqa-recompute-exchange", ("mixed", "no-ring"), 8, 4, True,
                                       recompute_exchange=True, inductor_decompositions=True)
                 ] if mesh in RECOMPUTE_MESHES else []
    # every scheme besides the default (the other cases') where there is a ring: GQA 8/4 makes
    # two head groups on 2 x 2
    schemes = [CompiledAttentionCase(f"gqa-{scheme}", ("mixed", "four"), 8, 4, True, (4, 0), scheme=scheme)
               for scheme in SCHEMES if scheme != DEFAULT_SCHEME and mesh[1] > 1]
    # a scheme that gathers runs its ring as one gathered step where no window asks for positions:
    # here with two head groups (tests/test_gathered_step.py: a ring of 4)
    schemes += [CompiledAttentionCase(f"gqa-{scheme}-gathered", ("mixed", "four"), 8, 4, True, scheme=scheme)
                for scheme in SCHEMES if SCHEMES[scheme].ring.gathers and mesh == (2, 2)]
    # batches that exchange nothing, heads and keys round the ring, then the first two again:
    # one Dynamo graph, and each narrower graph compiled once, on first use
    variants = [CompiledAttentionCase("gqa-graph-variants", ("no-ring", "mixed", "three", "no-ring", "three"),
                                      4, 2, True, placement=HEADS_ONLY, capture=True)] if mesh == (2, 2) else []
    return [
        *recompute,
        *schemes,
        *variants,
        CompiledAttentionCase("gqa-causal-batches", ("mixed", "mixed-permuted", "four", *single),
                              4, 2, True),
        # every placement besides the default (the other cases')
        *(CompiledAttentionCase(f"{name}-full-window-scale-{placement}-flex", automatic, 4, heads_kv, False,
                                (3, 5), 0.3, dynamic=None, placement=placement, kernel="flex")
          for placement in PLACEMENTS if placement != DEFAULT_PLACEMENT),
    ]


# --------------------------------------------------------------------------------------------
# a model of several marked attention layers: fullgraph, graphs, dumps, params' gradients
# --------------------------------------------------------------------------------------------

class Block(nn.Module):
    """Projections around the library's attention call, with a residual; subclassed per
    case (marks are class attributes, so every case marks a class of its own).
    ``sized_by_tokens``: the views name the token count read from ``x`` instead of -1."""

    sized_by_tokens = False

    def __init__(self, heads_q: int, heads_kv: int, causal: bool):
        super().__init__()
        self.heads_q, self.heads_kv, self.causal = heads_q, heads_kv, causal
        self.qkv = nn.Linear(MODEL_DIM, (heads_q + 2 * heads_kv) * HEAD_DIM)
        self.o = nn.Linear(heads_q * HEAD_DIM, MODEL_DIM)

    def forward(self, x, cu, max_seqlen):
        tokens = x.shape[0] if self.sized_by_tokens else -1
        q, k, v = self.qkv(x).split(
            [self.heads_q * HEAD_DIM, self.heads_kv * HEAD_DIM, self.heads_kv * HEAD_DIM], -1)
        q = q.reshape(tokens, self.heads_q, HEAD_DIM)
        k = k.reshape(tokens, self.heads_kv, HEAD_DIM)
        v = v.reshape(tokens, self.heads_kv, HEAD_DIM)
        out = self.attend(q, k, v, cu, max_seqlen)
        return x + self.o(out.reshape(tokens, self.heads_q * HEAD_DIM))

    def attend(self, q, k, v, cu, max_seqlen):
        return hc.varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=self.causal)


def _checkpointed_attend(self, q, k, v, cu, max_seqlen):
    return torch.utils.checkpoint.checkpoint(Block.attend, self, q, k, v, cu, max_seqlen,
                                             use_reentrant=False)


class Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x, cu, max_seqlen):
        for layer in self.layers:
            x = layer(x, cu, max_seqlen)
        return x


def fresh_class(base: type, name: str, **attributes) -> type:
    return type(name, (base,), {"__module__": __name__, **attributes})


def init_parameters(model: nn.Module, name: str) -> nn.Module:
    """Deterministic parameters, the same in every process (and in the parent's reference)."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 4
            p.copy_(seeded(f"{name}/{pname}", *p.shape) * fan_in**-0.5)
    return model


@dataclass(frozen=True)
class ModelCase:
    """``layers`` marked blocks (one marked class), compiled with ``fullgraph=True`` and a
    dump folder; the AOT graphs captured; compared with the same model under eager CP."""

    docs: str = "mixed"
    layers: int = 2  # several: one layout check for both, per-layer rows and counts
    heads_q: int = 4
    heads_kv: int = 2
    causal: bool = True
    checkpointed: bool = False  # each attention call inside torch.utils.checkpoint

    @property
    def id(self) -> str:
        suffix = "-checkpointed" if self.checkpointed else ""
        return f"model-{self.layers}-layers-{self.docs}-h{self.heads_q}.{self.heads_kv}{suffix}"

    @property
    def lengths(self) -> tuple[int, ...]:
        return COMPILE_DOCS[self.docs]

    def build(self, block_class: type) -> nn.Module:
        blocks = [block_class(self.heads_q, self.heads_kv, self.causal) for _ in range(self.layers)]
        return init_parameters(Stack(blocks), self.id)

    def inputs(self) -> dict[str, Tensor]:
        tokens = sum(self.lengths)
        return {"x": seeded(f"{self.id}/x", tokens, MODEL_DIM),
                "dout": seeded(f"{self.id}/dout", tokens, MODEL_DIM)}

    def run(self, world: World) -> dict:
        fresh_dynamo()
        attend = {"attend": _checkpointed_attend} if self.checkpointed else {}
        block = hc.attention(fresh_class(Block, "MarkedBlock", **attend))
        model = self.build(block)
        cu = cu_seqlens(self.lengths)
        plan = hc.shard_plan(cu, world.mesh)
        x = self.inputs()
        dout = plan.shard(x["dout"])  # zero at the pads: they are no part of the loss
        x_local = shard_with_garbage_pads(plan, x["x"], f"{self.id}/x", world.rank)

        def forward_backward(fn) -> dict:
            model.zero_grad()
            leaf = x_local.clone().requires_grad_()
            out = fn(leaf, cu, max(self.lengths))
            (out * dout).sum().backward()
            grads = {f"grad/{n}": p.grad.clone() for n, p in model.named_parameters()}
            return {"out": out.detach(), "dx": leaf.grad, **grads}

        with hc.context_parallel(world.mesh):
            eager = forward_backward(model)
        dump = shared_dir(f"dump-{self.id}")
        counter = CompileCounter(hc.backend(mesh=world.mesh, inner="aot_eager", dump_dir=str(dump)))
        with capture_aot_graphs() as captured:
            compiled = forward_backward(torch.compile(model, backend=counter, fullgraph=True))
        dist.barrier()  # every rank's dump is written
        mine = dump / f"rank{world.rank}" / "graph_0"
        return {
            **compiled,
            **{f"eager_{n}": t for n, t in eager.items()},
            "unsharded_out": plan.unshard(compiled["out"]),
            "global_index": plan.global_index,
            "graphs": counter.graphs,
            **aot_summaries(captured, world.mesh),
            "dumped": sorted(str(p.relative_to(dump)) for p in dump.rglob("*") if p.is_file()),
            "texts": {p.name: p.read_text() for p in mine.glob("*")},
            "group_names": group_names(world.mesh),
        }


class ShapedBlock(Block):
    """:class:`Block` that sizes its views by the token count it reads from ``x``."""

    sized_by_tokens = True


@dataclass(frozen=True)
class ModelStreamCase(ModelCase):
    """One compiled model (``dynamic=None``) through batches that exchange keys round the
    ring and nothing: the second batch recompiles with dynamic sizes, and the graph for
    batches that exchange nothing is compiled on its first use, a call after Dynamo's compile
    has returned (hcp_compile.compiled.graph_variants); the blocks size their views by the token count
    (:class:`ShapedBlock`), which relates the attention's output to the input's sizes. Each
    batch's output and input gradient, and every warning the run gave."""

    layers: int = 1
    stream: tuple[str, ...] = ("mixed", "four", "no-ring", "mixed")

    @property
    def id(self) -> str:
        return "model-stream-" + "-".join(self.stream)

    def batch_inputs(self, docs: str) -> dict[str, Tensor]:
        tokens = sum(COMPILE_DOCS[docs])
        return {"x": seeded(f"{self.id}/{docs}/x", tokens, MODEL_DIM),
                "dout": seeded(f"{self.id}/{docs}/dout", tokens, MODEL_DIM)}

    def run(self, world: World) -> dict:
        fresh_dynamo()
        model = self.build(hc.attention(fresh_class(ShapedBlock, "StreamBlock")))
        compiled = torch.compile(model, backend=hc.backend(mesh=world.mesh, inner="aot_eager"), fullgraph=True)
        result = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for index, docs in enumerate(self.stream):
                lengths = COMPILE_DOCS[docs]
                cu = cu_seqlens(lengths)
                plan = hc.shard_plan(cu, world.mesh)
                x = self.batch_inputs(docs)
                leaf = shard_with_garbage_pads(plan, x["x"], f"{self.id}/{docs}/x", world.rank).requires_grad_()
                out = compiled(leaf, cu, max(lengths))
                (out * plan.shard(x["dout"])).sum().backward()
                result.update({f"{index}/out": out.detach(), f"{index}/dx": leaf.grad,
                               f"{index}/global_index": plan.global_index})
        result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        return result


# --------------------------------------------------------------------------------------------
# a model written against torch's own varlen_attn (no hcp call in it), the lse used
# --------------------------------------------------------------------------------------------

class TorchVarlenAttention(nn.Module):
    """Plain PyTorch: ``torch.nn.attention.varlen.varlen_attn`` (which has no CPU kernel),
    returning the output and the logsumexp."""

    def __init__(self, window: tuple[int, int] = (-1, 0), scale: float | None = None):
        super().__init__()
        self.window, self.scale = window, scale

    def forward(self, q, k, v, cu, max_seqlen):
        return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, return_aux=AuxRequest(lse=True),
                           scale=self.scale, window_size=self.window, enable_gqa=True)


@dataclass(frozen=True)
class TorchVarlenCase:
    """Compiled with ``backend="hcp"`` (the entry point), ``options={"mesh", "inner"}``.
    varlen_attn's ``window_size=(-1, 0)`` is causal; ``(W, 0)`` a causal sliding window."""

    docs: str = "mixed"
    heads_q: int = 4
    heads_kv: int = 2
    window: tuple[int, int] = (-1, 0)
    scale: float | None = None

    @property
    def id(self) -> str:
        return f"torch-varlen-{self.docs}-h{self.heads_q}.{self.heads_kv}-w{self.window[0]}.{self.window[1]}"

    def reference_case(self) -> DocsCase:
        """The same attention in ``varlen_attention``'s terms (for the float64 reference)."""
        causal = self.window[1] == 0
        window = (-1, -1) if self.window == (-1, 0) else self.window
        return DocsCase(self.docs, self.heads_q, self.heads_kv, causal, window, self.scale)

    def run(self, world: World) -> dict:
        fresh_dynamo()
        batch = self.reference_case()
        module = TorchVarlenAttention(self.window, self.scale)
        compiled = torch.compile(module, backend="hcp", fullgraph=True,
                                 options={"mesh": world.mesh, "inner": "aot_eager"})
        lse = {}

        def attend(q, k, v, cu, max_seqlen):
            out, lse["lse"] = compiled(q, k, v, cu, max_seqlen)
            return out

        with capture_aot_graphs() as captured:
            got = run_attention(batch, world, attend)
        return {**got, "lse": lse["lse"], **aot_summaries(captured, world.mesh)}


# --------------------------------------------------------------------------------------------
# the decorator's scoping and explain() on the real mesh
# --------------------------------------------------------------------------------------------

class Inner(nn.Module):
    """An attention module inside a block (for marks on the enclosing block)."""

    def forward(self, q, k, v, cu, max_seqlen):
        return hc.varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True)


class TwoKinds(nn.Module):
    """``marked`` layers of a marked class, then one layer of an unmarked class."""

    def __init__(self, marked: type, unmarked: type, layers: int = 2):
        super().__init__()
        self.marked = nn.ModuleList(marked(4, 2, True) for _ in range(layers))
        self.unmarked = unmarked(4, 2, True)

    def forward(self, x, cu, max_seqlen):
        for layer in self.marked:
            x = layer(x, cu, max_seqlen)
        return self.unmarked(x, cu, max_seqlen)


@contextlib.contextmanager
def counting_runs() -> Iterator[dict[str, int]]:
    """Counts the calls of what running the model would call: the functions of
    ``hcp_compile.compiled.inserted`` that the rewrite puts into graphs (they issue every collective)
    and the plain kernel, which the attention ops run on real tensors. ``explain`` must call
    none of them."""
    from hcp_compile.kernels import torch_kernel
    from hcp_compile.passes import rewrite

    inserted = [name for name, value in vars(rewrite).items()
                if callable(value) and getattr(value, "__module__", None) == "hcp_compile.compiled.inserted"]
    targets = [(rewrite, name) for name in inserted] + [(torch_kernel.TorchKernel, "forward")]
    counts = {}
    with contextlib.ExitStack() as patches:
        for module, name in targets:
            key = f"{module.__name__.rpartition('.')[2]}.{name}"
            counts[key] = 0
            patches.enter_context(mock.patch.object(module, name, _counted(getattr(module, name), key, counts)))
        yield counts


def _counted(fn: Callable, key: str, counts: dict[str, int]) -> Callable:
    @functools.wraps(fn)  # keeps the name the rewritten graph's code shows
    def counting(*args, **kwargs):
        counts[key] += 1
        return fn(*args, **kwargs)

    return counting


@dataclass(frozen=True)
class ExplainCase:
    """``hc.explain`` on this mesh: two marked layers and an unmarked one; nothing runs."""

    docs: str = "mixed"

    @property
    def id(self) -> str:
        return f"explain-marked-{self.docs}"

    def run(self, world: World) -> dict:
        fresh_dynamo()
        marked = hc.attention(kernel="torch")(fresh_class(Block, "ExplainMarked"))
        model = init_parameters(TwoKinds(marked, fresh_class(Block, "ExplainUnmarked")), self.id)
        cu = cu_seqlens(COMPILE_DOCS[self.docs])
        plan = hc.shard_plan(cu, world.mesh)
        x = plan.shard(seeded(f"{self.id}/x", int(cu[-1]), MODEL_DIM)).requires_grad_()
        with counting_runs() as runs:
            explanation = hc.explain(model, x, cu, max(COMPILE_DOCS[self.docs]), mesh=world.mesh, plan=plan)
        graph = explanation.graphs[0]
        return {
            "graphs": len(explanation.graphs),
            "tables": explanation.tables,
            "text": str(explanation),
            "paths": [r.match.module_path for r in graph.rewritten],
            "kernels": [r.kernel for r in graph.rewritten],
            "local_tokens": [r.local_tokens for r in graph.rewritten],
            "checked": [r.checked for r in graph.rewritten],
            "after": graph.after,
            "before": graph.before,
            "runs": runs,
            "plan_local_tokens": plan.local_tokens,
            "batch": explanation.batch,
            # the marked blocks' attention (4/2 heads of HEAD_DIM, fp32), and the defaults
            "summary": plan.summary(4, 2, HEAD_DIM, torch.float32),
            "default_summary": plan.summary(),
        }


# --------------------------------------------------------------------------------------------
# errors: at compile time, and a batch whose cu_seqlens does not fit the shards
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HeadsNotDivisibleCase:
    """3 query heads on ulysses=2: the backend refuses while compiling, on every rank."""

    @property
    def id(self) -> str:
        return "error-heads-not-divisible-by-ulysses"

    def run(self, world: World) -> dict:
        fresh_dynamo()
        batch = DocsCase("three", 3, 1, True)
        compiled = torch.compile(VarlenAttention(True, None, (-1, -1)), fullgraph=True,
                                 backend=hc.backend(mesh=world.mesh, inner="aot_eager"))
        return run_attention(batch, world, compiled)


class SeparateCu(nn.Module):
    def forward(self, q, k, v, cu_q, cu_k, max_seqlen):
        return hc.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen, max_seqlen, causal=True)


def _other_batch(lengths: tuple[int, ...], rank_count: int) -> tuple[int, ...]:
    """Same number of documents, more tokens: a different local token count on every mesh."""
    return (*lengths[:-1], lengths[-1] + 8 * rank_count)


@dataclass(frozen=True)
class BadBatchCase:
    """One compiled graph (dynamic shapes), a valid batch first; then batches whose
    cu_seqlens does not describe the shards: on one rank only, on every rank, cu_seqlens_k
    different on one rank. Each must raise on every rank (the device-side check, agreed over
    the mesh), none may hang; then a valid batch runs again. Returns each phase's outcome."""

    phases: tuple[str, ...] = ("one-rank-cu", "every-rank-cu", "one-rank-cu-k")
    batch: ClassVar[DocsCase] = DocsCase("four", 4, 2, True)

    @property
    def id(self) -> str:
        return "error-bad-batches-" + "-".join(self.phases)

    def run(self, world: World) -> dict:
        fresh_dynamo()
        batch = self.batch
        lengths = batch.lengths
        cu = cu_seqlens(lengths)
        plan = hc.shard_plan(cu, world.mesh)
        x = batch.inputs()
        q, k, v = (plan.shard(x[n]) for n in "qkv")
        counter = CompileCounter(hc.backend(mesh=world.mesh, inner="aot_eager"))
        compiled = torch.compile(SeparateCu(), backend=counter, dynamic=True, fullgraph=True)
        longest = max(lengths)
        other = cu_seqlens(_other_batch(lengths, world.ulysses * world.ring))
        bad_rank = world.ulysses * world.ring - 1
        calls = {
            "one-rank-cu": lambda: compiled(q, k, v, *((other, other.clone()) if world.rank == bad_rank
                                                      else (cu, cu.clone())), longest),
            "every-rank-cu": lambda: compiled(q, k, v, other, other.clone(), longest),
            "one-rank-cu-k": lambda: compiled(q, k, v, cu, other if world.rank == bad_rank else cu.clone(), longest),
        }
        result: dict = {"first": compiled(q, k, v, cu, cu.clone(), longest).detach()}
        for phase in self.phases:
            try:
                calls[phase]()
                result[phase] = {"types": [], "message": "returned normally"}
            except Exception as exc:  # noqa: BLE001 - the outcome is the result
                result[phase] = error_record(exc)
        result["after"] = compiled(q, k, v, cu, cu.clone(), longest).detach()
        result["graphs"] = counter.graphs
        result["global_index"] = plan.global_index
        return result


class RefusedVariantCase:
    """No narrower graph can be built on the last rank only (its compile raises there, as a
    rank-local failure would): on a batch that exchanges nothing that rank runs the full
    graph, whose exchanges and ring hops would wait for the others, and the others the graph
    without collectives. The agreed batch check must fail on every rank, none may hang; the
    last rank warns why. Then a batch with a ring section runs the full graph everywhere."""

    id = "error-ring-variant-refused"

    def run(self, world: World) -> dict:
        fresh_dynamo()
        last = world.ulysses * world.ring - 1

        def backend(gm: fx.GraphModule, example_inputs):
            compiled = hc.backend(mesh=world.mesh, inner="aot_eager")(gm, example_inputs)
            if world.rank == last:
                def refuse(exchanges):
                    raise RuntimeError("compile failed on this rank only")
                compiled.compile_for = refuse
            return compiled

        compiled = torch.compile(VarlenAttention(True, None, (-1, -1)), backend=backend, dynamic=True,
                                 fullgraph=True)
        result: dict = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                run_attention(DocsCase("no-ring", 4, 2, True), world, compiled)
                result["no-ring"] = {"types": [], "message": "returned normally"}
            except Exception as exc:  # noqa: BLE001 - the outcome is the result
                result["no-ring"] = error_record(exc)
        result["warnings"] = [str(w.message) for w in caught if "batches that exchange nothing" in str(w.message)]
        result.update({f"after/{n}": v for n, v in run_attention(DocsCase("mixed", 4, 2, True), world, compiled).items()})
        return result


# --------------------------------------------------------------------------------------------
# the suites
# --------------------------------------------------------------------------------------------

# The 4-rank meshes other than FULL_MESH run the attention cases only: every world of 4
# processes costs minutes of compiling on 2 cores, and what the model, explain, torch-varlen
# and error cases check does not depend on the mesh's shape (the eager suite runs its error
# cases on every mesh).
FULL_MESH = (2, 2)


def model_cases(mesh: tuple[int, int]) -> list[ModelCase]:
    if mesh != FULL_MESH:
        return []
    # GQA 8/4: two KV heads per rank on ulysses 2, so two head groups (docs/design.md §3.6),
    # whose collectives the structure tests count; the other compiled graphs have one group
    return [ModelCase(heads_q=8, heads_kv=4), ModelCase(layers=2, checkpointed=True)]


def model_stream_cases(mesh: tuple[int, int]) -> list[ModelStreamCase]:
    return [ModelStreamCase()] if mesh == FULL_MESH else []


def torch_varlen_cases(mesh: tuple[int, int]) -> list[TorchVarlenCase]:
    """A causal sliding window and a scale; varlen_attn's plain causal ``(-1, 0)`` compiles
    with its lse on 2 x 1 in test_head_groups and on one rank in test_passes."""
    if mesh != FULL_MESH:
        return []
    return [TorchVarlenCase("mixed", 4, 2, window=(5, 0), scale=0.4)]


def explain_cases(mesh: tuple[int, int]) -> list[ExplainCase]:
    return [ExplainCase()] if mesh == FULL_MESH else []


@dataclass(frozen=True)
class OptionsDifferCase:
    """The last rank compiles with ``recompute_exchange=True``, the others without: the
    backward's exchanges would differ in layout and size, so the first call must raise on
    every rank (the layout check's agreed fingerprint) before any exchange."""

    batch: ClassVar[DocsCase] = DocsCase("four", 4, 2, True)

    @property
    def id(self) -> str:
        return "error-recompute-exchange-differs"

    def run(self, world: World) -> dict:
        fresh_dynamo()
        cu = cu_seqlens(self.batch.lengths)
        plan = hc.shard_plan(cu, world.mesh)
        q, k, v = (plan.shard(x).requires_grad_() for name, x in self.batch.inputs().items() if name != "dout")
        lean = world.rank == world.ulysses * world.ring - 1
        backend = hc.backend(mesh=world.mesh, inner="aot_eager", recompute_exchange=lean)
        compiled = torch.compile(VarlenAttention(True, None, (-1, -1)), backend=backend, fullgraph=True)
        try:
            compiled(q, k, v, cu, max(self.batch.lengths)).sum().backward()
        except Exception as exc:  # noqa: BLE001 - the outcome is the result
            return error_record(exc)
        return {"types": [], "message": "returned normally"}


def error_cases(mesh: tuple[int, int]) -> list:
    return [HeadsNotDivisibleCase(), BadBatchCase(), OptionsDifferCase(), RefusedVariantCase()] if mesh == ERROR_MESH else []


def suite(mesh: tuple[int, int]) -> list:
    """Every compiled-path case run in the aot_eager world of ``mesh``, in order (the error
    cases last: a hang there must not cost the others their results)."""
    return [*explain_cases(mesh), *attention_cases(mesh), *model_cases(mesh),
            *model_stream_cases(mesh), *torch_varlen_cases(mesh), *error_cases(mesh)]


# the third batch exchanges nothing: its graph (graph_variants) compiled by Inductor too
INDUCTOR_CASE = CompiledAttentionCase("inductor-gqa-causal", ("mixed", "mixed-permuted", "no-ring"), 4, 2,
                                      True, inner="inductor", dump=True, cu_in_place=True)


def inductor_suite(mesh: tuple[int, int]) -> list:
    return [INDUCTOR_CASE]


# --------------------------------------------------------------------------------------------
# parsing the dumped report (used by the tests)
# --------------------------------------------------------------------------------------------

def table_counts(markdown: str) -> dict[str, int]:
    """Sum of the collectives the matches.md table announces, over its rows."""
    totals = {"fw_all_to_all": 0, "fw_ring": 0, "fw_all_reduce": 0, "bw_all_to_all": 0, "bw_ring": 0}
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        row = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|"))))
        for prefix, column in (("fw", "collectives fwd"), ("bw", "collectives bwd")):
            for count, kind in re.findall(r"(\d+) (all_to_all|ring|all_reduce)", row[column]):
                totals[f"{prefix}_{kind}"] += int(count)
    return totals


AGREE_CALL = re.compile(r"hcp\.agree_on_batch\.default\(\w+, '([^']+)', '([^']+)', (True|False)")
A2A_CALL = re.compile(
    r"_c10d_functional\.all_to_all_single\.default\((\w+), \[([^\]]*)\], \[([^\]]*)\], '([^']+)'\)")


def text_collectives(code: str, ulysses_group: str, ring_group: str) -> dict[str, int]:
    """Collectives in a dumped graph's code (``print_readable`` text), by kind."""
    agreements = AGREE_CALL.findall(code)
    counts = {"ulysses": 0, "ring": 0, "other_group": 0,
              "all_reduce": code.count("_c10d_functional.all_reduce.default(") + sum(
                  agreement_all_reduces((u, r, agree == "True"), (ulysses_group, ring_group))
                  for u, r, agree in agreements),
              "wait_tensor": code.count("_c10d_functional.wait_tensor.default(")}
    for _, output_splits, input_splits, group in A2A_CALL.findall(code):
        key = {ulysses_group: "ulysses", ring_group: "ring"}.get(group, "other_group")
        counts[key] += 1
    return counts
