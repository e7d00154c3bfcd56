"""The compiled path, ``torch.compile(model, backend="hcp")`` (docs/design.md §1, §5, §6), on real
multi-process meshes: every case of ``compile_cases`` runs in one gloo world per mesh (inner
compiler ``aot_eager``), plus one world with an Inductor-compiled run.

Checked: compiled results against the independent float64 reference and against eager CP
(forward and backward, pads exactly zero); a model of several marked layers compiles to one
graph with ``fullgraph=True``; a model written against torch's own ``varlen_attn`` (no CPU
kernel) compiles and runs, its logsumexp output rewired; the collectives of the AOT forward and
backward graphs (Ulysses all-to-alls, ring transfers, the layout check's all-reduces, each
waited, no q/k/v re-exchange in the backward); the dump folder and its report; ``explain`` and
the decorator's scoping on the mesh; recompilation; errors at compile time and for a batch
that does not fit the shards (every rank raises, none hangs).
"""

from __future__ import annotations

import functools

import pytest
import torch

from hcp_compile.testing.reference import document_mask, reference_attention
from checks import (
    RESULTS, assert_compiled_rank_matches, assert_matches, assert_rounding_close, expected_for,
    local_rows,
)
from compile_cases import (
    COMPILE_DOCS, COMPILE_MESHES, ERROR_MESH, FULL_MESH, INDUCTOR_CASE, RECOMPUTE_MESHES, INDUCTOR_DEADLINE_S, INDUCTOR_MESH,
    INDUCTOR_SUITE, SUITE, WORLD_DEADLINE_S, Block, BadBatchCase, DocsCase, HeadsNotDivisibleCase, OptionsDifferCase,
    RefusedVariantCase, ShapedBlock,
    ModelCase, attention_cases, error_cases, explain_cases, fresh_class,
    model_cases, model_stream_cases, table_counts, text_collectives, torch_varlen_cases,
)
from cp_cases import cu_seqlens, mesh_id
from hcp_compile.batch.schedule import HEAD_GROUPS, head_groups, rank_kv_heads
from hcp_compile.passes.match import UnsupportedAttention

# compiled vs eager CP: the same kernels and collectives, equal up to rounding
# (checks.assert_rounding_close): Inductor's decompositions (also under aot_eager, in the
# recompute_exchange cases) and Inductor's code replace some of eager's elementwise ops and
# reductions. Measured: bit-equal with ATEN_CPU_CAPABILITY=default but not avx2 or avx512,
# Inductor's code nowhere; at most 1.4 eps of the scale apart.
DUMP_FILES = ("before_rewrite.py", "after_rewrite.py", "aot_forward.py", "aot_backward.py", "matches.md")


def compile_world(cp_world, mesh):
    return cp_world(mesh, suite=SUITE, deadline_s=WORLD_DEADLINE_S)


def params(cases_of, ids_of=lambda case: case.id, meshes=COMPILE_MESHES):
    return [pytest.param(mesh, case, id=f"{mesh_id(mesh)}-{ids_of(case)}")
            for mesh in meshes for case in cases_of(mesh)]


def groups_of(mesh, heads_kv: int) -> int:
    """Head groups of a layer with ``heads_kv`` KV heads on ``mesh`` (docs/design.md §3.6)."""
    ulysses = mesh[0]
    return head_groups(rank_kv_heads(heads_kv, ulysses), ulysses)


