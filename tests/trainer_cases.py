"""Trainer cases (``hcp_compile.trainer``), run inside the worker processes of
``hcp_compile/testing/worlds.py``: ``suite="trainer_cases"``, one world of 4 ranks.

A tiny randomly initialized Llama (no download) trains for a few optimizer steps with
transformers' ``Trainer`` on ``DataCollatorWithFlattening`` batches and with TRL's
``SFTTrainer(packing=True)`` on a synthetic text dataset (examples/sft_packed.py's character
tokenizer, built in memory), then evaluates. Each case returns the logged losses and metrics of every step, the
gradients of the first optimizer step (DDP-reduced) and the final weights; ``test_trainer``
runs :func:`train` with ``mesh=None`` (the plain trainer class, one process) for the
references.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import hcp_compile as hc
from cp_cases import World
from hcp_compile.testing.worlds import WORLD_DIR_ENV

from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig, Trainer,
    TrainerCallback, TrainingArguments,
)
from trl import SFTConfig, SFTTrainer  # noqa: E402

from sft_packed import CHARS, char_tokenizer  # noqa: E402  (examples/, on pytest's pythonpath)

from hcp_compile.trainer import ContextParallelMixin, ContextParallelTrainer  # noqa: E402

MESH = (2, 2)  # the world: 4 ranks; cases build their own meshes over them
SUITE = "trainer_cases"
WORLD_DEADLINE_S = 300  # 4 processes importing transformers and TRL, one compile, 2 cores

STEPS = 3
# evaluation sets, examples: "uneven" leaves a short last batch of 4 examples (2 real ones)
EVAL_SETS = {"even": 8, "uneven": 6}
LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")


class CPSFTTrainer(ContextParallelMixin, SFTTrainer):
    pass


def tiny_model() -> nn.Module:
    """The same random weights in every process."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(CHARS) + 3,
                         max_position_embeddings=128, use_cache=False, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None)
    return AutoModelForCausalLM.from_config(config, attn_implementation="hcp").float()


def texts(count: int, seed: int) -> list[str]:
    """Sentences of 1 to 12 words, a fixed random stream."""
    generator = torch.Generator().manual_seed(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "sun", "is", "hot"]
    out = []
    for _ in range(count):
        n = int(torch.randint(1, 13, (1,), generator=generator))
        out.append(" ".join(words[int(i)] for i in torch.randint(len(words), (n,), generator=generator)) + ".")
    return out


def token_dataset(count: int, seed: int) -> Dataset:
    tokenizer = char_tokenizer()
    return Dataset.from_dict({"input_ids": [tokenizer(t)["input_ids"] for t in texts(count, seed)]})


def text_dataset(count: int, seed: int) -> Dataset:
    return Dataset.from_dict({"text": texts(count, seed)})


