"""The Ulysses exchange pipelined over head groups (docs/design.md §3.6).

The rule (``schedule.head_groups``) as a unit; then, in one gloo world per mesh of
``MESHES`` (suite :func:`suite` of this module, run by ``hcp_compile/testing/worlds.py``): eager CP with
grouped heads (GQA 8/4, MHA 4/4) and with the rule's fallback to one group (4/2, 8/2, 2/1
with repeated KV heads), results and gradients against the float64 reference and equal, up to
rounding, to the algorithm forced to one group (the same ops on the groups' smaller tensors,
which the CPU kernels may round otherwise); the compiled path (``aot_eager``, GQA 8/4, and torch's ``varlen_attn`` with its lse)
against the reference and eager CP. Eagerly and in the traced
forward and backward graphs: the number of exchanges and the order they are issued in (group
``g + 1``'s exchange before group ``g``'s ring computes, group ``g``'s results sent back
before group ``g + 1``'s ring).
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from checks import (
    RESULTS, assert_compiled_rank_matches, assert_matches, assert_rounding_close, expected_for, local_rows,
)
from compile_cases import (
    CompiledAttentionCase, TorchVarlenCase, capture_aot_graphs, split_forward_backward,
)
from cp_cases import AttentionCase, World, mesh_id
from hcp_compile.batch import schedule
from hcp_compile.batch.schedule import HEAD_GROUPS, head_groups, kv_head_repeat, rank_kv_heads

MESHES = ((2, 1), (2, 2))  # (ulysses, ring)
SUITE = "test_head_groups:suite"
DEADLINE_S = 600
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default


# --------------------------------------------------------------------------------------------
# the rule
# --------------------------------------------------------------------------------------------

def test_no_groups_without_an_exchange():
    for kv_heads in (1, 2, 4, 8):
        assert head_groups(kv_heads, 1) == 1


@pytest.mark.parametrize("kv_heads_per_rank, ulysses, groups", [
    (1, 2, 1), (1, 8, 1), (3, 2, 1),  # cannot be split keeping the GQA ratio
    (2, 2, HEAD_GROUPS), (4, 2, HEAD_GROUPS), (2, 8, HEAD_GROUPS), (6, 4, HEAD_GROUPS),
])
def test_head_groups_rule(kv_heads_per_rank, ulysses, groups):
    assert head_groups(kv_heads_per_rank, ulysses) == groups


def test_groups_keep_the_gqa_ratio_and_split_every_head():
    """For every head split the exchange accepts, each group gets an equal share of the
    rank's query and KV heads (so the GQA ratio of the whole); repeated KV heads (fewer KV
    heads than Ulysses ranks) leave one KV head per rank, hence one group."""
    for ulysses in (1, 2, 4, 8):
        for heads_kv in (1, 2, 4, 8, 16):
            if heads_kv % ulysses and ulysses % heads_kv:
                continue
            kv_per_rank = rank_kv_heads(heads_kv, ulysses)
            assert kv_per_rank * ulysses == heads_kv * kv_head_repeat(heads_kv, ulysses)
            for ratio in (1, 2, 4):
                heads_q = heads_kv * ratio
                if heads_q % ulysses:
                    continue
                q_per_rank, groups = heads_q // ulysses, head_groups(kv_per_rank, ulysses)
                assert q_per_rank % groups == 0 and kv_per_rank % groups == 0
                assert (q_per_rank // groups) * kv_per_rank == (kv_per_rank // groups) * q_per_rank
                if kv_head_repeat(heads_kv, ulysses) > 1 or ulysses == 1:
                    assert groups == 1


def test_rank_kv_heads():
    assert [rank_kv_heads(h, 2) for h in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert [rank_kv_heads(h, 8) for h in (1, 2, 4, 8, 16)] == [1, 1, 1, 1, 2]


# --------------------------------------------------------------------------------------------
# worker side: what the collectives and kernels are asked to do, in order
# --------------------------------------------------------------------------------------------

def event_of(target, args, ulysses_group: str, ring_group: str) -> str | None:
    """One letter per op that matters for the order: ``U``/``R`` an all-to-all issued on the
    Ulysses/ring group, ``B`` an attention block (forward or backward)."""
    if target is ALL_TO_ALL:
        return {ulysses_group: "U", ring_group: "R"}.get(args[3], "?")
    if target in (torch.ops.hcp.block_forward.default, torch.ops.hcp.block_backward.default):
        return "B"
    return None


class OpOrder(TorchDispatchMode):
    """The events of :func:`event_of` as an eager call dispatches them."""

    def __init__(self, ulysses_group: str, ring_group: str):
        super().__init__()
        self.names, self.events = (ulysses_group, ring_group), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        event = event_of(func, args, *self.names)
        if event is not None:
            self.events.append(event)
        return func(*args, **(kwargs or {}))


def graph_events(gm: fx.GraphModule, ulysses_group: str, ring_group: str) -> str:
    """The events of :func:`event_of` in a traced graph's node order."""
    events = (event_of(n.target, n.args, ulysses_group, ring_group)
              for n in gm.graph.nodes if n.op == "call_function")
    return "".join(e for e in events if e is not None)