def expected_collectives(mesh, heads_kv: int, layers: int, lse_layers: int = 0) -> dict:
    """Per AOT graph, for ``layers`` attention layers with ``heads_kv`` KV heads sharing one
    cu_seqlens (docs/design.md §3-5), each layer's heads in ``G`` head groups (§3.6), every
    group with its own exchanges and ring: forward 3 Ulysses all-to-alls per group (q, kv in;
    out back; +1 for a used lse) and R-1 KV transfers, an all-reduce for the layout check
    (once) per mesh dimension of more than one rank; backward 3 Ulysses all-to-alls per group (dout in; dq, dkv back) and 2R-1 ring
    transfers (the KV again, R-1 hops, and the dKV accumulator, R hops; the backward's KV
    transfers are not merged with the forward's, so no rank keeps the other ranks' KV alive
    until the backward). No Ulysses exchange with ulysses=1, no ring transfer with ring=1."""
    ulysses, ring = mesh
    groups = groups_of(mesh, heads_kv)
    return {
        "fw": {"ulysses": groups * (3 * layers + lse_layers) if ulysses > 1 else 0,
               "ring": groups * (ring - 1) * layers, "all_reduce": int(ulysses > 1) + int(ring > 1)},
        "bw": {"ulysses": groups * 3 * layers if ulysses > 1 else 0,
               "ring": groups * (2 * ring - 1) * layers if ring > 1 else 0, "all_reduce": 0},
    }


def assert_well_formed(summary: dict, what: str) -> None:
    """Every collective waited, splits as their kind requires, nothing unexpected."""
    assert summary["unwaited"] == 0, f"{what}: {summary['unwaited']} collectives without a wait_tensor"
    assert summary["bad_splits"] == 0, f"{what}: {summary['bad_splits']} exchanges with wrong splits"
    assert summary["other"] == [], f"{what}: unexpected collectives {summary['other']}"


# --------------------------------------------------------------------------------------------
# attention alone: compiled == eager CP == float64 reference
# --------------------------------------------------------------------------------------------

BATCHES = [pytest.param(mesh, case, index, id=f"{mesh_id(mesh)}-{case.id}-{index}-{docs}")
           for mesh in COMPILE_MESHES for case in attention_cases(mesh)
           for index, docs in enumerate(case.docs)]


@pytest.mark.parametrize("mesh, case, index", BATCHES)
def test_compiled_attention_matches_reference_and_eager_cp(cp_world, mesh, case, index):
    batch = case.batches()[index]
    reference = expected_for(batch)
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        assert_compiled_rank_matches(result, index, reference, rank, against_eager=case.eager)


@pytest.mark.parametrize("mesh", COMPILE_MESHES, ids=mesh_id)
def test_dynamic_shapes_reuse_one_graph_for_new_batches(cp_world, mesh):
    """dynamic=True: other documents with the same local token count, then another token
    count and document count, run on the first graph; on FULL_MESH, a batch of a single
    document may compile once more (Dynamo specializes the size-1 document-length tensor),
    and the next single-document batch reuses that graph."""
    (case,) = [c for c in attention_cases(mesh) if c.name == "gqa-causal-batches"]
    assert len(case.docs) == (5 if mesh == FULL_MESH else 3), case.docs
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        tokens = [result[f"{i}/local_tokens"] for i in range(len(case.docs))]
        assert tokens[0] == tokens[1] != tokens[2], f"rank {rank}: premise of the batches: {tokens}"
        graphs = result["graphs_after"]
        assert graphs[:3] == [1, 1, 1], f"rank {rank}: graphs compiled after each batch {graphs}"
        single = graphs[3:]  # after the single-document batches (FULL_MESH)
        assert single in ([], [1, 1], [2, 2]), f"rank {rank}: graphs compiled {graphs}"


def test_each_batch_runs_the_graph_of_what_it_exchanges(cp_world):
    """A batch whose documents all stay whole on their ranks runs a graph without any
    collective, and one that exchanges heads but has no ring section a graph with the
    exchanges and no ring transfers; each is compiled on its first use beside the full graph
    (one Dynamo graph), which runs the batch with a ring section, and reused by the next batch
    of its kind. Numerics: test_compiled_attention_matches_reference_and_eager_cp."""
    mesh = (2, 2)
    (case,) = [c for c in attention_cases(mesh) if c.name == "gqa-graph-variants"]
    expected = expected_collectives(mesh, case.heads_kv, layers=1)["fw"]
    full, nothing, heads = (expected["ulysses"], expected["ring"]), (0, 0), (expected["ulysses"], 0)
    assert all(count > 0 for count in full)
    graphs = [[full, nothing]] * 2 + [[full, nothing, heads]] * 3
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        assert result["graphs_after"] == [1] * 5, f"rank {rank}: {result['graphs_after']}"
        assert result["transfers_after"] == graphs, f"rank {rank}: {result['transfers_after']}"


