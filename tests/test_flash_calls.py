"""What the flash kernel hands to ``aten._flash_attention_forward/backward`` (docs/design.md §8.4,
Note [flash's special paths]), on CPU.

The aten ops have no CPU kernel, so a dispatch mode stands in for them: it records every call's
arguments, refuses what FlashAttention-2's varlen entry points refuse or break on (its GQA
decoding shortcut's reshape when ``max_seqlen_q`` is 1, no segments, a key bound of 0 in the
backward, bounds that do not cover the segments), and otherwise computes flash's results in
float64 from their definition (bottom-right causal alignment, lse +inf for a row without keys).
The kernel's results are checked against the float64 reference of whole documents."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from hcp_compile.testing.reference import reference_with_grads
from checks import assert_matches
from cp_cases import HEAD_DIM, cu_seqlens, seeded
from hcp_compile.kernels import BlockSpec, dense, flash
from hcp_compile.kernels.flash import FlashKernel

FORWARD = torch.ops.aten._flash_attention_forward.default
BACKWARD = torch.ops.aten._flash_attention_backward.default


def _segments(cu: Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(zip(bounds, bounds[1:]))


def _visible(len_q: int, len_k: int, causal: bool) -> Tensor:
    """Flash's mask of one segment: causal aligned bottom-right."""
    if not causal:
        return torch.ones(len_q, len_k, dtype=torch.bool)
    return torch.arange(len_k)[None, :] <= torch.arange(len_q)[:, None] + (len_k - len_q)


class FlashStandIn(TorchDispatchMode):
    """The two flash ops as FlashAttention-2's varlen entry points behave, in float64."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is FORWARD:
            return self._forward(*args, **kwargs)
        if func is BACKWARD:
            return self._backward(*args, **kwargs)
        return func(*args, **kwargs)

    def _check(self, q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int) -> None:
        segments = cu_q.numel() - 1
        if segments <= 0:
            raise RuntimeError("batch size must be positive")
        longest_q = max(b - a for a, b in _segments(cu_q))
        longest_k = max(b - a for a, b in _segments(cu_k))
        if longest_q > max_q or longest_k > max_k:  # flash's grid would leave rows out
            raise AssertionError(f"bounds {max_q}, {max_k} do not cover segments of {longest_q}, {longest_k}")

    def _forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                 scale=None, window_size_left=None, window_size_right=None, **_):
        self.calls.append({"op": "forward", "max_q": max_q, "max_k": max_k, "segments": cu_q.numel() - 1})
        heads, heads_kv, dim = q.shape[1], k.shape[1], q.shape[2]
        if max_q == 1 and heads > heads_kv and window_size_left is None and window_size_right is None:
            # FlashAttention-2's GQA decoding shortcut: one query per segment assumed
            q.reshape(cu_q.numel() - 1, heads_kv, heads // heads_kv, dim)
        self._check(q, k, cu_q, cu_k, max_q, max_k)
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full((heads, q.shape[0]), float("inf"), dtype=torch.float64)
        group = heads // heads_kv
        for (q0, q1), (k0, k1) in zip(_segments(cu_q), _segments(cu_k)):
            if q1 == q0 or k1 == k0:
                continue
            mask = _visible(q1 - q0, k1 - k0, is_causal)
            for h in range(heads):
                scores = q[q0:q1, h].double() @ k[k0:k1, h // group].double().T * scale
                scores = scores.masked_fill(~mask, float("-inf"))
                row_lse = torch.logsumexp(scores, 1)
                seen = mask.any(1)
                probs = torch.where(seen[:, None], torch.exp(scores - row_lse[:, None]), 0.0)
                out[q0:q1, h] = probs @ v[k0:k1, h // group].double()
                lse[h, q0:q1] = torch.where(seen, row_lse, float("inf"))
        unused = torch.empty(0)
        return out.to(q.dtype), lse.float(), unused, unused, unused

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state,
                  unused, *, scale=None, window_size_left=None, window_size_right=None):
        self.calls.append({"op": "backward", "max_q": max_q, "max_k": max_k, "segments": cu_q.numel() - 1})
        if max_k == 0:
            raise RuntimeError("CUDA error: invalid configuration argument (a grid of no key tiles)")
        self._check(q, k, cu_q, cu_k, max_q, max_k)
        heads, group = q.shape[1], q.shape[1] // k.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float64)
        dk = torch.zeros(k.shape, dtype=torch.float64)
        dv = torch.zeros(v.shape, dtype=torch.float64)
        for (q0, q1), (k0, k1) in zip(_segments(cu_q), _segments(cu_k)):
            if q1 == q0 or k1 == k0:
                continue
            mask = _visible(q1 - q0, k1 - k0, is_causal)
            for h in range(heads):
                qh, kh, vh = q[q0:q1, h].double(), k[k0:k1, h // group].double(), v[k0:k1, h // group].double()
                do, o = dout[q0:q1, h].double(), out[q0:q1, h].double()
                scores = (qh @ kh.T * scale).masked_fill(~mask, float("-inf"))
                probs = torch.exp(scores - lse[h, q0:q1].double()[:, None])  # +inf lse: weights 0
                dv[k0:k1, h // group] += probs.T @ do
                dscores = probs * (do @ vh.T - (do * o).sum(1, keepdim=True))
                dq[q0:q1, h] = dscores @ kh * scale
                dk[k0:k1, h // group] += dscores.T @ qh * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _inputs(lengths: tuple[int, ...], heads_q: int, heads_kv: int) -> dict[str, Tensor]:
    tokens = sum(lengths)
    shapes = {"q": heads_q, "k": heads_kv, "v": heads_kv, "dout": heads_q}
    return {name: seeded(f"flash-calls/{name}", tokens, heads, HEAD_DIM) for name, heads in shapes.items()}


def _flash_with_grads(x: dict[str, Tensor], lengths: tuple[int, ...], causal: bool, longest: int) -> dict:
    """The flash kernel's forward and backward on whole documents, as single-device calls make them."""
    cu = cu_seqlens(lengths)
    spec = BlockSpec(cu, cu, longest, longest, causal, HEAD_DIM ** -0.5)
    kernel = FlashKernel()
    out, lse = kernel.forward(x["q"], x["k"], x["v"], spec)
    dq, dk, dv = kernel.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, spec)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