def group_names(world: World) -> tuple[str, str]:
    return world.mesh.get_group("ulysses").group_name, world.mesh.get_group("ring").group_name


def ungrouped():
    """The algorithm with one head group whatever the heads."""
    return mock.patch.object(schedule, "head_groups", lambda *args: 1)


@dataclass(frozen=True)
class EagerCase(AttentionCase):
    """Eager CP on the case's batch (``cp_cases.DOC_MIXES``), the ops' order recorded, and
    the same call with one head group."""

    @property
    def id(self) -> str:
        return f"eager-{super().id}"

    def run(self, world: World) -> dict:
        with OpOrder(*group_names(world)) as order:
            result = super().run(world)
        with ungrouped():
            single = super().run(world)
        return {**result, "events": "".join(order.events),
                **{f"ungrouped_{n}": single[n] for n in RESULTS}}


@dataclass(frozen=True)
class CompiledCase(CompiledAttentionCase):
    """``compile_cases.CompiledAttentionCase`` (compiled with ``aot_eager``, each batch also
    run eagerly), the events of its AOT graphs recorded."""

    def run(self, world: World) -> dict:
        with capture_aot_graphs() as captured:
            result = super().run(world)
        forward, backward = split_forward_backward(captured)
        names = group_names(world)
        return {**result, "fw_events": [graph_events(g, *names) for g in forward],
                "bw_events": [graph_events(g, *names) for g in backward]}


def eager_cases(mesh: tuple[int, int]) -> list[EagerCase]:
    grouped = [EagerCase("many", hq, hkv, True) for hq, hkv in ((8, 4), (4, 4))]
    fallback = [EagerCase("many", hq, hkv, True) for hq, hkv in ((4, 2), (2, 1), (8, 2))]
    masks = [EagerCase("mixed", 8, 4, False, (3, 5)), EagerCase("long", 4, 4, True, (17, 0)),
             EagerCase("long", 8, 4, True, placement="zigzag")]
    return grouped + fallback + masks


def compiled_cases(mesh: tuple[int, int]) -> list[CompiledCase]:
    """The grouped GQA case; MHA and the one-group fallback run eagerly here (the code is
    the same), and compiled in test_compile.py already (GQA 8/4, grouped, on 2 x 2; 4/2, one
    group, on every mesh; 4/1 on 2 x 2, 4/4 on 1 x 4 and 4 x 1): a 4-rank world compiles for
    tens of seconds per case on 2 cores. Two batches (COMPILE_DOCS), one graph (dynamic
    shapes)."""
    return [CompiledCase("hg-gqa-8.4-causal", ("mixed", "four"), 8, 4, True)]


def lse_cases(mesh: tuple[int, int]) -> list[TorchVarlenCase]:
    """torch's varlen_attn with the lse used, grouped (on 2 x 1: a 2-rank world compiles in
    seconds)."""
    return [TorchVarlenCase("mixed", 8, 4)] if mesh == (2, 1) else []


def suite(mesh: tuple[int, int]) -> list:
    return [*eager_cases(mesh), *compiled_cases(mesh), *lse_cases(mesh)]


# --------------------------------------------------------------------------------------------
# the tests on the worlds' records
# --------------------------------------------------------------------------------------------

def world(cp_world, mesh):
    return cp_world(mesh, suite=SUITE, deadline_s=DEADLINE_S)


def groups_of(mesh: tuple[int, int], heads_kv: int) -> int:
    return head_groups(rank_kv_heads(heads_kv, mesh[0]), mesh[0])


def check_order(events: str, groups: int, forward: bool, what: str) -> None:
    """Forward: group 0's q and kv exchanges (``U U``) before the local block, group ``g+1``'s
    before group ``g``'s first ring block, group ``g``'s output sent back (``U``) after its
    last ring block and before group ``g+1``'s first. Backward: one exchange in (dout) per
    group, two back (dq, dkv)."""
    blocks = [i for i, e in enumerate(events) if e == "B"]
    exchanges = [i for i, e in enumerate(events) if e == "U"]
    into, back = (2, 1) if forward else (1, 2)
    steps = (len(blocks) - 1) // groups
    assert len(blocks) == 1 + groups * steps and steps >= 1, f"{what}: {events}"
    assert len(exchanges) >= groups * (into + back), f"{what}: {events}"
    assert all(i < blocks[0] for i in exchanges[:into]), f"{what}: group 0 after the local block: {events}"
    for g in range(groups):
        first, last = blocks[1 + g * steps], blocks[g * steps + steps]
        if g + 1 < groups:  # group g+1's exchanges in: after group g's in and group g-1's back
            start = into * (g + 1) + back * g
            assert all(i < first for i in exchanges[start : start + into]), (
                f"{what}: group {g + 1} exchanged after group {g}'s ring started: {events}")
        start = into * min(g + 2, groups) + back * g  # group g's back: after group g+1's in
        sent = exchanges[start : start + back]
        assert sent and all(last < i for i in sent), f"{what}: group {g} sent back early: {events}"
        if g + 1 < groups:
            assert all(i < blocks[1 + (g + 1) * steps] for i in sent), (
                f"{what}: group {g} sent back after group {g + 1}'s ring: {events}")


