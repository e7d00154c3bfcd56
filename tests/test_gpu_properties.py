"""The GPU property suite: hypothesis draws packed batches (``hcp_compile.testing.strategies``)
and runs them through every kernel of the registry on one device, and through context
parallelism on meshes 2x1, 1x2 and 2x2 (ranks sharing the one GPU over gloo) with every
placement of the registry, eager and compiled; every result against the float64 reference under
the bound of ``hcp_compile.testing.bounds``.

    python -m pytest -q -m gpu tests/test_gpu_properties.py                            # bounded
    HCP_PROPERTY_EXAMPLES=100 python -m pytest -q -m gpu tests/test_gpu_properties.py  # a soak
    python -m pytest -q -m gpu tests/test_gpu_properties.py --hypothesis-seed=3        # other draws
    HCP_PROPERTY_KERNELS=cudnn python -m pytest -q -m gpu tests/test_gpu_properties.py # one kernel

A failure prints its cases' JSON as a reproducer: ``HCP_PROPERTY_REPLAY='<json>' python -m pytest
'<test id>'`` runs that test on them alone (hypothesis also prints ``@reproduce_failure``).
The same properties run on CPU with tiny batches in the default suite (the ``cpu`` tests), with
the tests of the harness itself: a wrong result is caught, the bound's arithmetic, the
strategies' reach, the reference, and worlds that die or hang.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from hcp_compile.batch import schedule
from hcp_compile.batch.placements import PLACEMENTS
from hcp_compile.testing import bounds, runs
from hcp_compile.testing.cases import PropertyCase, Result, claim, make_batch
from hcp_compile.testing.profiles import PROFILES
from hcp_compile.testing.reference import reference_with_grads
from hcp_compile.testing.scaled_reference import reference, sdpa_baseline
from hcp_compile.testing.served import ServedWorld
from hcp_compile.testing.strategies import batches_of, code_thresholds, every_kernel, property_cases
from test_layers import ROOT, graph

CP_MESHES = ((2, 1), (1, 2), (2, 2))  # (ulysses, ring)
CPU_CP_MESHES = ((2, 1), (1, 2))  # 2x2 (4 processes on the test machine's 2 cores): test_cp_attention.py
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
EXAMPLES_ENV, REPLAY_ENV, KERNELS_ENV = "HCP_PROPERTY_EXAMPLES", "HCP_PROPERTY_REPLAY", "HCP_PROPERTY_KERNELS"
# examples per test (a kernel, a mesh) and batches per CP example (one compiled graph serves them)
EXAMPLES = {"cpu": {"single": 4, "cp": 1}, "cuda": {"single": 8, "cp": 2}}
CP_BATCHES = {"cpu": 1, "cuda": 3}
CP_DEADLINE_S = {"cpu": 240, "cuda": 900}  # one CP example: compiles of every placement included


def property_settings(device: str, kind: str) -> settings:
    """Bounded runs: ``EXAMPLES`` (on CUDA ``$HCP_PROPERTY_EXAMPLES``), no deadline per example
    (compiles), no shrinking (each step would compile again; the reproducer is the full case)."""
    examples = EXAMPLES[device][kind]
    if device == "cuda":
        examples = int(os.environ.get(EXAMPLES_ENV, examples))
    return settings(max_examples=examples, deadline=None, print_blob=True,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


def selected_kernels() -> tuple[str, ...]:
    """"auto" and the registry's kernels, or those of ``$HCP_PROPERTY_KERNELS``."""
    chosen = tuple(k for k in os.environ.get(KERNELS_ENV, "").split(",") if k)
    unknown = set(chosen) - set(every_kernel())
    assert not unknown, f"{KERNELS_ENV}: unknown {sorted(unknown)}; choose from {every_kernel()}"
    return chosen or every_kernel()


def skip_unless_it_runs(kernel: str, device: str) -> None:
    """Skip a kernel that takes no unwindowed call of the device's profile (flash and cudnn on
    CPU; cudnn without its package), with its reason."""
    profile = PROFILES[device]
    reasons = {claim(kernel, PropertyCase((1,), 2, 1, head_dim, dtype, True, (-1, -1), None, kernel, (1, 1), 0),
                     device) for dtype in profile.dtypes for head_dim in profile.head_dims}
    if None not in reasons:
        pytest.skip(f"{kernel} takes no call on {device}: {sorted(reasons)[0]}")


# --------------------------------------------------------------------------- reproducers


