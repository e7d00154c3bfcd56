"""benchmarks.capacity: the capacity search against predicates with known answers, the training
step under CP against one process (a 2-rank gloo world, suite :func:`suite` of this module),
the CLI end to end on CPU with the tiny model, and its argument errors."""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist

import hcp_compile as hc
from benchmarks.capacity import (
    TINY, Options, Probe, Row, Setup, Trainer, fitted_start, largest_fitting, main, merge, out_of_memory, parse_args,
    probe, relate,
)

SUITE = "test_capacity_benchmark:suite"


@pytest.fixture
def one_thread():
    """Tiny CPU steps run many times faster on one thread than on two fighting other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the search


def below(capacity: int, calls: list[int] | None = None):
    def fits(tokens: int) -> bool:
        if calls is not None:
            calls.append(tokens)
        return tokens <= capacity
    return fits


@pytest.mark.parametrize("capacity", [64, 100, 128, 1000, 4096, 4160])
@pytest.mark.parametrize("start", [64, 640, 4096, 50_000])
def test_the_search_finds_the_largest_fitting_multiple(capacity, start):
    calls: list[int] = []
    assert largest_fitting(below(capacity, calls), start, 64) == capacity // 64 * 64
    assert len(calls) == len(set(calls))  # no size tried twice
    assert all(t % 64 == 0 and t > 0 for t in calls)


def test_nothing_fits_gives_zero_after_trying_one_unit():
    calls: list[int] = []
    assert largest_fitting(below(10, calls), 512, 64) == 0 and calls[-1] == 64


def test_a_start_that_fails_steps_down_geometrically_then_bisects():
    calls: list[int] = []
    assert largest_fitting(below(64 * 20, calls), 64 * 40, 64) == 64 * 20
    assert [t // 64 for t in calls[:6]] == [40, 39, 37, 33, 25, 9]


def test_an_exact_start_costs_two_probes_and_the_limit_stops_growth():
    calls: list[int] = []
    assert largest_fitting(below(64 * 30, calls), 64 * 30, 64) == 64 * 30 and calls == [64 * 30, 64 * 31]
    assert largest_fitting(lambda t: True, 64, 64, limit=64 * 10) == 64 * 10
    with pytest.raises(ValueError, match="granularity"):
        largest_fitting(lambda t: True, 64, 0)


def test_the_fitted_start_extrapolates_the_usage_to_the_limit():
    # 1000 fixed + 3 per token: 1000 + 3 * 2000 = 7000 at 2000 tokens
    assert fitted_start(lambda n: 1000 + 3 * n, 100, 7000) == 2000
    assert fitted_start(lambda n: 1000 + 3 * n, 100, 7050) == 2000  # rounded down to the grid
    assert fitted_start(lambda n: float("inf"), 100, 7000) == 100  # the fit's first step fails
    assert fitted_start(lambda n: 5.0 if n == 200 else float("inf"), 100, 7000) == 200  # the second fails
    assert fitted_start(lambda n: 5.0, 100, 7000) == 1600  # no growth: above the fit


def test_out_of_memory_is_found_inside_wrapping_exceptions():
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    try:
        try:
            raise torch.OutOfMemoryError("x")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("compiled code failed") from inner
    except RuntimeError as wrapped:
        assert out_of_memory(wrapped)
    assert out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not out_of_memory(ValueError("wrong shape"))


def test_a_step_out_of_memory_does_not_fit_is_freed_and_other_errors_propagate(one_thread):
    trainer = Trainer(Setup(TINY, 1, "one-gpu-eager", False, torch.device("cpu"), "eager"))
    options = Options(granularity=32, steps=1, shrink=1, cap=100, cuda=False)
    assert probe(trainer, [60, 40], options).fits and not probe(trainer, [101], options).fits  # CPU: tokens
    alive = []

    def out_of_memory_inside(batch):
        alive.append(weakref.ref(batch.x))
        raise RuntimeError("compiled code failed") from torch.OutOfMemoryError("CUDA out of memory")

    trainer.step = out_of_memory_inside
    assert probe(trainer, [50], options) == Probe(False, math.inf)
    assert alive[0]() is None  # no traceback keeps the failed step's tensors
    trainer.step = lambda batch: 1 / 0
    with pytest.raises(ZeroDivisionError):
        probe(trainer, [50], options)


def test_the_ratio_is_against_n_times_one_gpu_of_the_same_kind():
    rows = [Row("one-gpu-eager", "1", 1, 0, False, "W2", "40 GiB", capacity=1000),
            Row("one-gpu-compiled", "1", 1, 0, False, "W2", "40 GiB", capacity=2000),
            Row("hcp-eager", "2x2", 4, 0, False, "W2", "40 GiB", capacity=3600),
            Row("hcp-compiled", "2x1", 2, 0, False, "W2", "40 GiB", capacity=3000),
            Row("hcp-eager", "2x1", 2, 0, True, "W2", "40 GiB", capacity=3000)]  # no one-GPU row with checkpointing
    relate(rows)
    assert [r.ratio for r in rows] == [1.0, 1.0, 0.9, 0.75, None]


# --------------------------------------------------------------------------- CP against one process


@dataclass(frozen=True)
class StepMatchesOneProcess:
    """The tiny model in float64: one training step on each mesh of the world's 2 ranks, with
    and without checkpointing, against the same step in one process: the ranks' losses sum
    to its loss (normalized by the whole batch's real tokens) and the all-reduced gradients
    are its gradients."""

    id: str = "capacity-step-matches-one-process"

    def run(self, world) -> dict:
        torch.set_num_threads(1)
        shape = replace(TINY, dtype=torch.float64)
        lengths = [5, 17, 3, 31, 1]
        x = torch.randn(sum(lengths), shape.hidden, dtype=shape.dtype, generator=torch.Generator().manual_seed(1))
        errors = {}
        for ulysses, ring in ((2, 1), (1, 2)):
            mesh = hc.make_mesh(ulysses, ring, "cpu")
            for checkpointing in (False, True):
                one = Trainer(Setup(shape, 2, "one-gpu-eager", checkpointing, torch.device("cpu"), "eager"))
                cp = Trainer(Setup(shape, 2, "hcp-eager", checkpointing, torch.device("cpu"), "eager"), mesh)
                one_loss = one.step(one.batch(lengths, x))
                cp_loss = cp.step(cp.batch(lengths, x))
                dist.all_reduce(cp_loss)
                name = f"{ulysses}x{ring} checkpointing {checkpointing}"
                errors[f"{name} loss"] = float((cp_loss - one_loss).abs() / one_loss)
                errors[f"{name} grads"] = max(float((a.grad - b.grad).abs().max() / b.grad.abs().max())
                                              for a, b in zip(cp.parameters, one.parameters))
        return errors


def suite(mesh: tuple[int, int]) -> list:
    return [StepMatchesOneProcess()]


def test_the_cp_step_matches_one_process(cp_world):
    for rank, errors in enumerate(cp_world((2, 1), suite=SUITE).values(StepMatchesOneProcess().id)):
        assert len(errors) == 8
        for name, error in errors.items():
            assert error < 1e-10, f"rank {rank}: {name}: relative error {error}"


# --------------------------------------------------------------------------- the CLI


def test_the_cli_finds_the_token_budget_on_cpu(tmp_path, capsys, one_thread):
    out = tmp_path / "capacity.json"
    main(["--device", "cpu", "--tiny", "--layers", "1", "--modes", "one-gpu-eager,hcp-eager", "--meshes", "2x1",
          "--checkpointing", "off", "--workloads", "W2", "--cap-tokens", "128", "--granularity", "16",
          "--steps", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "cap: 128 local tokens per rank" in printed and "total" in printed
    rows = json.loads(out.read_text())["rows"]
    one, cp = rows
    assert (one["mode"], one["capacity"], one["per_rank"], one["ratio"]) == ("one-gpu-eager", 128, 128, 1.0)
    # 2 ranks, each holding at most 128 tokens, pads included
    assert cp["mode"] == "hcp-eager" and cp["mesh"] == "2x1" and 0 < cp["capacity"] <= 256
    assert cp["ratio"] == cp["capacity"] / 256 and cp["step_ms"] > 0 and cp["error"] is None
    runs, merged = merge([out, out])
    assert len(runs) == 2 and len(merged) == 2  # the same rows again: taken once


@pytest.mark.parametrize("argv, option", [
    (["--meshes", "2y1"], "--meshes"),
    (["--modes", "one-gpu-flash"], "--modes"),
    (["--modes", "torch-cp"], "--modes"),
    (["--workloads", "W3"], "--workloads"),
    (["--granularity", "0"], "--granularity"),
    (["--cap-gib", "-1"], "--cap-gib"),
    (["--rank", "2", "--meshes", "2x1"], "--rank"),
    (["--checkpointing", "sometimes"], "--checkpointing"),
])
def test_bad_arguments_name_the_option(argv, option, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", *argv])
    assert option in capsys.readouterr().err