@pytest.mark.parametrize("mesh", RECOMPUTE_MESHES, ids=mesh_id)
def test_compiled_recompute_exchange_saves_only_the_inputs_and_output(cp_world, mesh):
    """As eagerly (test_cp_attention): the compiled forward keeps no exchanged q, KV or output
    for the backward with recompute_exchange, and keeps them without it."""
    cases = {c.name: c for c in attention_cases(mesh)}
    world = compile_world(cp_world, mesh)
    lean, full = (world.values(cases[name].id) for name in ("gqa-recompute-exchange", "gqa-causal-batches"))
    for rank, lean_rank in enumerate(lean):
        assert lean_rank["0/saved_besides_inputs"] == [], f"rank {rank}: {lean_rank['0/saved_besides_inputs']}"
    assert any(full_rank["0/saved_besides_inputs"] for full_rank in full), "the default saved no exchanged copy"


def test_automatic_dynamic_recompiles_once(cp_world):
    """dynamic=None: the first graph is static; the second batch changes the local token
    count, the document count and max_seqlen together, which compiles once more with all of
    them dynamic; no batch after that compiles again."""
    (case,) = [c for c in attention_cases((2, 2)) if c.name == "mqa-full-window-scale-zigzag-flex"]
    for rank, result in enumerate(compile_world(cp_world, (2, 2)).values(case.id)):
        assert result["graphs_after"] == [1, 2, 2, 2, 2], f"rank {rank}: {result['graphs_after']}"


# --------------------------------------------------------------------------------------------
# a model of several marked layers
# --------------------------------------------------------------------------------------------

MODELS = params(model_cases)
# the graph-structure tests: activation checkpointing recomputes the forward's exchanges
STRUCTURE_MODELS = params(lambda mesh: [c for c in model_cases(mesh) if not c.checkpointed])


def _reference_attend(self, q, k, v, cu, max_seqlen):
    return reference_attention(q, k, v, cu.tolist(), cu.tolist(), causal=self.causal)


@functools.cache
def model_reference(case: ModelCase) -> dict[str, torch.Tensor]:
    """The model in float64 on the whole batch, its attention the float64 reference."""
    model = case.build(fresh_class(Block, "ReferenceBlock", attend=_reference_attend)).double()
    inputs = case.inputs()
    x = inputs["x"].double().requires_grad_()
    out = model(x, cu_seqlens(case.lengths), max(case.lengths))
    (out * inputs["dout"].double()).sum().backward()
    grads = {f"grad/{n}": p.grad for n, p in model.named_parameters()}
    return {"out": out.detach(), "dx": x.grad, **grads}


@pytest.mark.parametrize("mesh, case", params(model_stream_cases))
def test_model_through_batches_of_every_exchange_matches_reference_without_warnings(cp_world, mesh, case):
    """Each batch of the stream against the float64 model, and no warning: a narrower graph
    compiled after Dynamo's call keeps Dynamo's symbols, so it adds no guards and is used."""
    results = compile_world(cp_world, mesh).values(case.id)
    model = case.build(fresh_class(ShapedBlock, "ReferenceStreamBlock", attend=_reference_attend)).double()
    for index, docs in enumerate(case.stream):
        lengths = COMPILE_DOCS[docs]
        inputs = case.batch_inputs(docs)
        x = inputs["x"].double().requires_grad_()
        out = model(x, cu_seqlens(lengths), max(lengths))
        (out * inputs["dout"].double()).sum().backward()
        for rank, result in enumerate(results):
            rows = result[f"{index}/global_index"]
            real = rows >= 0
            assert_matches(result[f"{index}/out"][real], out.detach()[rows[real]], f"rank {rank} batch {index} out")
            assert_matches(result[f"{index}/dx"], local_rows(x.grad, rows), f"rank {rank} batch {index} dx")
    for rank, result in enumerate(results):
        assert result["warnings"] == [], f"rank {rank} warned: {result['warnings']}"