def drawn_or_replayed(data: st.DataObject, first: st.SearchStrategy[PropertyCase], device: str,
                      batches: int = 1, kernel: str | None = None) -> list[PropertyCase]:
    """The cases of one example: ``$HCP_PROPERTY_REPLAY``'s (a test of another kernel or mesh
    skips them), else a case of ``first`` and ``batches - 1`` more of its configuration."""
    replay = os.environ.get(REPLAY_ENV)
    if replay:
        cases = [PropertyCase.from_json(json.dumps(case)) for case in json.loads(replay)]
        if kernel not in (None, cases[0].kernel):
            pytest.skip(f"the replayed cases are of kernel {cases[0].kernel}")
        return cases
    cases = [data.draw(first, label="case")]
    cases += [data.draw(batches_of(cases[0], device), label=f"batch {i}") for i in range(1, batches)]
    return cases


def replay_command(cases: list[PropertyCase]) -> str:
    cases_json = "[" + ",".join(case.to_json() for case in cases) + "]"
    test_id = os.environ.get("PYTEST_CURRENT_TEST", "tests/test_gpu_properties.py").split(" ")[0]
    return f"{REPLAY_ENV}={shlex.quote(cases_json)} python -m pytest -q -p no:cacheprovider {shlex.quote(test_id)}"


def assert_passed(cases: list[PropertyCase], verdicts: dict[str, bounds.Verdict]) -> None:
    failed = {label: verdict for label, verdict in verdicts.items() if not verdict.passed}
    assert not failed, "\n".join(
        [*(f"case {i}: {case.describe()}" for i, case in enumerate(cases)),
         *(f"{label}: {verdict.describe()}" for label, verdict in failed.items()),
         f"reproduce: {replay_command(cases)}"])


# --------------------------------------------------------------------------- one device


def check_single_device(cases: list[PropertyCase], device: str) -> None:
    for case in cases:
        batch = make_batch(case, torch.device(device))
        result = runs.single_device(batch, case)
        verdicts = runs.judge_runs(batch, case, {f"kernel {case.kernel}": result}, device)
        del batch, result
        if device == "cuda":  # the CP tests' ranks share this GPU: hand back what the cache holds
            torch.cuda.empty_cache()
        assert_passed([case], verdicts)


def single_device_property(device: str, kernel: str, data: st.DataObject) -> None:
    skip_unless_it_runs(kernel, device)
    cases = drawn_or_replayed(data, property_cases(device, (1, 1), (kernel,)), device, kernel=kernel)
    check_single_device(cases, device)


@pytest.mark.parametrize("kernel", selected_kernels())
@property_settings("cpu", "single")
@given(data=st.data())
def test_single_device_kernel_matches_reference_cpu(kernel, data):
    single_device_property("cpu", kernel, data)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("kernel", selected_kernels())
@property_settings("cuda", "single")
@given(data=st.data())
def test_single_device_kernel_matches_reference_gpu(kernel, data):
    single_device_property("cuda", kernel, data)


# --------------------------------------------------------------------------- context parallelism


@pytest.fixture(scope="module")
def served_worlds():
    """``get(mesh, device)``: a served world of the mesh's ranks on the device, started at the
    first ask and again after one ended. One world at a time (on CUDA they share the GPU's
    memory), closed after the module."""
    started: dict[tuple, ServedWorld] = {}

    def get(mesh: tuple[int, int], device: str) -> ServedWorld:
        world = started.get((mesh, device))
        if world is None or not world.alive:
            for other in started.values():
                other.close()
            world = started[(mesh, device)] = ServedWorld(*mesh, "hcp_compile.testing.runs:serve_cp_request", device)
        return world

    yield get
    for world in started.values():
        world.close()


def check_context_parallel(cases: list[PropertyCase], device: str, world: ServedWorld,
                           fault_ulps: float = 0.0) -> None:
    request = runs.CPRequest(tuple(cases), device, fault_ulps)
    verdicts = world.ask(request, CP_DEADLINE_S[device])[0]  # rank 0 judges
    labels = {f"{i} {mode} {placement}" for i in range(len(cases))
              for mode in runs.CP_MODES for placement in PLACEMENTS}
    assert labels <= set(verdicts), f"runs missing: {sorted(labels - set(verdicts))}"
    assert_passed(cases, verdicts)


def cp_property(device: str, mesh: tuple[int, int], data: st.DataObject, served_worlds) -> None:
    cases = drawn_or_replayed(data, property_cases(device, mesh, selected_kernels()), device, CP_BATCHES[device])
    if cases[0].mesh != mesh:  # a replay of another mesh's test
        pytest.skip(f"the replayed cases are of mesh {cases[0].mesh}")
    check_context_parallel(cases, device, served_worlds(mesh, device))


