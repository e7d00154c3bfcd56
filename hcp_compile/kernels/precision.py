"""The precision of lse and of every accumulation (the ring merge, dq and the dKV sums).

It sits below both the kernels and :mod:`hcp_compile.kernels.merge`, which each need it, so that
neither imports the other's package for it."""

import torch


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 inputs accumulate in float64, everything else in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