@pytest.mark.parametrize("mesh, case", MODELS)
def test_model_of_marked_layers_compiles_to_one_graph(cp_world, mesh, case):
    """fullgraph=True (a graph break would raise) and one graph, one forward and one
    backward AOT graph, on every rank."""
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        assert result["graphs"] == 1, f"rank {rank}: Dynamo compiled {result['graphs']} graphs"
        assert result["aot_graphs"] == (1, 1), f"rank {rank}: AOT (fw, bw) {result['aot_graphs']}"


@pytest.mark.parametrize("mesh, case", MODELS)
def test_model_compiled_equals_eager_cp(cp_world, mesh, case):
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        for name in [n for n in result if n == "out" or n == "dx" or n.startswith("grad/")]:
            assert_rounding_close(result[name], result[f"eager_{name}"], f"rank {rank} {name} vs eager CP")


@pytest.mark.parametrize("mesh, case", MODELS)
def test_model_compiled_matches_float64_reference(cp_world, mesh, case):
    """Output rows, input gradient (zero at the pads, whose garbage must not leak into any
    layer) and the parameters' gradients summed over the ranks."""
    reference = model_reference(case)
    results = compile_world(cp_world, mesh).values(case.id)
    for rank, result in enumerate(results):
        index = result["global_index"]
        real = index >= 0
        assert_matches(result["out"][real], reference["out"][index[real]], f"rank {rank} out")
        assert_matches(result["dx"], local_rows(reference["dx"], index), f"rank {rank} dx")
        assert (result["dx"][~real] == 0).all(), f"rank {rank}: dx is not zero at the pads"
        assert_matches(result["unsharded_out"], reference["out"], f"rank {rank} unshard(out)")
    for name in [n for n in reference if n.startswith("grad/")]:
        summed = torch.stack([r[name] for r in results]).sum(0)
        assert_matches(summed, reference[name], f"{name} summed over ranks")


@pytest.mark.parametrize("mesh, case", STRUCTURE_MODELS)
def test_forward_graph_collectives(cp_world, mesh, case):
    """Per layer and head group 3 Ulysses all-to-alls (equal splits) and R-1 ring transfers
    (one non-zero split), plus the layout check's 2 all-reduces once; each waited."""
    expected = expected_collectives(mesh, case.heads_kv, case.layers)["fw"]
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        (forward,) = result["fw"]
        assert_well_formed(forward, f"rank {rank} forward")
        got = {k: forward[k] for k in expected}
        assert got == expected, f"rank {rank}: forward graph collectives {got}, expected {expected}"


@pytest.mark.parametrize("mesh, case", STRUCTURE_MODELS)
def test_backward_graph_collectives_and_no_qkv_reexchange(cp_world, mesh, case):
    """Per layer and head group 3 Ulysses all-to-alls (dout in, dq and dkv back) and 2R-1
    ring transfers; every one of them carries data derived from the incoming gradients
    (tangents): no Ulysses exchange re-sends q, k or v, and no transfer was moved out of the
    backward."""
    expected = expected_collectives(mesh, case.heads_kv, case.layers)["bw"]
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        (backward,) = result["bw"]
        assert_well_formed(backward, f"rank {rank} backward")
        got = {k: backward[k] for k in expected}
        assert got == expected, f"rank {rank}: backward graph collectives {got}, expected {expected}"
        assert backward["ulysses_from_tangents"] == backward["ulysses"], (
            f"rank {rank}: {backward['ulysses'] - backward['ulysses_from_tangents']} Ulysses "
            "exchanges in the backward carry only forward data (a q/k/v re-exchange)")
        assert backward["ring_from_tangents"] == backward["ring"], (
            f"rank {rank}: ring transfers in the backward that carry no gradient")


