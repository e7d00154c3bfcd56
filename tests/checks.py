"""Assertions and expectations shared by the test modules."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from hcp_compile.testing.reference import reference_with_grads
from cp_cases import AttentionCase, cu_seqlens

FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}  # docs/design.md §6, fp32 on CPU
# Two computations of the same values on other shapes or through other ops: other head groups
# or blocks, a compiled graph. ATen's CPU kernels promise no bit-equal results across shapes:
# matmuls of other shapes may sum in another order, and with AVX2/AVX512 kernels an element of
# torch.logaddexp (the ring's merge) differs in the last bit by whether the tensor's shape puts
# it in a vector loop or its scalar tail. Such results can be bit-equal on one machine and not
# on another; they agree to a few roundings (measured: at most 1.4 eps of the scale apart, with
# ATEN_CPU_CAPABILITY default, avx2 and avx512).
ROUNDING_ULPS = 16
RESULTS = ("out", "dq", "dk", "dv")


@functools.cache
def expected_for(case: AttentionCase, input_dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Float64 reference out, dq, dk, dv of a case's global inputs (self-attention), the
    inputs first rounded to ``input_dtype`` (the dtype the library is run in)."""
    x = {name: t.to(input_dtype) for name, t in case.inputs().items()}
    cu = cu_seqlens(case.lengths).tolist()
    return reference_with_grads(x["q"], x["k"], x["v"], x["dout"], cu, cu, **case.mask_args)


def nan_filled_results(like: Tensor, filled: bool, shape: tuple[int, ...] | None = None,
                       dtype: torch.dtype | None = None, unwritten: float = 0.0) -> Tensor:
    """Stands in for the dense kernel's ``_results``: results it leaves uninitialized come as
    NaN, so a row or key that no piece writes shows in the results."""
    return like.new_full(like.shape if shape is None else shape, float("nan") if filled else unwritten,
                         dtype=dtype)


def assert_matches(got: Tensor, expected: Tensor, what: str, **tol) -> None:
    """No NaN/Inf, and close to the float64 expectation (fp32 tolerances by default)."""
    assert torch.isfinite(got).all(), f"{what}: NaN or Inf in the result"
    torch.testing.assert_close(got.double(), expected.double(), **(tol or FP32_TOL),
                               msg=lambda m: f"{what}: {m}")


def assert_rounding_close(got: Tensor, other: Tensor, what: str, ulps: float = ROUNDING_ULPS) -> None:
    """``got`` and ``other`` differ by rounding only: by at most ``ulps`` machine epsilons of
    their dtype relative to each element plus as many relative to the largest finite
    ``|other|`` (a sum's rounding follows the size of its terms, which may cancel). Non-finite
    values must match. Far tighter than the reference's tolerance (fp32: 16 eps is 1.9e-6)."""
    eps = torch.finfo(other.dtype).eps
    finite = other[torch.isfinite(other)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    torch.testing.assert_close(got, other, atol=ulps * eps * scale, rtol=ulps * eps,
                               msg=lambda m: f"{what}: {m}")


def assert_raised(record, cls: type, match: str, what: str) -> None:
    """A worker's :class:`hcp_compile.testing.worlds.CaseRecord` shows ``cls`` raised with ``match`` in it."""
    assert record.raised_instance_of(cls), f"{what}: expected {cls.__name__}, {record.describe()}"
    assert match in record.message, f"{what}: {match!r} not in the message {record.message!r}"


def local_rows(global_tensor: Tensor, global_index: Tensor, fill: float = 0.0) -> Tensor:
    """The rows of a global tensor that a rank holds (dim 0), ``fill`` at its pads (index -1)."""
    pads = (global_index < 0).reshape(-1, *([1] * (global_tensor.dim() - 1)))
    return global_tensor[global_index.clamp(min=0)].masked_fill(pads, fill)


def assert_compiled_rank_matches(result, index: int | str, reference: dict[str, Tensor], rank: int,
                                 against_eager: bool = True) -> None:
    """One rank's compiled results of batch ``index`` (``<index>/<name>``, ``<index>/global_index``
    and, with ``against_eager``, ``<index>/eager_<name>``): the float64 reference's rows, zero at
    the pads, and eager CP's up to rounding."""
    global_index = result[f"{index}/global_index"]
    for name in RESULTS:
        got = result[f"{index}/{name}"]
        assert_matches(got, local_rows(reference[name], global_index), f"rank {rank} {name}")
        assert (got[global_index < 0] == 0).all(), f"rank {rank}: {name} is not zero at the pads"
        if against_eager:
            assert_rounding_close(got, result[f"{index}/eager_{name}"], f"rank {rank} {name} vs eager CP")


def run_counting(attend, op: str) -> tuple[object, int]:
    """``attend()``'s result and how many calls of the op named ``op`` (its profiler key, e.g.
    ``"hcp::block_forward"``) it ran on the host."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = attend()
    return result, sum(event.count for event in profile.key_averages() if event.key == op)
