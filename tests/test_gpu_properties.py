"""``scripts/gpu_properties.py`` (the GPU property suite): on CUDA (``-m gpu``) a bounded run
that must pass; on CPU its phases run and pass on tiny batches, a wrong result is caught with a
reproducer that ``--replay`` runs again, the bound's arithmetic, and the GPU profile's random
cases cover the mixtures, thresholds, heads, dtypes and masks the suite must."""

from __future__ import annotations

import json
import math
import os
import shlex
from collections import Counter
from pathlib import Path

import pytest
import torch


from examples._common import Result
from scripts import gpu_properties as props


def run_suite(tmp_path: Path, capfd, monkeypatch, *args: str, device: str = "cpu") -> tuple[int, dict, str]:
    """``main`` on ``device`` (its worlds are processes of their own): exit code, the JSON
    summary it writes to ``$OUT`` and what it and its processes printed."""
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = props.main(["--device", device, *args])
    output = "".join(capfd.readouterr())
    assert (out / "gpu_properties.txt").read_text() in output
    return code, json.loads((out / "gpu_properties.json").read_text()), output


def test_single_device_and_cp_phases_run_and_pass(tmp_path, capfd, monkeypatch):
    code, summary, output = run_suite(tmp_path, capfd, monkeypatch, "--phases", "single,2x1", "--cases", "1")
    assert code == 0, output
    totals = summary["totals"]
    assert totals["failed"] == 0 and totals["passed"] == totals["checks"] > 0, output
    assert totals["not_claimed"] > 0  # flash on CPU
    assert all(summary["phases"][phase]["cases"] == 1 for phase in ("single", "2x1")), output
    ran = {(w["phase"], w["mode"]) for w in summary["worst"]}
    assert {("single", "baseline"), ("single", "kernel"), ("2x1", "eager"), ("2x1", "compiled")} <= ran
    assert all(w["worst"] <= 1 for w in summary["worst"])


def test_kernels_option_runs_only_those_kernels(tmp_path, capfd, monkeypatch):
    """--kernels: the single-device phase runs only them, a CP phase draws its kernel among
    them, and a kernel that claims nothing on the device fails before any world starts."""
    code, summary, output = run_suite(tmp_path, capfd, monkeypatch, "--phases", "2x1", "--cases", "1",
                                      "--kernels", "torch")
    assert code == 0 and summary["kernels"] == ["torch"], output
    assert {(w["mode"], w["kernel"]) for w in summary["worst"]} == {
        ("baseline", "sdpa"), ("eager", "torch"), ("compiled", "torch")}, output
    _, runs = props.draw(0, "single", 0, "cpu", ("torch",))
    assert [(r.mode, r.kernel) for r in runs] == [("baseline", "sdpa"), ("kernel", "torch")]
    assert props.main(["--device", "cpu", "--phases", "2x1", "--kernels", "flash"]) == 2
    assert "none of ['flash'] claims" in capfd.readouterr().err


def test_kernels_option_draws_cp_cases_among_them():
    for index in range(6):
        _, runs = props.draw(0, "2x1", index, "cpu", ("flex", "dense"))
        assert {r.kernel for r in runs[1:]} <= {"flex", "dense"}, index


def test_a_wrong_result_is_caught_and_its_reproducer_replays_it(tmp_path, capfd, monkeypatch):
    code, summary, output = run_suite(tmp_path, capfd, monkeypatch, "--phases", "single", "--cases", "1",
                                      "--inject-fault")
    assert code == 1, output
    failures = summary["failures"]
    assert failures and all(f["mode"] == "kernel" for f in failures), output
    assert all(f["problem"].startswith("dk error") for f in failures), failures
    assert [w["worst"] <= 1 for w in summary["worst"] if w["mode"] == "baseline"] == [True]
    assert failures[0]["replay"] in output
    command = shlex.split(failures[0]["replay"])  # as a shell reads the printed line
    assert command[:5] == ["python", "-m", "scripts.gpu_properties", "--device", "cpu"]
    code, again, output = run_suite(tmp_path, capfd, monkeypatch, *command[5:], "--inject-fault")
    assert code == 1 and again["totals"]["checks"] == again["totals"]["failed"] == 1, output
    assert again["failures"][0]["check"] == failures[0]["check"]
    code, clean, output = run_suite(tmp_path, capfd, monkeypatch, *command[5:])
    assert code == 0 and clean["totals"]["checks"] == clean["totals"]["passed"] == 1, output


# --------------------------------------------------------------------------- the bound


def results(out, dq, dk, dv, pad_max: float = 0.0) -> Result:
    return Result(out, dq, dk, dv, pad_max=pad_max)