@pytest.mark.parametrize("mesh", CPU_CP_MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
@property_settings("cpu", "cp")
@given(data=st.data())
def test_context_parallel_matches_reference_cpu(mesh, data, served_worlds):
    cp_property("cpu", mesh, data, served_worlds)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("mesh", CP_MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
@property_settings("cuda", "cp")
@given(data=st.data())
def test_context_parallel_matches_reference_gpu(mesh, data, served_worlds):
    cp_property("cuda", mesh, data, served_worlds)


# --------------------------------------------------------------------------- the harness (CPU)


CPU_CASE = PropertyCase((5, 0, 1, 9), 4, 2, 8, "float32", True, (-1, -1), None, "torch", (1, 1), 11)


def test_a_wrong_result_fails_with_a_reproducer_that_replays_it(monkeypatch):
    """A fault of 1000 ulps in one element of dk fails a case on one device (the property
    test itself) and under CP (every placement and mode); the printed reproducer runs the
    same case again, which passes without the fault."""
    real = runs.single_device

    def faulty(batch, case):
        result = real(batch, case)
        dk = result.dk.clone()
        dk.view(-1)[0] += 1000 * bounds.ulp_scale(dk, case.torch_dtype)
        return Result(result.out, result.dq, dk, result.dv)

    monkeypatch.setenv(REPLAY_ENV, "[" + CPU_CASE.to_json() + "]")
    monkeypatch.setattr(runs, "single_device", faulty)
    with pytest.raises(AssertionError, match="dk error") as failure:
        test_single_device_kernel_matches_reference_cpu(kernel="torch")
    command = shlex.split(str(failure.value).split("reproduce: ")[1].splitlines()[0])
    assert command[0] == f"{REPLAY_ENV}=[{CPU_CASE.to_json()}]" and command[1:4] == ["python", "-m", "pytest"]
    monkeypatch.setattr(runs, "single_device", real)
    test_single_device_kernel_matches_reference_cpu(kernel="torch")


def test_a_wrong_result_under_cp_fails_every_run(served_worlds):
    case = PropertyCase((5, 0, 1, 9, 30), 4, 2, 8, "float32", True, (-1, -1), None, "torch", (1, 2), 3)
    world = served_worlds((1, 2), "cpu")  # the last CP property test's world
    with pytest.raises(AssertionError) as failure:
        check_context_parallel([case], "cpu", world, fault_ulps=1000)
    failed = {line.split(":")[0].strip() for line in str(failure.value).splitlines()
              if re.match(r"\s*0 \w+ \w+: dk error", line)}
    assert failed == {f"0 {mode} {placement}" for mode in runs.CP_MODES for placement in PLACEMENTS}, failure.value
    assert world.alive  # a wrong result is a verdict, not a lost world


def results(out, dq, dk, dv, pad_max: float = 0.0) -> Result:
    return Result(out, dq, dk, dv, pad_max=pad_max)


def test_bound_is_a_multiple_of_sdpas_error_plus_a_floor_of_ulps():
    expected = results(*(torch.full((4, 2, 8), 2.0, dtype=torch.float64) for _ in range(4)))
    baseline = results(*(torch.full((4, 2, 8), 2.0 + 0.01, dtype=torch.float64) for _ in range(4)))
    ulp = torch.finfo(torch.bfloat16).eps * 2.0
    bound = bounds.ERROR_FACTOR * 0.01 + bounds.FLOOR_ULPS * ulp + bounds.ACCUMULATION_ULPS * torch.finfo().eps * 2.0
    just_inside = results(*(torch.full((4, 2, 8), 2.0 + 0.99 * bound, dtype=torch.float64) for _ in range(4)))
    verdict = bounds.judge(just_inside, expected, baseline, torch.bfloat16)
    assert verdict.passed and math.isclose(verdict.bounds["dq"], bound, rel_tol=1e-9)
    assert 0.98 < verdict.ratio < 1
    dk = expected.dk.clone()
    dk[1, 1, 3] += 1.01 * bound
    verdict = bounds.judge(results(expected.out, expected.dq, dk, expected.dv), expected, baseline, torch.bfloat16)
    assert not verdict.passed and verdict.problems[0].startswith("dk error")


def test_nan_pads_and_a_far_baseline_fail():
    expected = results(*(torch.ones(3, 1, 4, dtype=torch.float64) for _ in range(4)))
    tensors = (expected.out, expected.dq, expected.dk, expected.dv)
    nan_out = expected.out.clone()
    nan_out[0, 0, 0] = math.nan
    verdict = bounds.judge(results(nan_out, *tensors[1:]), expected, expected, torch.float32)
    assert verdict.problems == ("out has NaN/Inf",) and verdict.ratio == math.inf
    padded = bounds.judge(results(*tensors, pad_max=7.0), expected, expected, torch.float32)
    assert not padded.passed and "pad rows" in padded.problems[0]
    far = results(*(t + 1 for t in tensors))
    assert not bounds.judge(far, expected, None, torch.float32).passed  # the baseline's own check
    capped = bounds.judge(expected, expected, far, torch.float32)  # a far baseline widens no bound
    ulps = bounds.ERROR_FACTOR * bounds.BASELINE_MAX_ULPS + bounds.FLOOR_ULPS + bounds.ACCUMULATION_ULPS
    assert capped.bounds["out"] == ulps * torch.finfo(torch.float32).eps


def test_the_library_imports_no_testing_module_and_only_the_strategies_import_hypothesis():
    """``import hcp_compile`` stays free of the testing modules and of hypothesis (a test
    dependency)."""
    importers = {name for name, targets in graph().items() if not name.startswith("hcp_compile.testing")
                 and any(t.startswith("hcp_compile.testing") for t in targets)}
    assert not importers
    hypothesis_users = {path.relative_to(ROOT).as_posix() for path in (ROOT / "hcp_compile").rglob("*.py")
                        if re.search(r"^\s*(from|import) hypothesis", path.read_text(), re.M)}
    assert hypothesis_users == {"hcp_compile/testing/strategies.py"}


# --------------------------------------------------------------------------- the strategies


@pytest.mark.parametrize("mesh", ((1, 1), *CP_MESHES), ids=lambda m: f"{m[0]}x{m[1]}")
@settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_gpu_cases_are_valid_for_their_mesh_and_round_trip(mesh, data):
    """The CUDA profile's cases (drawn only: nothing runs): within the profile's sizes, heads
    that the mesh divides, a kernel that claims the case, and a reproducer JSON that gives the
    same case back."""
    case = data.draw(property_cases("cuda", mesh, every_kernel()))
    profile, kind = PROFILES["cuda"], "single" if mesh == (1, 1) else "cp"
    assert 0 < case.tokens <= profile.max_tokens[kind] and len(case.lengths) <= profile.max_docs + 1
    assert case.tokens * case.heads_q * case.head_dim <= profile.max_elements[kind]
    assert case.heads_q % mesh[0] == 0 and case.heads_q % case.heads_kv == 0
    assert claim(case.kernel, case, "cuda") is None and case.mesh == mesh
    if case.kernel == "torch":
        assert case.tokens <= profile.torch_max_tokens
    assert PropertyCase.from_json(case.to_json()) == case


REACHES = {  # what the GPU cases must cover (issue 50), each found within a few hundred draws
    "empty and 1-token documents": lambda c: {0, 1} <= set(c.lengths),
    "a batch of 1-token and empty documents only": lambda c: max(c.lengths) == 1 and 0 in c.lengths,
    "odd lengths at a flex block edge": lambda c: {127, 129} & set(c.lengths),
    "lengths at the dense kernel's stripe": lambda c: {1023, 1025} & set(c.lengths),
    "lengths at the dense kernel's first segment": lambda c: {2047, 2048, 2049} & set(c.lengths),
    "a long document": lambda c: max(c.lengths) > 16384,
    "GQA 8": lambda c: c.heads_q == 8 * c.heads_kv,
    "MHA": lambda c: c.heads_q == c.heads_kv,
    "Hkv below ulysses": lambda c: c.heads_kv < c.mesh[0],
    "head dim 256": lambda c: c.head_dim == 256,
    "head dim 96": lambda c: c.head_dim == 96,
    "fp16": lambda c: c.dtype == "float16",
    "bf16": lambda c: c.dtype == "bfloat16",
    "full mask": lambda c: not c.causal and c.window == (-1, -1),
    "causal sliding window": lambda c: c.causal and c.window[0] >= 0,
    "window without causal": lambda c: not c.causal and c.window != (-1, -1),
    "a layout for the window on a ring": lambda c: c.layout_window and c.mesh[1] > 1,
    "a gathered step": lambda c: schedule.gathers(c.scheme, c.causal, c.window, c.mesh[1], c.kernel),
    "an explicit scale": lambda c: c.scale is not None,
}


@pytest.mark.parametrize("what", sorted(REACHES))
def test_gpu_cases_reach(what):
    mesh = {"Hkv below ulysses": (2, 2), "a layout for the window on a ring": (1, 2),
            "a gathered step": (1, 2)}.get(what, (2, 1))
    find(property_cases("cuda", mesh, every_kernel()), REACHES[what],
         settings=settings(max_examples=2000, database=None, phases=(Phase.generate,),
                           suppress_health_check=list(HealthCheck)))


@pytest.mark.parametrize("kernel", every_kernel())
def test_gpu_cp_cases_draw_every_kernel_that_takes_them(kernel):
    skip_unless_it_runs(kernel, "cuda")  # this machine's answer: cudnn needs its package and a GPU
    find(property_cases("cuda", (2, 1), every_kernel()), lambda c: c.kernel == kernel,
         settings=settings(max_examples=2000, database=None, phases=(Phase.generate,),
                           suppress_health_check=list(HealthCheck)))


def test_code_thresholds_and_their_neighbours_are_drawn_under_cp():
    """``code_thresholds`` holds the code's edges (flex blocks, the dense stripe and grid,
    the ring's length, each times 2R), and the "edge" component draws them +-1."""
    edges = code_thresholds(2)
    assert {128, 256, 384, 1024, 2048} <= set(edges) and all(4 * e in edges for e in (128, 1024))
    find(property_cases("cuda", (1, 2), every_kernel()), lambda c: any(length - 1 in edges or length + 1 in edges
                                                                         for length in c.lengths if length > 300),
         settings=settings(max_examples=2000, database=None, phases=(Phase.generate,),
                           suppress_health_check=list(HealthCheck)))


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cp_kernel_is_drawn_among_those_named(data):
    case = data.draw(property_cases("cpu", (2, 1), ("flex", "dense")))
    assert case.kernel in ("flex", "dense")


def test_a_kernel_that_claims_no_case_is_unsatisfiable():
    @settings(max_examples=5, database=None, suppress_health_check=list(HealthCheck))
    @given(property_cases("cpu", (1, 1), ("flash",)))
    def drawn(case):
        pass

    with pytest.raises(Unsatisfiable):
        drawn()


MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0)), (False, (2, 5)), (False, (-1, 4)), (True, (0, 2))]


