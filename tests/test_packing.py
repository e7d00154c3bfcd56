"""``hcp_compile.cu_seqlens_from_position_ids``: document boundaries from the ``position_ids``
of packing collators, against a reference written as a plain loop, and its input errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hcp_compile as hc

lengths_st = st.lists(st.integers(1, 30), min_size=1, max_size=12)


def packed_positions(lengths: list[int]) -> torch.Tensor:
    """What DataCollatorWithFlattening emits for documents of these lengths."""
    return torch.cat([torch.arange(length) for length in lengths])


def reference_boundaries(positions: list[int]) -> tuple[list[int], int]:
    """Token by token: a position 0 opens a document, the end closes the last one."""
    starts = [i for i, p in enumerate(positions) if p == 0]
    cu = [*starts, len(positions)]
    return cu, max(b - a for a, b in zip(cu, cu[1:]))


@settings(max_examples=60, deadline=None)
@given(
    lengths=lengths_st,
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int16]),
    batched=st.booleans(),
)
def test_matches_reference(lengths: list[int], dtype: torch.dtype, batched: bool) -> None:
    positions = packed_positions(lengths).to(dtype)
    if batched:
        positions = positions[None]
    cu_seqlens, max_seqlen = hc.cu_seqlens_from_position_ids(positions)
    expected_cu, expected_max = reference_boundaries(positions.flatten().tolist())
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == expected_cu
    assert max_seqlen == expected_max == max(lengths)
    assert isinstance(max_seqlen, int)


def test_one_token_documents_and_one_document() -> None:
    cu, longest = hc.cu_seqlens_from_position_ids(torch.zeros(4, dtype=torch.long))
    assert (cu.tolist(), longest) == ([0, 1, 2, 3, 4], 1)
    cu, longest = hc.cu_seqlens_from_position_ids(torch.arange(7)[None])
    assert (cu.tolist(), longest) == ([0, 7], 7)


def test_result_feeds_varlen_attention() -> None:
    """The output is what varlen attention takes: int32 cu_seqlens, a max_seqlen bound."""
    positions = packed_positions([5, 3, 8])
    cu, longest = hc.cu_seqlens_from_position_ids(positions)
    q = torch.randn(16, 2, 4)
    out = hc.varlen_attention(q, q, q, cu, cu, longest, longest, causal=True)
    assert out.shape == q.shape


@pytest.mark.parametrize(
    ("position_ids", "match"),
    [
        ([0, 1, 2], "expected a torch.Tensor, got list"),
        (torch.zeros(2, 3, dtype=torch.long), r"\[T\] or \[1, T\].*shape \(2, 3\)"),
        (torch.zeros(1, 1, 3, dtype=torch.long), r"\[T\] or \[1, T\].*shape \(1, 1, 3\)"),
        (torch.tensor(0), r"\[T\] or \[1, T\].*shape \(\)"),
        (torch.zeros(0, dtype=torch.long), r"non-empty.*shape \(0,\)"),
        (torch.tensor([0.0, 1.0]), "integer dtype, got torch.float32"),
        (torch.tensor([True, False]), "integer dtype, got torch.bool"),
        (torch.tensor([1, 2, 0]), r"first token must start a document \(position 0\), got 1"),
        (torch.tensor([0, 1, -1]), "must be >= 0, but entry 2 is -1"),
        (torch.tensor([0, 1, 3]), "entry 2 is 3 after 1"),
        (torch.tensor([0, 1, 2, 1]), "entry 3 is 1 after 2"),
    ],
    ids=["list", "2-rows", "3-D", "0-D", "empty", "float", "bool", "first-not-0", "negative",
         "skips", "steps-back"],
)
def test_rejects_bad_position_ids(position_ids, match: str) -> None:
    with pytest.raises(hc.InputError, match=match) as error:
        hc.cu_seqlens_from_position_ids(position_ids)
    assert str(error.value).startswith("position_ids: ")
