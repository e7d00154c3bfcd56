"""Hugging Face transformers cases (``attn_implementation="hcp"``), run inside the worker
processes of ``hcp_compile/testing/worlds.py``: ``suite="hf_cases"``, one ulysses 2 x ring 2 world.

A tiny randomly initialized causal LM (no download) takes one training step on a packed batch
that transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` builds: each
rank feeds its shard (``shard_plan``) with ``plan.position_ids`` and the GLOBAL packed keywords;
its loss is the sum over its shard of the next-token losses divided by the global target count.
Every case returns the unsharded logits and the parameter gradients all-reduced over the CP
ranks; ``test_transformers`` rebuilds the same model and batch (with the helpers here) for its
one-process references.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

import hcp_compile as hc
from cp_cases import World

# in a worker, hcp_compile is imported before this module: it must not have imported
# transformers, and must register "hcp" when the import below first loads its registries
TRANSFORMERS_IMPORTED_FIRST = "transformers" in sys.modules

from transformers import (  # noqa: E402
    AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig, MistralConfig,
)
from transformers.loss.loss_utils import LOSS_MAPPING  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

MESH = (2, 2)  # (ulysses, ring)
SUITE = "hf_cases"
# the whole world, start-up included: 4 processes importing transformers and compiling one
# model on 2 shared cores
WORLD_DEADLINE_S = 300

DOC_LENGTHS = (5, 1, 12, 3, 9, 2)  # a 1-token document and documents shorter than 2R chunks
VOCAB = 64
IGNORE = -100  # transformers' ignore index of the loss
SLIDING_WINDOW = 4  # shorter than the longest document, so the window masks keys


def tiny_config(kind: str = "llama", **overrides):
    """fp32 config of a 2-layer model: hidden 32, 4 query heads, 2 key/value heads (GQA)."""
    fields = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                     max_position_embeddings=64, use_cache=False), **overrides}
    if kind == "mistral":
        return MistralConfig(sliding_window=SLIDING_WINDOW, **fields)
    return LlamaConfig(**fields)


def tiny_model(attn_implementation: str, kind: str = "llama", **overrides) -> nn.Module:
    """The same randomly initialized weights in every process."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        tiny_config(kind, **overrides), attn_implementation=attn_implementation
    ).float()


def documents() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(VOCAB, (n,), generator=generator).tolist() for n in DOC_LENGTHS]


def packed_batch() -> dict:
    """What ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` makes of the
    documents: ``input_ids``, ``labels``, ``position_ids`` ``[1, T]`` and the packed keywords."""
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    return collate([{"input_ids": doc} for doc in documents()])


def next_token_targets(labels: Tensor) -> Tensor:
    """``[T]`` target of every packed token: the next label. The collator's labels hold
    ``IGNORE`` at each document's first token, so no token is trained to predict the next
    document. Shifted globally, before sharding: a rank's shard holds no token's successor."""
    row = labels[0]
    return torch.cat([row[1:], row.new_full((1,), IGNORE)])


def target_count(labels: Tensor) -> int:
    return int((next_token_targets(labels) != IGNORE).sum())


def packed_keywords(batch: dict) -> dict:
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    return {name: batch[name] for name in names}


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FineTuneStepCase:
    """Forward and backward on this rank's shard, eager inside ``context_parallel`` or
    compiled with ``backend="hcp"`` (``fullgraph``: no attention left to run eagerly)."""

    kind: str  # "llama" or "mistral" (sliding window)
    compiled: bool

    @property
    def id(self) -> str:
        return f"{self.kind}-{'compiled' if self.compiled else 'eager'}"

    def run(self, world: World) -> dict:
        model = tiny_model("hcp", self.kind)
        batch = packed_batch()
        plan = hc.shard_plan(batch["cu_seq_lens_q"], world.mesh)
        if self.compiled:  # the rewritten graph needs no context
            options = {"mesh": world.mesh, "inner": "aot_eager"}
            step = torch.compile(model, backend="hcp", options=options, fullgraph=True)
            context = nullcontext()
        else:
            step, context = model, hc.context_parallel(world.mesh)
        with context:
            logits = step(input_ids=plan.shard(batch["input_ids"][0])[None],
                          position_ids=plan.position_ids[None], **packed_keywords(batch)).logits
        targets = plan.shard(next_token_targets(batch["labels"]), pad_value=IGNORE)
        loss = nn.functional.cross_entropy(logits[0], targets, ignore_index=IGNORE, reduction="sum")
        (loss / target_count(batch["labels"])).backward()
        result = {"logits": plan.unshard(logits[0].detach())}
        for name, parameter in model.named_parameters():
            dist.all_reduce(parameter.grad)  # each rank holds its tokens' share of the gradient
            result[f"grad/{name}"] = parameter.grad
        return result