# the reported crashes ([4096, 1, 0, 4096] and [1, 1, 0, 1] with 32/8 heads), shorter; and the
# other shapes whose bounds are 0 or 1
LENGTHS = [(40, 1, 0, 40), (1, 1, 0, 1), (1, 0), (0, 1, 1), (0, 0, 3), (0, 0)]
HEADS = [(8, 2), (4, 4)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}.{h[1]}")
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda n: "-".join(map(str, n)))
def test_flash_calls_stay_off_special_paths_and_match_reference(lengths, heads, causal):
    """The query bound handed to aten is at least 2 whatever the documents are, no call without
    rows reaches aten, and the results are the documents' attention (float64 reference)."""
    x = _inputs(lengths, *heads)
    longest = max(lengths)
    with FlashStandIn() as stand_in:
        got = _flash_with_grads(x, lengths, causal, longest)
    bounds = cu_seqlens(lengths).tolist()
    expected = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], bounds, bounds, causal=causal)
    for name in ("out", "dq", "dk", "dv"):
        assert_matches(got[name], expected[name], name)
    assert all(call["max_q"] >= 2 and call["max_k"] >= 1 and call["segments"] > 0 for call in stand_in.calls)
    assert len(stand_in.calls) == (2 if sum(lengths) else 0)


def test_the_stand_in_raises_what_the_gpu_raised_without_the_bounds(monkeypatch):
    """Without the raised query bound, the stand-in fails as the H200 did on the reported batch
    (so the test above can fail)."""
    monkeypatch.setattr(flash, "MIN_MAX_SEQLEN_Q", 1)
    x = _inputs((1, 1, 0, 1), 8, 2)
    with FlashStandIn(), pytest.raises(RuntimeError, match=rf"shape '\[4, 2, 4, {HEAD_DIM}\]' is invalid"):
        _flash_with_grads(x, (1, 1, 0, 1), True, 1)


def test_dense_kernel_runs_of_one_token_documents_reach_flash_with_raised_bounds(monkeypatch):
    """The dense kernel's varlen runs (segments of 0 and 1 queries beside a dense segment) go to
    flash on CUDA: on CPU they are sent there too, under the stand-in, and give the documents'
    attention."""
    monkeypatch.setattr(dense, "SHORT_KERNELS", {"cpu": FlashKernel()})
    monkeypatch.setattr(dense, "MIN_DENSE_ROWS", 8)
    lengths = (1, 0, 1, 24, 1, 0, 0, 1)
    x = _inputs(lengths, 8, 2)
    cu = cu_seqlens(lengths)
    spec = BlockSpec(cu, cu, max(lengths), max(lengths), True, HEAD_DIM ** -0.5)
    kernel = dense.DenseKernel()
    with FlashStandIn() as stand_in:
        out, lse = kernel.forward(x["q"], x["k"], x["v"], spec)
        dq, dk, dv = kernel.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, spec)
    expected = reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu.tolist(), cu.tolist(), causal=True)
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_matches(got, expected[name], name)
    runs = [call for call in stand_in.calls if call["op"] == "forward"]
    assert runs and all(call["max_q"] == 2 for call in runs)  # runs of 1-token documents
