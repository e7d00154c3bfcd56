"""Hypothesis fuzzing of single-device ``hcp_compile.varlen_attention`` (no CP active).

Valid calls: random documents (empty and 1-token ones included), MHA/GQA/MQA heads, causal or
not, windows, scales, self- and cross-attention, a ``max_seqlen`` above the longest document,
and the plain kernel's query blocks cut anywhere; out, dq, dk, dv against the float64
reference at fp32 tolerances. Invalid calls: a valid call with one argument corrupted must
raise ``hcp_compile.InputError`` naming that argument, never another exception or a result.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import hcp_compile as hc
from hcp_compile.testing.reference import reference_with_grads
from checks import assert_matches
from cp_cases import HEAD_DIM, cu_seqlens
from hcp_compile.kernels import torch_kernel

HEADS = st.sampled_from([(2, 2), (4, 4), (4, 2), (6, 2), (3, 1), (4, 1)])  # MHA, GQA, MQA
DOC_LENGTH = st.one_of(st.sampled_from([0, 1]), st.integers(0, 11))
DOC_LENGTHS = st.lists(DOC_LENGTH, min_size=1, max_size=5)
WINDOW_SIDE = st.integers(-1, 6)
SCALE = st.one_of(st.none(), st.floats(0.05, 2.0))


def random_tensor(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


@st.composite
def valid_calls(draw) -> dict:
    """The arguments of one valid call, with the ``dout`` of its backward."""
    heads_q, heads_kv = draw(HEADS)
    q_lengths = draw(DOC_LENGTHS)
    cross = draw(st.booleans())
    if cross:  # the reference defines no causal or window masks across unequal documents
        k_lengths = draw(st.lists(DOC_LENGTH, min_size=len(q_lengths), max_size=len(q_lengths)))
        causal, window = False, (-1, -1)
    else:
        k_lengths = q_lengths
        causal, window = draw(st.booleans()), (draw(WINDOW_SIDE), draw(WINDOW_SIDE))
    assume(sum(q_lengths) > 0 and sum(k_lengths) > 0)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    cu_q = cu_seqlens(tuple(q_lengths))
    cu_k = cu_seqlens(tuple(k_lengths)) if cross else cu_q
    return {
        "q": random_tensor(generator, sum(q_lengths), heads_q, HEAD_DIM),
        "k": random_tensor(generator, sum(k_lengths), heads_kv, HEAD_DIM),
        "v": random_tensor(generator, sum(k_lengths), heads_kv, HEAD_DIM),
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "max_seqlen_q": max(q_lengths) + draw(st.integers(0, 3)),
        "max_seqlen_k": max(k_lengths) + draw(st.integers(0, 3)),
        "causal": causal,
        "softmax_scale": draw(SCALE),
        "window_size": window,
        "dout": random_tensor(generator, sum(q_lengths), heads_q, HEAD_DIM),
    }


@settings(max_examples=80, deadline=None)
@given(call=valid_calls(), query_block=st.sampled_from([1, 3, 7, torch_kernel.QUERY_BLOCK]))
def test_matches_the_float64_reference(call, query_block):
    args = {name: value for name, value in call.items() if name != "dout"}
    leaves = {name: args[name].clone().requires_grad_() for name in ("q", "k", "v")}
    with mock.patch.object(torch_kernel, "QUERY_BLOCK", query_block):
        out = hc.varlen_attention(**{**args, **leaves})
        out.backward(call["dout"])
    expected = reference_with_grads(
        call["q"], call["k"], call["v"], call["dout"], call["cu_seqlens_q"].tolist(),
        call["cu_seqlens_k"].tolist(), causal=call["causal"], window=call["window_size"],
        scale=call["softmax_scale"],
    )
    got = {"out": out.detach(), "dq": leaves["q"].grad, "dk": leaves["k"].grad, "dv": leaves["v"].grad}
    for name, value in got.items():
        assert_matches(value, expected[name], name)


# --------------------------------------------------------------------------------------------
# invalid calls: one argument corrupted
# --------------------------------------------------------------------------------------------

Corruption = Callable[[Callable, dict], tuple[dict, str]]  # (draw, call) -> (changes, argument)


def _cu_dtype(draw, call):
    name = draw(st.sampled_from(["cu_seqlens_q", "cu_seqlens_k"]))
    dtype = draw(st.sampled_from([torch.int64, torch.int16, torch.float32]))
    return {name: call[name].to(dtype)}, name


def _cu_shape(draw, call):
    name = draw(st.sampled_from(["cu_seqlens_q", "cu_seqlens_k"]))
    cu = call[name]
    return {name: draw(st.sampled_from([cu[:1], cu.reshape(1, -1), cu.reshape(-1, 1)]))}, name


def _cu_start(draw, call):
    name = draw(st.sampled_from(["cu_seqlens_q", "cu_seqlens_k"]))
    return {name: call[name] + draw(st.integers(1, 3))}, name


def _cu_decreasing(draw, call):
    name = draw(st.sampled_from(["cu_seqlens_q", "cu_seqlens_k"]))
    cu = call[name].clone()
    entry = draw(st.integers(1, cu.numel() - 1))
    cu[entry] = cu[entry - 1] - draw(st.integers(1, 3))
    return {name: cu}, name


def _token_count(draw, call):
    tensor, cu_name = draw(st.sampled_from([("q", "cu_seqlens_q"), ("k", "cu_seqlens_k")]))
    tokens = call[tensor].shape[0]
    new_tokens = draw(st.integers(0, tokens + 4).filter(lambda n: n != tokens))
    resized = torch.cat([call[tensor], call[tensor]])[:new_tokens] if new_tokens else call[tensor][:0]
    changes = {tensor: resized}
    if tensor == "k":
        changes["v"] = resized
    return changes, cu_name


def _max_seqlen_too_small(draw, call):
    name, cu = draw(st.sampled_from([("max_seqlen_q", "cu_seqlens_q"), ("max_seqlen_k", "cu_seqlens_k")]))
    longest = int((call[cu][1:] - call[cu][:-1]).max())
    assume(longest > 0)
    return {name: draw(st.integers(-2, longest - 1))}, name


def _max_seqlen_not_int(draw, call):
    name = draw(st.sampled_from(["max_seqlen_q", "max_seqlen_k"]))
    value = call[name]
    return {name: draw(st.sampled_from([float(value), str(value), None, torch.tensor(value), True]))}, name


def _window(draw, call):
    bad = st.sampled_from([(-2, 0), (0, -5), (3,), (1, 2, 3), (1.5, 0), (0, None), "-1,-1", None])
    return {"window_size": draw(bad)}, "window_size"


def _qkv_rank(draw, call):
    name = draw(st.sampled_from(["q", "k", "v"]))
    t = call[name]
    return {name: draw(st.sampled_from([t[:, 0], t[None], t.reshape(-1)]))}, name


def _not_a_tensor(draw, call):
    name = draw(st.sampled_from(["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"]))
    return {name: call[name].tolist()}, name


def _kv_shapes_differ(draw, call):
    v = call["v"]
    return {"v": draw(st.sampled_from([torch.cat([v, v], dim=1), v[..., :-1], torch.cat([v, v])]))}, "k, v"


def _head_dim_differs(draw, call):
    cut = draw(st.integers(1, HEAD_DIM - 1))
    return {"k": call["k"][..., :cut], "v": call["v"][..., :cut]}, "q, k"


def _dtypes_differ(draw, call):
    name = draw(st.sampled_from(["q", "k", "v"]))
    return {name: call[name].to(draw(st.sampled_from([torch.float64, torch.bfloat16])))}, "q, k, v"


def _heads_not_a_multiple(draw, call):
    heads_kv = call["k"].shape[1]
    assume(heads_kv > 1)
    heads_q = draw(st.sampled_from([h for h in range(1, 10) if h % heads_kv]))
    return {"q": call["q"][:, :1].expand(-1, heads_q, -1).contiguous()}, "q, k"


def _document_counts_differ(draw, call):
    cu_k = call["cu_seqlens_k"]
    more = torch.cat([cu_k, cu_k[-1:].expand(draw(st.integers(1, 2)))])
    return {"cu_seqlens_k": more}, "cu_seqlens_q, cu_seqlens_k"


CORRUPTIONS: dict[str, Corruption] = {
    f.__name__.lstrip("_"): f for f in (
        _cu_dtype, _cu_shape, _cu_start, _cu_decreasing, _token_count, _max_seqlen_too_small,
        _max_seqlen_not_int, _window, _qkv_rank, _not_a_tensor, _kv_shapes_differ,
        _head_dim_differs, _dtypes_differ, _heads_not_a_multiple, _document_counts_differ,
    )
}


@settings(max_examples=200, deadline=None)
@given(call=valid_calls(), corruption=st.sampled_from(sorted(CORRUPTIONS)), data=st.data())
def test_one_invalid_argument_raises_input_error_naming_it(call, corruption, data):
    changes, argument = CORRUPTIONS[corruption](data.draw, call)
    args = {**{name: value for name, value in call.items() if name != "dout"}, **changes}
    with pytest.raises(hc.InputError, match=f"^{re.escape(argument)}:"):
        hc.varlen_attention(**args)