class FirstStepGradients(TrainerCallback):
    """The gradients the optimizer's first step applies (after DDP's reduction)."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self.grads = {f"grad/{n}": p.grad.detach().clone() for n, p in model.named_parameters()}


@dataclass(frozen=True)
class Schedule:
    """What a run does: optimizer steps of ``accumulation`` micro-batches of ``batch``
    examples per data replica (the one-process reference takes ``data * batch``), then an
    evaluation on each of ``evals`` (keys of :data:`EVAL_SETS`)."""

    steps: int = STEPS
    accumulation: int = 2
    evals: tuple[str, ...] = tuple(EVAL_SETS)


def train(kind: str, out_dir: str, mesh=None, *, batch: int = 4, schedule: Schedule = Schedule(),
          compiled: bool = False, save_steps: int | None = None, resume: str | None = None) -> dict:
    """Train ``kind`` ("trainer" or "sft") and evaluate; one process when ``mesh`` is None."""
    common = dict(output_dir=out_dir, per_device_train_batch_size=batch,
                  per_device_eval_batch_size=4, gradient_accumulation_steps=schedule.accumulation,
                  max_steps=schedule.steps,
                  learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
                  save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                  report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    if compiled:  # whole graphs: checkpointed layers would leave attention to run eagerly
        common.update(torch_compile=True, torch_compile_backend="hcp", gradient_checkpointing=False)
    options = {"hcp_options": {"inner": "aot_eager"}} if compiled else {}
    cp = {"mesh": mesh, **options} if mesh is not None else {}
    gradients = FirstStepGradients()
    if kind == "trainer":
        cls = ContextParallelTrainer if mesh is not None else Trainer
        trainer = cls(model=tiny_model(), args=TrainingArguments(**common),
                      data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True),
                      train_dataset=token_dataset(40, seed=1),
                      callbacks=[gradients], **cp)
    else:
        cls = CPSFTTrainer if mesh is not None else SFTTrainer
        config = SFTConfig(packing=True, max_length=48, bf16=False, **common)
        trainer = cls(model=tiny_model(), args=config, processing_class=char_tokenizer(),
                      train_dataset=text_dataset(64, seed=1),
                      callbacks=[gradients], **cp)
    trainer.train(resume_from_checkpoint=resume)
    metrics = {}
    make = token_dataset if kind == "trainer" else text_dataset
    for name in schedule.evals:
        metrics.update(trainer.evaluate(make(EVAL_SETS[name], seed=2), metric_key_prefix=f"eval_{name}"))
    result = {f"param/{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    if resume is None:
        result.update(gradients.grads)
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    for key in LOGGED:
        if key in steps[0]:
            result[f"log/{key}"] = torch.tensor([float(entry[key]) for entry in steps], dtype=torch.float64)
    for name in schedule.evals:
        for key in ("loss", "entropy", "mean_token_accuracy"):
            if f"eval_{name}_{key}" in metrics:
                result[f"eval_{name}/{key}"] = torch.tensor(float(metrics[f"eval_{name}_{key}"]),
                                                            dtype=torch.float64)
    return result


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------

def as_torchrun_sets_it(world: World) -> None:
    """The variables torchrun sets, which accelerate (hence the Trainer) reads for its process
    index and count: the ranks of hcp_compile/testing/worlds.py get only the store's address."""
    size = world.ulysses * world.ring
    os.environ.update(RANK=str(world.rank), LOCAL_RANK=str(world.rank), WORLD_SIZE=str(size),
                      LOCAL_WORLD_SIZE=str(size))


def shared_dir(name: str) -> str:
    """A folder every rank of the world sees (checkpoints are written by rank 0)."""
    path = Path(os.environ[WORLD_DIR_ENV]) / name
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


@dataclass(frozen=True)
class TrainCase:
    """Training on ``ulysses x ring`` with ``data`` replicas; ``batch`` examples per replica
    (the reference takes ``data * batch`` in one process)."""

    kind: str  # "trainer" or "sft"
    compiled: bool = False
    data: int = 1
    ulysses: int = 2
    ring: int = 2
    schedule: Schedule = Schedule()
    save_steps: int | None = None

    @property
    def id(self) -> str:
        mode = "compiled" if self.compiled else "eager"
        return f"{self.kind}-{mode}-{self.data}x{self.ulysses}x{self.ring}"

    def run(self, world: World) -> dict:
        as_torchrun_sets_it(world)
        mesh = hc.make_mesh(self.ulysses, self.ring, "cpu", data=self.data)
        return train(self.kind, shared_dir(self.id), mesh, batch=4 // self.data,
                     schedule=self.schedule, compiled=self.compiled, save_steps=self.save_steps)


@dataclass(frozen=True)
class ResumeCase:
    """Resumes the run of ``of`` (which saved a checkpoint at step 2) to its last step."""

    of: TrainCase

    @property
    def id(self) -> str:
        return f"{self.of.id}-resumed"

    def run(self, world: World) -> dict:
        as_torchrun_sets_it(world)
        mesh = hc.make_mesh(self.of.ulysses, self.of.ring, "cpu", data=self.of.data)
        out = shared_dir(self.of.id)
        return train(self.of.kind, out, mesh, batch=4 // self.of.data, schedule=self.of.schedule,
                     compiled=self.of.compiled, resume=os.path.join(out, "checkpoint-2"))


TRAINER = TrainCase("trainer", save_steps=2)
TRAIN_CASES = (
    TRAINER,
    TrainCase("trainer", data=2, ulysses=2, ring=1),
    TrainCase("sft"),
    # each graph costs about 15 s here (training; evaluation would compile a no-grad one):
    # two steps, the evaluation path checked eagerly
    TrainCase("sft", compiled=True, schedule=Schedule(steps=2, accumulation=1, evals=())),
)
RESUME_CASES = (ResumeCase(TRAINER),)


def suite(mesh: tuple[int, int]) -> list:
    return [*TRAIN_CASES, *RESUME_CASES]