@pytest.mark.parametrize("mesh, case", STRUCTURE_MODELS)
def test_report_table_counts_the_graphs_collectives(cp_world, mesh, case):
    """matches.md announces, summed over its rows, the collectives the AOT graphs hold."""
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        (forward,), (backward,) = result["fw"], result["bw"]
        in_graphs = {"fw_all_to_all": forward["ulysses"], "fw_ring": forward["ring"],
                     "fw_all_reduce": forward["all_reduce"], "bw_all_to_all": backward["ulysses"],
                     "bw_ring": backward["ring"]}
        announced = table_counts(result["texts"]["matches.md"])
        assert announced == in_graphs, f"rank {rank}: table {announced}, graphs {in_graphs}"


@pytest.mark.parametrize("mesh, case", STRUCTURE_MODELS)
def test_dump_dir_holds_every_ranks_graph_files(cp_world, mesh, case):
    """dump_dir/rank<R>/graph_0/ has the code before and after the rewrite, the AOT forward
    and backward graphs and the table, for every rank; their content is the rewrite's."""
    results = compile_world(cp_world, mesh).values(case.id)
    size = mesh[0] * mesh[1]
    expected = sorted(f"rank{r}/graph_0/{name}" for r in range(size) for name in DUMP_FILES)
    layers = case.layers
    for rank, result in enumerate(results):
        assert result["dumped"] == expected, f"rank {rank} sees {result['dumped']}"
        texts = result["texts"]
        assert texts["before_rewrite.py"].count("torch.ops.hcp.varlen_attention(") == layers
        assert "torch.ops.hcp.varlen_attention(" not in texts["after_rewrite.py"]
        assert texts["after_rewrite.py"].count("hierarchical_varlen_attention(") == layers
        assert texts["after_rewrite.py"].count("checked_layout(") == 1  # one cu_seqlens
        rows = [line for line in texts["matches.md"].splitlines() if line.startswith("| layers.")]
        assert [row.split("|")[1].strip() for row in rows] == [f"layers.{i}" for i in range(layers)]
        for graph, summary in (("aot_forward.py", result["fw"][0]), ("aot_backward.py", result["bw"][0])):
            counted = text_collectives(texts[graph], *result["group_names"])
            assert counted["other_group"] == 0
            assert (counted["ulysses"], counted["ring"], counted["all_reduce"]) == (
                summary["ulysses"], summary["ring"], summary["all_reduce"]), f"rank {rank} {graph}"


@pytest.mark.parametrize("mesh, case", STRUCTURE_MODELS)
def test_ring_steps_merge_and_sum_in_one_op_each(cp_world, mesh, case):
    """Each ring step after the first merges its block's output into the running one (forward)
    and adds its block's dq to the running sum and its section's dKV to the accumulator that
    arrived (backward) in one ``hcp::merge_step`` / ``hcp::accumulate_step`` each. As torch
    expressions, the inner compiler fused a ring's merges (and its dq sums) into one region
    that read every step's block result at the end, and so kept them all alive until the
    last step (kernels/merge.py)."""
    ring = mesh[1]
    per_layer = groups_of(mesh, case.heads_kv) * (ring - 1)
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        texts = result["texts"]
        merges = texts["aot_forward.py"].count("torch.ops.hcp.merge_step.default(")
        sums = texts["aot_backward.py"].count("torch.ops.hcp.accumulate_step.default(")
        assert (merges, sums) == (per_layer * case.layers, 2 * per_layer * case.layers), f"rank {rank}"


# --------------------------------------------------------------------------------------------
# torch's own varlen_attn, the logsumexp output
# --------------------------------------------------------------------------------------------