EAGER = [pytest.param(mesh, case, id=f"{mesh_id(mesh)}-{case.id}")
         for mesh in MESHES for case in eager_cases(mesh)]


@pytest.mark.parametrize("mesh, case", EAGER)
def test_eager_matches_reference_and_ungrouped(cp_world, mesh, case):
    reference = expected_for(case)
    grouped = groups_of(mesh, case.heads_kv) > 1
    for rank, result in enumerate(world(cp_world, mesh).values(case.id)):
        index = result["global_index"]
        for name in RESULTS:
            got = result[name]
            assert_matches(got, local_rows(reference[name], index), f"rank {rank} {name}")
            assert (got[index < 0] == 0).all(), f"rank {rank}: {name} is not zero at the pads"
            # heads are independent: grouping changes only the shapes the kernels and merges
            # run on, and so at most their rounding (checks.ROUNDING_ULPS)
            assert_rounding_close(got, result[f"ungrouped_{name}"], f"rank {rank} {name} vs one group")
        events = result["events"]
        groups = groups_of(mesh, case.heads_kv)
        # forward: q, kv in and out back; backward: dout in and dq, dkv back; per group
        exchanges = [i for i, e in enumerate(events) if e == "U"]
        assert len(exchanges) == 6 * groups, f"rank {rank}: Ulysses exchanges {events}"
        if grouped and case.window == (-1, -1):  # a window may skip ring steps eagerly
            cut = exchanges[3 * groups - 1] + 1  # the forward's last exchange
            check_order(events[:cut], groups, True, f"rank {rank} forward")
            check_order(events[cut:], groups, False, f"rank {rank} backward")


COMPILED = [pytest.param(mesh, case, index, id=f"{mesh_id(mesh)}-{case.id}-{docs}")
            for mesh in MESHES for case in compiled_cases(mesh)
            for index, docs in enumerate(case.docs)]


@pytest.mark.parametrize("mesh, case, index", COMPILED)
def test_compiled_matches_reference_and_eager(cp_world, mesh, case, index):
    batch = case.batches()[index]
    reference = expected_for(batch)
    for rank, result in enumerate(world(cp_world, mesh).values(case.id)):
        assert_compiled_rank_matches(result, index, reference, rank)
        assert result["graphs_after"][index] == 1, f"rank {rank}: {result['graphs_after']}"


GRAPHS = [pytest.param(mesh, case, id=f"{mesh_id(mesh)}-{case.id}")
          for mesh in MESHES for case in compiled_cases(mesh)]


@pytest.mark.parametrize("mesh, case", GRAPHS)
def test_compiled_graphs_issue_each_groups_exchange_ahead(cp_world, mesh, case):
    """Per head group 3 Ulysses all-to-alls and R-1 ring transfers in the forward graph,
    3 and 2R-1 in the backward, in the pipelined order of :func:`check_order`."""
    ulysses, ring = mesh
    groups = groups_of(mesh, case.heads_kv)
    for rank, result in enumerate(world(cp_world, mesh).values(case.id)):
        (forward,), (backward,) = result["fw_events"], result["bw_events"]
        assert forward.count("U") == 3 * groups, f"rank {rank}: {forward}"
        assert forward.count("R") == (ring - 1) * groups, f"rank {rank}: {forward}"
        assert backward.count("U") == 3 * groups, f"rank {rank}: {backward}"
        assert backward.count("R") == (2 * ring - 1) * groups * (ring > 1), f"rank {rank}: {backward}"
        check_order(forward, groups, True, f"rank {rank} forward graph")
        check_order(backward, groups, False, f"rank {rank} backward graph")


@pytest.mark.parametrize("mesh, case", [pytest.param(m, c, id=f"{mesh_id(m)}-{c.id}")
                                        for m in MESHES for c in lse_cases(m)])
def test_compiled_lse_of_grouped_heads(cp_world, mesh, case):
    """torch's varlen_attn with its lse used: the lse of every group comes back in place."""
    from test_compile import reference_lse

    batch = case.reference_case()
    reference = expected_for(batch)
    x = batch.inputs()
    lse = reference_lse(x["q"], x["k"], batch.lengths, **batch.mask_args)
    groups = groups_of(mesh, case.heads_kv)
    assert groups > 1
    for rank, result in enumerate(world(cp_world, mesh).values(case.id)):
        index = result["global_index"]
        for name in RESULTS:
            assert_matches(result[name], local_rows(reference[name], index), f"rank {rank} {name}")
        got = result["lse"]
        assert_matches(got[:, index >= 0], lse[:, index[index >= 0]], f"rank {rank} lse")
        assert torch.isneginf(got[:, index < 0]).all(), f"rank {rank}: lse at the pads"
        (forward,) = result["fw"]
        assert forward["ulysses"] == 4 * groups and forward["unwaited"] == 0, f"rank {rank}: {forward}"