@dataclass(frozen=True)
class RefusalCase:
    """A call the attention function refuses; every rank must raise ``InputError`` before any
    collective (each rank's call is wrong in the same way)."""

    id: str
    drop: str  # the packed keyword left out

    def run(self, world: World) -> dict:
        model = tiny_model("hcp")
        batch = packed_batch()
        plan = hc.shard_plan(batch["cu_seq_lens_q"], world.mesh)
        keywords = packed_keywords(batch)
        del keywords[self.drop]
        with hc.context_parallel(world.mesh):
            model(input_ids=plan.shard(batch["input_ids"][0])[None],
                  position_ids=plan.position_ids[None], **keywords)
        return {}


@dataclass(frozen=True)
class ModelLossCase:
    """The model's own loss on this rank's shard: with ``labels`` only it would shift inside
    the shard, so every rank must raise ``InputError`` (eager inside ``context_parallel``, or
    while Dynamo traces for ``backend="hcp"``); with ``shift_labels`` (shifted on the whole row,
    then sharded) and the whole batch's target count, the ranks' losses and gradients sum to
    one process's."""

    compiled: bool
    shifted: bool

    @property
    def id(self) -> str:
        return (f"model-loss-{'shift-labels' if self.shifted else 'labels'}-"
                f"{'compiled' if self.compiled else 'eager'}")

    def run(self, world: World) -> dict:
        model = tiny_model("hcp")
        batch = packed_batch()
        plan = hc.shard_plan(batch["cu_seq_lens_q"], world.mesh)
        targets = plan.shard(next_token_targets(batch["labels"]), pad_value=IGNORE)[None]
        labels = {"labels": targets, "shift_labels": targets} if self.shifted else {
            "labels": plan.shard(batch["labels"][0], pad_value=IGNORE)[None]}
        if self.compiled:
            options = {"mesh": world.mesh, "inner": "aot_eager"}
            step, context = torch.compile(model, backend="hcp", options=options), nullcontext()
        else:
            step, context = model, hc.context_parallel(world.mesh)
        with context:
            loss = step(input_ids=plan.shard(batch["input_ids"][0])[None],
                        position_ids=plan.position_ids[None], **packed_keywords(batch), **labels,
                        num_items_in_batch=target_count(batch["labels"])).loss
        loss.backward()
        result = {"loss": loss.detach().clone()}
        dist.all_reduce(result["loss"])
        for name, parameter in model.named_parameters():
            dist.all_reduce(parameter.grad)
            result[f"grad/{name}"] = parameter.grad
        return result


@dataclass(frozen=True)
class LazyRegistrationCase:
    """How ``"hcp"`` got registered in this worker (a fresh interpreter)."""

    id: str = "lazy-registration"

    def run(self, world: World) -> dict:
        modeling_utils = sys.modules["transformers.modeling_utils"]
        return {
            "transformers_imported_by_hcp_compile": TRANSFORMERS_IMPORTED_FIRST,
            "attention_registered":
                AttentionInterface._global_mapping.get("hcp") is hc.hf.attention_forward,
            "mask_registered":
                AttentionMaskInterface._global_mapping.get("hcp") is hc.hf.mask_function,
            "loss_guarded": all(
                hasattr(LOSS_MAPPING[name], "hcp_guarded") for name in ("ForCausalLM", "ForConditionalGeneration")),
            "hook_left": any(type(f).__module__ == "hcp_compile.hf" for f in sys.meta_path),
            "loader_restored": modeling_utils.__spec__.loader is modeling_utils.__loader__
            and type(modeling_utils.__loader__).__module__ != "hcp_compile.hf",
        }


FINE_TUNE_CASES = (
    FineTuneStepCase("llama", compiled=False),
    FineTuneStepCase("llama", compiled=True),
    FineTuneStepCase("mistral", compiled=False),
)
REFUSAL_CASES = (RefusalCase("refuse-without-cu-seq-lens-k", "cu_seq_lens_k"),)
MODEL_LOSS_CASES = (
    ModelLossCase(compiled=False, shifted=True),
    ModelLossCase(compiled=False, shifted=False),
    ModelLossCase(compiled=True, shifted=False),  # refused while tracing: nothing compiles
)


def suite(mesh: tuple[int, int]) -> list:
    """Every case of the world, in order (the refusal last: a hang there must not cost the
    others their results)."""
    return [LazyRegistrationCase(), *FINE_TUNE_CASES, *MODEL_LOSS_CASES, *REFUSAL_CASES]