def reference_lse(q: torch.Tensor, k: torch.Tensor, lengths, *, causal: bool,
                  window: tuple[int, int], scale: float | None) -> torch.Tensor:
    """Float64 logsumexp of the scaled scores over each query's visible keys, ``[Hq, T]``;
    -inf for a query that sees no key."""
    q, k = q.double(), k.double()
    heads_q, heads_kv, dim = q.shape[1], k.shape[1], q.shape[2]
    scale = dim**-0.5 if scale is None else scale
    lse = torch.full((heads_q, q.shape[0]), float("-inf"), dtype=torch.float64)
    cu = cu_seqlens(lengths).tolist()
    for start, end in zip(cu, cu[1:]):
        mask = document_mask(end - start, end - start, causal, window)
        for h in range(heads_q):
            scores = q[start:end, h] @ k[start:end, h // (heads_q // heads_kv)].T * scale
            lse[h, start:end] = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=1)
    return lse


TORCH_VARLEN = params(torch_varlen_cases)


@pytest.mark.parametrize("mesh, case", TORCH_VARLEN)
def test_torch_varlen_attn_model_matches_reference(cp_world, mesh, case):
    """varlen_attn has no CPU kernel; compiled with backend="hcp" it runs as hierarchical
    CP: output, gradients and the lse shard against the float64 reference."""
    batch = case.reference_case()
    reference = expected_for(batch)
    x = batch.inputs()
    lse = reference_lse(x["q"], x["k"], batch.lengths, **batch.mask_args)
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        index = result["global_index"]
        for name in RESULTS:
            got = result[name]
            assert_matches(got, local_rows(reference[name], index), f"rank {rank} {name}")
            assert (got[index < 0] == 0).all(), f"rank {rank}: {name} is not zero at the pads"
        got_lse = result["lse"]
        assert got_lse.shape == (batch.heads_q, index.numel()), f"rank {rank}: lse {got_lse.shape}"
        assert_matches(got_lse[:, index >= 0], lse[:, index[index >= 0]], f"rank {rank} lse")
        assert torch.isneginf(got_lse[:, index < 0]).all(), f"rank {rank}: lse at the pads is not -inf"


@pytest.mark.parametrize("mesh, case", TORCH_VARLEN)
def test_used_lse_adds_one_ulysses_exchange(cp_world, mesh, case):
    """The lse comes back through one more Ulysses all-to-all per head group in the forward;
    the backward is unchanged (the lse has no gradient)."""
    expected = expected_collectives(mesh, case.heads_kv, layers=1, lse_layers=1)
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        (forward,), (backward,) = result["fw"], result["bw"]
        assert_well_formed(forward, f"rank {rank} forward")
        assert_well_formed(backward, f"rank {rank} backward")
        for graph, summary in (("fw", forward), ("bw", backward)):
            got = {k: summary[k] for k in ("ulysses", "all_reduce")}
            want = {k: expected[graph][k] for k in ("ulysses", "all_reduce")}
            assert got == want, f"rank {rank} {graph}: {got}, expected {want}"


# --------------------------------------------------------------------------------------------
# explain() and the decorator's scoping on the mesh
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh, case", params(explain_cases))
def test_explain_reports_only_marked_layers_without_running(cp_world, mesh, case):
    ulysses, ring = mesh
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        assert result["graphs"] == 1
        assert result["paths"] == ["marked.0", "marked.1"], f"rank {rank}: {result['paths']}"
        assert result["kernels"] == ["torch", "torch"]
        assert result["local_tokens"] == [result["plan_local_tokens"]] * 2
        assert result["checked"] == [True, False]  # one layout check for the shared cu_seqlens
        # Explanation.batch: the plan's summary for the heads of the model's attention
        assert result["batch"] == result["summary"] != result["default_summary"], f"rank {rank}"
        # the unmarked layer keeps its single-device call; the marked ones are rewritten
        assert result["before"].count("torch.ops.hcp.varlen_attention(") == 3
        assert result["after"].count("torch.ops.hcp.varlen_attention(") == 1
        assert result["after"].count("hierarchical_varlen_attention(") == 2
        assert set(result["runs"].values()) == {0}, f"rank {rank}: explain ran the model: {result['runs']}"
        (table,) = result["tables"]
        assert f"{ulysses} x {ring}" in table and "unmarked" not in table
        assert result["text"].startswith("graph 0: 2 attention node(s) rewritten\n")
        # the row of the layer that carries the check (the first), its heads as reported
        row = next(line for line in table.splitlines() if line.startswith("| marked.0"))
        heads_kv = int(row.split("|")[3].strip().split("/")[1])
        expected = expected_collectives(mesh, heads_kv, layers=1)
        assert (f"{expected['fw']['ulysses']} all_to_all, {expected['fw']['ring']} ring, "
                f"{expected['fw']['all_reduce']} all_reduce (check)") in row


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------

