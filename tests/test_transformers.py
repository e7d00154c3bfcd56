"""``attn_implementation="hcp"`` for Hugging Face transformers models.

Checked: a tiny randomly initialized Llama (and Mistral, whose sliding window masks keys here)
fine-tuned for one step on a packed batch from ``DataCollatorWithFlattening`` gives the same
logits and parameter gradients on a ulysses 2 x ring 2 mesh, eager under ``context_parallel``
and compiled with ``backend="hcp"``, as one process running the same model on the whole packed
batch with ``"hcp"``, and as transformers' own ``"eager"``/``"sdpa"`` attention on the unpacked
documents; what the attention function refuses (with the argument named); and that
``import hcp_compile`` registers ``"hcp"`` without importing transformers (at once when
transformers is imported, else on its first import: checked in the world's fresh workers).
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

pytest.importorskip("transformers")

import hcp_compile as hc  # noqa: E402
import hf_cases  # noqa: E402
from checks import assert_matches  # noqa: E402
from hf_cases import (  # noqa: E402
    FINE_TUNE_CASES, MODEL_LOSS_CASES, REFUSAL_CASES, AttentionInterface, AttentionMaskInterface,
    packed_batch, packed_keywords, tiny_model,
)


@pytest.fixture(scope="module")
def hf_world(cp_world):
    return cp_world(hf_cases.MESH, suite=hf_cases.SUITE, deadline_s=hf_cases.WORLD_DEADLINE_S)


def step_results(model, loss) -> dict[str, torch.Tensor]:
    loss.backward()
    return {f"grad/{name}": p.grad for name, p in model.named_parameters()}


@functools.cache
def packed_reference(kind: str) -> dict[str, torch.Tensor]:
    """One process, the whole packed batch, ``"hcp"`` single-device; transformers shifts the
    collator's labels itself."""
    model, batch = tiny_model("hcp", kind), packed_batch()
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                labels=batch["labels"], num_items_in_batch=hf_cases.target_count(batch["labels"]),
                **packed_keywords(batch))
    return {"logits": out.logits[0].detach(), **step_results(model, out.loss)}


@functools.cache
def unpacked_reference(kind: str, attn_implementation: str) -> dict[str, torch.Tensor]:
    """transformers' own attention, one document at a time (no packing, default positions),
    the loss summed over the documents and normalized by the same global target count."""
    model, batch = tiny_model(attn_implementation, kind), packed_batch()
    count = hf_cases.target_count(batch["labels"])
    logits, loss = [], 0
    for doc in hf_cases.documents():
        ids = torch.tensor([doc])
        out = model(input_ids=ids, labels=ids, num_items_in_batch=count)
        logits.append(out.logits[0].detach())
        loss = loss + out.loss
    return {"logits": torch.cat(logits), **step_results(model, loss)}


def assert_same_step(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), f"{what}: results {sorted(got)} vs {sorted(expected)}"
    for name, tensor in expected.items():
        assert_matches(got[name], tensor, f"{what} {name}")


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_single_device_matches_transformers_attention_unpacked(kind, attn_implementation):
    assert_same_step(packed_reference(kind), unpacked_reference(kind, attn_implementation),
                     f"{kind} hcp vs {attn_implementation}")


@pytest.mark.parametrize("case", FINE_TUNE_CASES, ids=lambda case: case.id)
def test_context_parallel_step_matches_one_process(hf_world, case):
    for rank, result in enumerate(hf_world.values(case.id)):
        assert_same_step(result, packed_reference(case.kind), f"rank {rank} {case.id} vs hcp")
        assert_same_step(result, unpacked_reference(case.kind, "sdpa"),
                         f"rank {rank} {case.id} vs sdpa")


@pytest.mark.parametrize("case", REFUSAL_CASES, ids=lambda case: case.id)
def test_context_parallel_refusal_raises_on_every_rank(hf_world, case):
    for rank, record in enumerate(hf_world.per_rank(case.id)):
        assert record.raised_instance_of(hc.InputError), f"rank {rank} {record.describe()}"
        assert case.drop in record.message, f"rank {rank}: {record.message!r}"


@pytest.mark.parametrize("case", MODEL_LOSS_CASES, ids=lambda case: case.id)
def test_model_loss_under_context_parallelism_is_right_or_refused(hf_world, case):
    if not case.shifted:
        for rank, record in enumerate(hf_world.per_rank(case.id)):
            assert record.raised_instance_of(hc.InputError), f"rank {rank} {record.describe()}"
            assert record.message.startswith("labels: ") and "shift_labels=" in record.message, \
                f"rank {rank}: {record.message!r}"
        return
    expected = packed_reference("llama")
    model, batch = tiny_model("hcp"), packed_batch()
    loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                 labels=batch["labels"], num_items_in_batch=hf_cases.target_count(batch["labels"]),
                 **packed_keywords(batch)).loss
    for rank, result in enumerate(hf_world.values(case.id)):
        assert_matches(result["loss"], loss.detach(), f"rank {rank} {case.id} loss")
        for name, grad in expected.items():
            if name.startswith("grad/"):
                assert_matches(result[name], grad, f"rank {rank} {case.id} {name}")


