"""``hcp_compile.trainer``: transformers' ``Trainer`` and TRL's ``SFTTrainer(packing=True)``
under hierarchical context parallelism.

Checked against the plain trainer class in one process on the same data (``data * batch``
examples per step, which is what ``data`` replicas of ``batch`` examples make together): the
logged loss and metrics of every optimizer step, the gradients the first step applies (after
DDP's reduction), the final weights and the evaluation loss. On ulysses 2 x ring 2 (eager and
compiled with ``backend="hcp"``), and data 2 x ulysses 2 x ring 1; gradient accumulation on;
a run resumed from its step-2 checkpoint ends where the uninterrupted one does. Without
transformers, TRL, accelerate or datasets the module is skipped.
"""

from __future__ import annotations

import functools

import pytest
import torch

for package in ("transformers", "trl", "accelerate", "datasets"):
    pytest.importorskip(package)

import trainer_cases  # noqa: E402
from checks import assert_matches  # noqa: E402
from trainer_cases import RESUME_CASES, TRAIN_CASES, Schedule  # noqa: E402

@pytest.fixture(scope="module")
def trainer_world(cp_world):
    return cp_world(trainer_cases.MESH, suite=trainer_cases.SUITE,
                    deadline_s=trainer_cases.WORLD_DEADLINE_S)


@functools.cache
def reference(kind: str, schedule: Schedule, tmp_root: str) -> dict[str, torch.Tensor]:
    """The plain trainer class, one process, 4 examples per step."""
    return trainer_cases.train(kind, f"{tmp_root}/{kind}-{hash(schedule)}", batch=4, schedule=schedule)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("reference"))


def compared(key: str, data: int) -> bool:
    """Whether one process gives ``key`` too. The uneven evaluation set leaves a short last
    batch: with data replicas each one's is completed from the set's start."""
    return data == 1 or not key.startswith("eval_uneven/")


def assert_same_run(got: dict, expected: dict, what: str, data: int) -> None:
    keys = {key for key in expected if compared(key, data)}
    missing = keys - set(got)
    assert not missing, f"{what}: no {sorted(missing)}"
    for name in sorted(keys):
        assert_matches(got[name], expected[name], f"{what} {name}")


@pytest.mark.parametrize("case", TRAIN_CASES, ids=lambda case: case.id)
def test_training_matches_one_process(trainer_world, tmp_root, case):
    expected = reference(case.kind, case.schedule, tmp_root)
    assert any(k.startswith("grad/") for k in expected) and "log/loss" in expected
    for rank, result in enumerate(trainer_world.values(case.id)):
        assert_same_run(result, expected, f"rank {rank} {case.id}", case.data)


@pytest.mark.parametrize("case", RESUME_CASES, ids=lambda case: case.id)
def test_resumed_run_ends_where_the_uninterrupted_one_does(trainer_world, tmp_root, case):
    expected = reference(case.of.kind, case.of.schedule, tmp_root)
    for rank, result in enumerate(trainer_world.values(case.id)):
        # the log history continues the checkpoint's
        assert_matches(result["log/loss"], expected["log/loss"], f"rank {rank} resumed loss")
        for name in expected:
            if name.startswith(("param/", "eval_")):
                assert_matches(result[name], expected[name], f"rank {rank} resumed {name}")