def test_heads_not_divisible_by_ulysses_fails_at_compile_time_on_every_rank(cp_world):
    case = HeadsNotDivisibleCase()
    for rank, record in enumerate(compile_world(cp_world, ERROR_MESH).per_rank(case.id)):
        assert record.raised_instance_of(UnsupportedAttention), f"rank {rank}: {record.describe()}"
        for part in ("3 query heads cannot be split over ulysses=2",
                     "choose a mesh whose ulysses size divides the number of query heads"):
            assert part in record.message, f"rank {rank}: {part!r} not in {record.message!r}"


BAD_BATCHES = [pytest.param(mesh, case, phase, id=f"{mesh_id(mesh)}-{phase}")
               for mesh in COMPILE_MESHES for case in error_cases(mesh)
               if isinstance(case, BadBatchCase) for phase in case.phases]


@pytest.mark.parametrize("mesh, case, phase", BAD_BATCHES)
def test_batch_not_fitting_the_shards_raises_on_every_rank(cp_world, mesh, case, phase):
    """The compiled layout check is agreed over the mesh: one rank's (or every rank's)
    wrong cu_seqlens makes every rank raise, no rank hangs, and the same compiled graph
    then runs a valid batch again, with no recompilation."""
    expected_out = expected_for(BadBatchCase.batch)["out"]
    for rank, result in enumerate(compile_world(cp_world, mesh).values(case.id)):
        outcome = result[phase]
        assert "hcp_compile.validation.InputError" in outcome["types"], f"rank {rank}: {outcome}"
        assert "the batch check failed on a rank of the context-parallel mesh" in outcome["message"], \
            f"rank {rank}: {outcome}"
        assert result["graphs"] == 1, f"rank {rank}: compiled {result['graphs']} graphs"
        assert_matches(result["first"], local_rows(expected_out, result["global_index"]),
                       f"rank {rank} out of the valid batch")
        # the same graph on the same inputs in the same process: bit-equal is promised
        torch.testing.assert_close(result["after"], result["first"], rtol=0, atol=0)


def test_graph_without_ring_steps_on_some_ranks_only_raises_on_every_rank(cp_world):
    """A rank whose graph without ring steps could not be built runs the full graph while the
    others run theirs: the agreed check fails on every rank instead of the full graph's ring
    hops waiting; that rank warns why, and a batch with a ring section then runs on every rank
    (its full graph, against the float64 reference)."""
    expected = expected_for(DocsCase("mixed", 4, 2, True))
    results = compile_world(cp_world, ERROR_MESH).values(RefusedVariantCase.id)
    for rank, result in enumerate(results):
        outcome = result["no-ring"]
        assert "hcp_compile.validation.InputError" in outcome["types"], f"rank {rank}: {outcome}"
        assert "built for batches that exchange different things" in outcome["message"], f"rank {rank}: {outcome}"
        assert len(result["warnings"]) == (rank == len(results) - 1), f"rank {rank}: {result['warnings']}"
        assert_compiled_rank_matches(result, "after", expected, rank, against_eager=False)