def test_bound_is_a_multiple_of_sdpas_error_plus_a_floor_of_ulps():
    expected = results(*(torch.full((4, 2, 8), 2.0, dtype=torch.float64) for _ in range(4)))
    baseline = results(*(torch.full((4, 2, 8), 2.0 + 0.01, dtype=torch.float64) for _ in range(4)))
    ulp = torch.finfo(torch.bfloat16).eps * 2.0
    bound = props.ERROR_FACTOR * 0.01 + props.FLOOR_ULPS * ulp
    just_inside = results(*(torch.full((4, 2, 8), 2.0 + 0.99 * bound, dtype=torch.float64) for _ in range(4)))
    verdict = props.judge(just_inside, expected, baseline, torch.bfloat16)
    assert verdict.passed and math.isclose(verdict.bounds["dq"], bound, rel_tol=1e-9)
    assert 0.98 < verdict.ratio < 1
    dk = expected.dk.clone()
    dk[1, 1, 3] += 1.01 * bound
    verdict = props.judge(results(expected.out, expected.dq, dk, expected.dv), expected, baseline, torch.bfloat16)
    assert not verdict.passed and verdict.problems[0].startswith("dk error")


def test_nan_pads_and_a_far_baseline_fail():
    expected = results(*(torch.ones(3, 1, 4, dtype=torch.float64) for _ in range(4)))
    nan_out = expected.out.clone()
    nan_out[0, 0, 0] = math.nan
    verdict = props.judge(results(nan_out, expected.dq, expected.dk, expected.dv), expected, expected,
                          torch.float32)
    assert verdict.problems == ("out has NaN/Inf",) and verdict.ratio == math.inf
    padded = props.judge(results(*expected.tensors().values(), pad_max=7.0), expected, expected, torch.float32)
    assert not padded.passed and "pad rows" in padded.problems[0]
    far = results(*(t + 1 for t in expected.tensors().values()))
    assert not props.judge(far, expected, None, torch.float32).passed  # the baseline's own check
    capped = props.judge(expected, expected, far, torch.float32)  # a far baseline widens no bound
    ulps = props.ERROR_FACTOR * props.BASELINE_MAX_ULPS + props.FLOOR_ULPS
    assert capped.bounds["out"] == ulps * torch.finfo(torch.float32).eps


def test_reproducer_json_round_trips():
    case, runs = props.draw(7, "2x2", 3, "cuda")
    for run in runs:
        check = props.Check(case, run)
        assert props.Check.from_json(check.to_json()) == check
        assert shlex.split(check.command("cpu"))[-1] == check.to_json()


# --------------------------------------------------------------------------- the GPU's cases


def test_gpu_cases_cover_the_issue():
    """500 cases per phase of the CUDA profile (pure Python: nothing runs): the mixtures,
    thresholds, heads, dtypes and masks the suite must cover, and every case valid for its mesh."""
    lengths: Counter = Counter()
    seen = {key: set() for key in ("ratio", "head_dim", "dtype", "mask", "kernel")}
    claimable = {"auto"}  # the kernels that claim some CP case drawn
    hkv_below_ulysses = one_token_batches_with_empty_documents = 0
    for phase, (ulysses, ring) in props.PHASES.items():
        for index in range(500):
            case, runs = props.draw(0, phase, index, "cuda")
            assert (case, runs) == props.draw(0, phase, index, "cuda")  # every rank draws the same
            profile = props.PROFILES["cuda"]
            kind = props.phase_kind(phase)
            assert 0 < case.tokens <= profile.max_tokens[kind]
            assert case.tokens * case.heads_q * case.head_dim <= profile.max_elements[kind]
            assert case.heads_q % ulysses == 0 and case.heads_q % case.heads_kv == 0
            lengths.update(case.lengths)
            seen["ratio"].add(case.heads_q // case.heads_kv)
            seen["head_dim"].add(case.head_dim)
            seen["dtype"].add(case.dtype)
            seen["mask"].add((case.causal, case.window != (-1, -1)))
            hkv_below_ulysses += case.heads_kv < ulysses
            one_token_batches_with_empty_documents += max(case.lengths) == 1 and 0 in case.lengths
            if kind == "cp":
                assert {r.mode for r in runs} == {"baseline", "eager", "compiled"}
                kernel = runs[1].kernel
                seen["kernel"].add(kernel)
                claimable |= {k for k in props.KERNELS if props.claim(k, case, "cuda", ring) is None}
                assert props.claim(kernel, case, "cuda", props.PHASES[case.phase][1]) is None
                if kernel == "torch":
                    assert case.tokens <= profile.torch_max_tokens
    assert {0, 1, 2, 3} <= set(lengths)
    assert {2047, 2048, 2049, 127, 128, 129, 1023, 1025} <= set(lengths)
    assert max(lengths) > 16384
    assert seen["ratio"] == {1, 2, 4, 8} and seen["head_dim"] == {64, 96, 128, 256}
    assert seen["dtype"] == {"bfloat16", "float16"} and len(seen["mask"]) == 4
    assert seen["kernel"] == claimable  # every registered kernel that claims some of them is drawn
    assert hkv_below_ulysses > 0 and one_token_batches_with_empty_documents > 0


MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0)), (False, (2, 5)), (False, (-1, 4)), (True, (0, 2))]


