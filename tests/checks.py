"""Assertions and expectations shared by the test modules."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from attention_reference import reference_with_grads
from cp_cases import AttentionCase, cu_seqlens

FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}  # docs/design.md §6, fp32 on CPU


@functools.cache
def expected_for(case: AttentionCase, input_dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Float64 reference out, dq, dk, dv of a case's global inputs (self-attention), the
    inputs first rounded to ``input_dtype`` (the dtype the library is run in)."""
    x = {name: t.to(input_dtype) for name, t in case.inputs().items()}
    cu = cu_seqlens(case.lengths).tolist()
    return reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu, cu, **case.mask_args)


def assert_matches(got: Tensor, expected: Tensor, what: str, **tol) -> None:
    """No NaN/Inf, and close to the float64 expectation (fp32 tolerances by default)."""
    assert torch.isfinite(got).all(), f"{what}: NaN or Inf in the result"
    torch.testing.assert_close(got.double(), expected.double(), **(tol or FP32_TOL),
                               msg=lambda m: f"{what}: {m}")


def assert_raised(record, cls: type, match: str, what: str) -> None:
    """A worker's :class:`distributed.CaseRecord` shows ``cls`` raised with ``match`` in it."""
    assert record.raised_instance_of(cls), f"{what}: expected {cls.__name__}, {record.describe()}"
    assert match in record.message, f"{what}: {match!r} not in the message {record.message!r}"