def test_autocast_gives_attention_one_dtype_as_sdpa_gets():
    """Under bf16 autocast (TRL's default) rotary embeddings leave q and k in float32 and v in
    bfloat16; the attention runs in bfloat16 as SDPA does, and the logits agree."""
    batch = packed_batch()
    logits = {}
    for attn in ("hcp", "sdpa"):
        model = tiny_model(attn)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if attn == "hcp":
                out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                            **packed_keywords(batch))
                logits[attn] = out.logits[0].float()
            else:
                logits[attn] = torch.cat([model(input_ids=torch.tensor([doc])).logits[0].float()
                                          for doc in hf_cases.documents()])
    torch.testing.assert_close(logits["hcp"], logits["sdpa"], atol=5e-2, rtol=5e-2)


def test_model_loss_guard_leaves_single_device_and_other_backends_alone():
    """Outside CP the model shifts its labels itself, eagerly and compiled by another backend
    (the one-process references above rely on the eager path)."""
    model, batch = tiny_model("hcp"), packed_batch()
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
              "labels": batch["labels"], **packed_keywords(batch)}
    eager = model(**kwargs).loss
    compiled = torch.compile(model, backend="eager")(**kwargs).loss
    assert_matches(compiled.detach(), eager.detach(), "compiled (backend eager) loss")


# --------------------------------------------------------------------------------------------
# refusals, single-device
# --------------------------------------------------------------------------------------------

def call_model(model=None, **overrides):
    batch = packed_batch()
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
              **packed_keywords(batch), **overrides}
    return (model or tiny_model("hcp"))(**{k: v for k, v in kwargs.items() if v is not None})


def training_model_with_dropout():
    return tiny_model("hcp", attention_dropout=0.1).train()


REFUSALS = {
    "batch-2": (lambda: call_model(input_ids=packed_batch()["input_ids"].repeat(2, 1),
                                   position_ids=packed_batch()["position_ids"].repeat(2, 1)),
                "query: expected [batch=1"),
    "no-packed-keywords": (lambda: call_model(cu_seq_lens_q=None, cu_seq_lens_k=None,
                                              max_length_q=None, max_length_k=None),
                           "cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k: "),
    "padding-mask": (
        lambda: call_model(attention_mask=torch.ones_like(packed_batch()["input_ids"])),
        "attention_mask: ",
    ),
    "dropout-in-training": (lambda: call_model(training_model_with_dropout()), "dropout: "),
    "output-attentions": (lambda: call_model(output_attentions=True), "output_attentions: "),
    "max-length-tensor": (lambda: call_model(max_length_q=torch.tensor(12)), "max_length_q: "),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_refuses_what_it_cannot_compute(name):
    action, match = REFUSALS[name]
    with pytest.raises(hc.InputError, match=match.replace("[", r"\[")):
        action()


DIRECT_REFUSALS = {  # key/value tokens (query: 5), other arguments, message
    "softcap": (5, {"softcap": 30.0}, "softcap: "),
    "attention-sinks": (5, {"s_aux": torch.zeros(4)}, "s_aux: "),
    "kv-cache": (9, {}, "key: has 9 tokens but query has 5"),
}


@pytest.mark.parametrize("name", DIRECT_REFUSALS)
def test_attention_function_refuses_arguments_models_pass(name):
    """Arguments no tiny Llama passes (other models' soft-capping and sinks, a KV cache with
    past tokens), given to the registered function directly."""
    key_tokens, overrides, match = DIRECT_REFUSALS[name]
    cu = torch.tensor([0, 5], dtype=torch.int32)
    q, kv = torch.randn(1, 4, 5, 8), torch.randn(1, 2, key_tokens, 8)
    attention = AttentionInterface()["hcp"]
    with pytest.raises(hc.InputError, match=match):
        attention(torch.nn.Module(), q, kv, kv, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=5, max_length_k=5, **overrides)


# --------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------

def test_registers_at_once_when_transformers_is_imported():
    registered = {AttentionInterface: hc.hf.attention_forward,
                  AttentionMaskInterface: hc.hf.mask_function}
    for registry in registered:
        del registry._global_mapping["hcp"]
    hooks_before = list(sys.meta_path)
    try:
        hc.hf.register_when_imported()
        assert sys.meta_path == hooks_before, "an import hook although transformers is imported"
        for registry, function in registered.items():
            assert registry._global_mapping.get("hcp") is function, registry.__name__
    finally:  # the other tests need "hcp" whatever happened here
        for registry, function in registered.items():
            registry.register("hcp", function)


def test_import_registers_lazily_when_transformers_is_first_imported(hf_world):
    """The world's workers import hcp_compile first, transformers later."""
    for rank, flags in enumerate(hf_world.values(hf_cases.LazyRegistrationCase().id)):
        assert flags == {
            "transformers_imported_by_hcp_compile": False, "attention_registered": True,
            "mask_registered": True, "loss_guarded": True, "hook_left": False,
            "loader_restored": True,
        }, f"rank {rank}"


@pytest.mark.parametrize("config, window", [
    ("MistralConfig", (4095, 0)),  # every layer windowed, no layer_types
    ("Gemma2Config", (-1, -1)),  # sliding layers beside full ones
    ("Qwen2Config", (-1, -1)),  # no window
    ("LlamaConfig", (-1, -1)),
])
def test_layout_window_is_the_models_window_only_where_every_layer_slides(config, window):
    import transformers

    from hcp_compile.hf import layout_window

    assert layout_window(getattr(transformers, config)()) == window
    every = transformers.Gemma2Config(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=64)
    assert layout_window(every) == (63, 0)