def test_scaled_reference_and_baseline_match_the_loop_reference():
    """The scaled reference (documents of one length together, query rows in chunks of a few
    rows) and the SDPA baseline against ``hcp_compile.testing.reference`` (a loop over
    documents and heads), float32 inputs."""
    lengths = (0, 1, 2, 7, 13, 7, 30, 1)
    cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
    for index, ((causal, window), heads_kv) in enumerate(zip(MASKS, (1, 2, 4, 1, 2, 4))):
        case = PropertyCase(lengths, 4, heads_kv, 8, "float32", causal, window, None if index % 2 else 0.3,
                            "torch", (1, 1), index)
        batch = make_batch(case, torch.device("cpu"))
        expected = reference_with_grads(batch.q, batch.k, batch.v, batch.dout, cu, cu, causal=causal,
                                        window=window, scale=case.softmax_scale)
        for result in (reference(batch, case, chunk_elements=64), sdpa_baseline(batch, case, chunk_elements=64)):
            for name in ("out", "dq", "dk", "dv"):
                torch.testing.assert_close(getattr(result, name).double(), expected[name], atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{case.describe()} {name}: {m}")


# --------------------------------------------------------------------------- served worlds


def raise_on_rank_1(world, request: str) -> dict:
    """A served world's handler: rank 1 raises on "raise"; the others wait in a collective."""
    import torch.distributed as dist

    if request == "raise" and world.rank == 1:
        raise RuntimeError("rank 1 fails here")
    dist.barrier()
    return {"rank": world.rank}


def sleep_on_rank_0(world, request: float) -> dict:
    import time

    if world.rank == 0:
        time.sleep(request)
    return {}


def test_a_served_world_that_loses_a_rank_fails_the_request_and_ends():
    world = ServedWorld(2, 1, "test_gpu_properties:raise_on_rank_1")
    try:
        assert world.ask("go", 60) == [{"rank": 0}, {"rank": 1}]
        with pytest.raises(AssertionError, match="rank 1 raised builtins.RuntimeError: rank 1 fails here"):
            world.ask("raise", 60)
        assert not world.alive and all(p.exitcode is not None for p in world.procs)
    finally:
        world.close()


def test_a_served_world_past_its_deadline_fails_the_request_and_ends():
    world = ServedWorld(1, 1, "test_gpu_properties:sleep_on_rank_0")
    try:
        with pytest.raises(AssertionError, match="left no result"):
            world.ask(60.0, 2)
        assert not world.alive and all(p.exitcode is not None for p in world.procs)
    finally:
        world.close()