def test_reference_and_baseline_match_the_tests_float64_reference():
    """The suite's reference (documents of one length together, query rows in chunks of a
    few rows) and SDPA baseline against ``attention_reference`` (a loop over documents and
    heads), float32 inputs."""
    from attention_reference import reference_with_grads

    lengths = (0, 1, 2, 7, 13, 7, 30, 1)
    cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
    for index, ((causal, window), heads_kv) in enumerate(zip(MASKS, (1, 2, 4, 1, 2, 4))):
        case = props.Case(phase="single", seed=0, index=index, lengths=lengths, heads_q=4, heads_kv=heads_kv,
                          head_dim=8, dtype="float32", causal=causal, window=window,
                          scale=None if index % 2 else 0.3)
        batch = props.make_batch(case, torch.device("cpu"))
        expected = reference_with_grads(batch.q, batch.k, batch.v, batch.dout, cu, cu, causal=causal,
                                        window=window, scale=case.softmax_scale)
        for result in (props.reference(batch, case, chunk_elements=64),
                       props.sdpa_baseline(batch, case, chunk_elements=64)):
            for name in ("out", "dq", "dk", "dv"):
                torch.testing.assert_close(getattr(result, name).double(), expected[name], atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{case.describe()} {name}: {m}")


def test_a_world_that_died_is_recorded_at_its_check_and_resumed_after_it(tmp_path):
    """What the parent makes of a world that ended badly: the check of the first rank's
    error (else rank 0's check in flight) failed, and the next world's starting point."""
    case, runs = props.draw(0, "2x2", 3, "cuda")

    def inflight(position: int) -> dict:
        check = props.Check(case, runs[min(max(position, 0), len(runs) - 1)])
        return {"index": 3, "position": position, "runs": len(runs), "check": check.to_json()}

    def write(name: str, value: dict) -> None:
        (tmp_path / name).write_text(json.dumps(value))

    write("inflight.json", inflight(2))
    line, resume = props.world_failure(tmp_path, [None, 0, 0, 0], "cuda")
    assert resume == (3, 3) and "deadline" in line["problem"] and line["mode"] == runs[2].mode
    assert line["check"] == inflight(2)["check"] and line["replay"].endswith(f"'{line['check']}'")
    write("error.rank2.json", {"rank": 2, **inflight(1), "message": "Traceback ...\nRuntimeError: shape"})
    write("error.rank3.json", {"rank": 3, **inflight(len(runs) - 1), "message": "RuntimeError: late"})
    line, resume = props.world_failure(tmp_path, [-9, 0, 3, 3], "cuda")
    assert resume == (3, 2) and line["problem"] == "rank 2: RuntimeError: shape | rank 3: RuntimeError: late"
    assert line["check"] == inflight(1)["check"] and not list(tmp_path.glob("error.*"))
    write("inflight.json", inflight(len(runs) - 1))
    assert props.world_failure(tmp_path, [-11, 0, 0, 0], "cuda")[1] == (4, 0)
    write("inflight.json", inflight(-1))
    line, resume = props.world_failure(tmp_path, [3, 0, 0, 0], "cuda")
    assert resume == (4, 0) and line["mode"] == "prepare"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_property_suite_passes_on_this_gpu(tmp_path, capfd, monkeypatch):
    """The GPU property suite as part of ``pytest -m gpu``: random batches through every
    kernel on one device and CP with 2 ranks sharing the GPU, eager and compiled, within a
    bounded time (``HCP_PROPERTY_MINUTES``, default 3; ``HCP_PROPERTY_SEED``, default 0).
    Longer runs: ``python -m scripts.gpu_properties --minutes N --seed S``."""
    minutes = os.environ.get("HCP_PROPERTY_MINUTES", "3")
    seed = os.environ.get("HCP_PROPERTY_SEED", "0")
    code, summary, output = run_suite(tmp_path, capfd, monkeypatch, "--phases", "single,2x1,1x2",
                                      "--minutes", minutes, "--seed", seed, device="cuda")
    assert code == 0, output
    totals = summary["totals"]
    assert totals["failed"] == 0 and totals["passed"] == totals["checks"] > 0, output