def test_ranks_compiled_with_different_recompute_exchange_raise_on_every_rank(cp_world):
    (case,) = [c for c in error_cases(ERROR_MESH) if isinstance(c, OptionsDifferCase)]
    for rank, outcome in enumerate(compile_world(cp_world, ERROR_MESH).values(case.id)):
        assert "hcp_compile.validation.InputError" in outcome["types"], f"rank {rank}: {outcome}"
        assert "different batches or options" in outcome["message"], f"rank {rank}: {outcome}"


# --------------------------------------------------------------------------------------------
# one Inductor-compiled run
# --------------------------------------------------------------------------------------------

def inductor_world(cp_world):
    return cp_world(INDUCTOR_MESH, suite=INDUCTOR_SUITE, deadline_s=INDUCTOR_DEADLINE_S)


@pytest.mark.parametrize("index", range(len(INDUCTOR_CASE.docs)),
                         ids=lambda i: f"{mesh_id(INDUCTOR_MESH)}-{INDUCTOR_CASE.docs[i]}")
def test_inductor_compiled_matches_reference_and_eager_cp(cp_world, index):
    batch = INDUCTOR_CASE.batches()[index]
    reference = expected_for(batch)
    for rank, result in enumerate(inductor_world(cp_world).values(INDUCTOR_CASE.id)):
        assert_compiled_rank_matches(result, index, reference, rank)
        assert result["graphs_after"] == [1, 1, 1], f"rank {rank}: {result['graphs_after']}"


def test_inductor_graphs_hold_the_rewritten_collectives(cp_world):
    """With Inductor the rewrite runs as its pre-grad pass: the graphs Inductor compiles
    (dumped by rank 0; the other ranks compile through Inductor's caches) hold the Ulysses
    and ring exchanges of one layer, and the graph for the batch that exchanges nothing only
    the batch check's agreement."""
    expected = expected_collectives(INDUCTOR_MESH, INDUCTOR_CASE.heads_kv, layers=1)
    results = inductor_world(cp_world).values(INDUCTOR_CASE.id)
    assert ["texts" in result for result in results] == [r == 0 for r in range(len(results))]
    for rank, result in enumerate(results[:1]):  # the dump of rank 0
        texts = result["texts"]
        assert {"graph_0/before_rewrite.py", "graph_0/after_rewrite.py", "graph_0/matches.md",
                "graph_0/aot_forward.py", "graph_0/aot_backward.py"} <= set(texts), sorted(texts)
        assert "hierarchical_varlen_attention(" in texts["graph_0/after_rewrite.py"]
        for graph, name in (("fw", "graph_0/aot_forward.py"), ("bw", "graph_0/aot_backward.py")):
            counted = text_collectives(texts[name], *result["group_names"])
            got = {k: counted[k] for k in ("ulysses", "ring", "all_reduce")}
            assert got == expected[graph], f"rank {rank} {name}: {got}, expected {expected[graph]}"
            assert counted["other_group"] == 0
        # the graph of the batch that exchanges nothing: the batch check's agreement alone
        for graph, name in (("fw", "graph_1/aot_forward.py"), ("bw", "graph_1/aot_backward.py")):
            counted = text_collectives(texts[name], *result["group_names"])
            got = {k: counted[k] for k in ("ulysses", "ring", "all_reduce")}
            assert got == {**expected[graph], "ulysses": 0, "ring": 0}, f"rank {rank} {name}: {got}"


def test_graph_counts_cover_grouped_and_single_group_heads():
    """The tests above that count every kind of collective in the graphs (the structure
    models, the Inductor run) see both a layer with head groups and one with a single group
    (docs/design.md §3.6), so expected_collectives' G is really checked."""
    counted = [p.values[:2] for p in STRUCTURE_MODELS] + [(INDUCTOR_MESH, INDUCTOR_CASE)]
    assert {groups_of(mesh, case.heads_kv) for mesh, case in counted} == {1, HEAD_GROUPS}
