"""The advisor explains itself: help with unit and default for every option, ties within the
model's measured error, and no caveat printed where it does not apply."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

import hcp_advise as advise
from benchmarks.advisor_check import recompare
from hcp_advise import Advice, Option, Prediction
from hcp_advise.command import local_device_kind, parser
from hcp_advise.measurements import CACHE_ENV
from hcp_compile.batch.placements import PLACEMENTS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(autouse=True)
def no_cached_measurements(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


def test_every_option_has_help_with_its_default(capsys):
    options = [a for a in parser()._actions if a.dest != "help"]
    assert {a.dest for a in options} >= {"gpus_per_node", "head_dim", "seed", "placements", "kernel", "device_kind",
                                         "ring_nvlink_gbs", "nvlink_latency_us", "network_latency_us", "measure"}
    for action in options:
        assert action.help, action.dest
        if action.default not in (None, False):  # --world (required) and the --measure switch have none
            assert "%(default)s" in action.help, action.dest
    with pytest.raises(SystemExit):
        advise.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    # rendered: the defaults with their units
    for expected in ["GPUs per node", "(default 8)", "elements per head (default 128)", "(default 0)",
                     f"(default {','.join(PLACEMENTS)})", "(default auto)", f"here {local_device_kind()}",
                     "GB/s per GPU and direction (default 290.0", "microseconds (default 10.0",
                     "microseconds (default 25.0", "in tokens (default -1: none)"]:
        assert expected in text, expected


def prediction(ulysses: int, ring: int, placement: str, step_ms: float) -> Prediction:
    step = step_ms / 1e3
    return Prediction(Option(ulysses, ring, placement), "cudnn", 1, "nvlink", step, step, step, 0.0, 0.0, 0.0, 0.0)


def test_options_closer_than_the_model_error_are_a_tie():
    """Best 100 ms, model error 10 %: 105 and 109.9 ms tie with it, 111 and more do not;
    the first beyond the tie and the best of every other mesh are each explained."""
    predictions = (prediction(2, 4, "balanced", 100.0), prediction(4, 2, "balanced", 105.0),
                   prediction(2, 4, "zigzag", 109.9), prediction(4, 2, "zigzag", 111.0),
                   prediction(8, 1, "balanced", 150.0), prediction(1, 8, "zigzag", 300.0))
    advice = Advice(predictions, "NVIDIA H200", 1, 0.1, model_error=0.10)
    assert advise.tied(advice) == predictions[1:3]
    text = advise.format_advice(advice)
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]  # the header first
    assert [("tie" in row.split("|")[4]) for row in rows] == [False, True, True, False, False, False]
    lines = unwrapped(text)
    tie = next(line for line in lines if line.startswith("tie"))
    assert "±10.0 % error" in tie and "4 x 2 'balanced' (+5.0 %)" in tie and "2 x 4 'zigzag' (+9.9 %)" in tie
    assert "4 x 2 'zigzag'" not in tie
    versus = [line for line in lines if line.startswith("vs ")]
    # 4 x 2 'zigzag' is the first beyond the tie, then 8 x 1 and 1 x 8, each a mesh not yet named
    assert [line.split(":")[0] for line in versus] == [
        "vs ulysses 4 x ring 2 'zigzag'", "vs ulysses 8 x ring 1 'balanced'", "vs ulysses 1 x ring 8 'zigzag'"]
    assert "(or an option tied with it)" in lines[-1]


def unwrapped(text: str) -> list[str]:
    """The report's lines as written, before :func:`format_advice` wrapped them (a wrapped line
    goes on indented by two spaces)."""
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("  ") and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return lines


def test_no_tie_is_reported_where_the_others_are_further_than_the_error():
    advice = Advice((prediction(2, 4, "balanced", 100.0), prediction(4, 2, "balanced", 120.0)),
                    "NVIDIA H200", 1, 0.1, model_error=0.10)
    text = advise.format_advice(advice)
    assert advise.tied(advice) == () and "tie" not in text
    assert "vs ulysses 4 x ring 2 'balanced': 120.00 ms (+20.0 %)" in text


def median_error(name: str) -> float:
    """The median |error| of the advisor's check as the current model predicts its measured
    ranks again (``benchmarks.advisor_check --comparisons``: the whole model, compute, passes
    and host), as a fraction; the errors stored with the measurements are those of the model
    of their day."""
    rows = recompare(RESULTS / name, "gqa", 128, "NVIDIA H200")
    assert len(rows) == len(json.loads((RESULTS / name).read_text()))
    assert all(r.error_host_pct is not None for r in rows)
    return statistics.median(abs(row.error_host_pct) for row in rows) / 100


def test_the_model_error_is_its_checks_median_error():
    assert advise.MODEL_ERROR == pytest.approx(median_error("advisor_check.json"), abs=5e-4)
    assert advise.MODEL_ERROR_WINDOW == pytest.approx(median_error("advisor_check_w4.json"), abs=5e-4)
    batch = advise.cu_seqlens_of([3000, 900, 5000, 131])
    options = dict(world=2, gpus_per_node=8, heads_q=32, heads_kv=8, head_dim=128)
    assert advise.advise(batch, **options).model_error == advise.MODEL_ERROR
    assert advise.advise(batch, **options, window=1024).model_error == advise.MODEL_ERROR_WINDOW


def test_the_defaults_print_no_caveat():
    """On the stored H200 with its host times and the H200's links nothing is missing, so no
    line says that something is not modelled or not measured."""
    text = " ".join(advise.main(["--world", "8", "--tokens", "131072"]).split())  # unwrapped
    for caveat in ("not modelled", "not measured", "warning", "H200's NVLink figures"):
        assert caveat not in text, caveat
    assert "at their NVIDIA H200 measurements (hcp_compile/kernels/measured.json)" in text
    # a kernel without host times: the caveat applies, and is printed
    assert "host part not modelled" in advise.main(["--world", "8", "--tokens", "131072", "--kernel", "dense"])
