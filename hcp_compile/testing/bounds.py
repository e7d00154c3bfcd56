"""How far a property case's results may be from the float64 reference.

Per tensor (out, dq, dk, dv), the max abs error against the reference:

    error <= ERROR_FACTOR * baseline_error
             + (FLOOR_ULPS * eps(dtype) + ACCUMULATION_ULPS * eps(float32)) * max(max |reference|, 1)

``baseline_error`` is what torch's own SDPA makes on the same data in the same dtype
(``scaled_reference.sdpa_baseline``). ERROR_FACTOR = 4: the ring merges fp32 partial results of
low-precision blocks, which measured up to 1.7x single-device error on the H200
(docs/benchmarks.md, GPU check), and both sides are maxima over many elements; a real bug (a key
too many or too few, a wrong merge or scale) shows as errors of many ulps. The floor, one ulp at
the larger of the tensor's magnitude and the inputs' (1), keeps the bound meaningful where SDPA
happens to be exact (1-token documents: out = v, dq = 0, which the kernels compute from sums in
another order) or nearly so (tiny batches, fp32 on CPU). The kernels accumulate in fp32, and a
result that cancels keeps that rounding (a 1-token document's dk is 0 computed as a difference
of terms of the inputs' size: 1.5 fp32 ulps from flex on CPU, where SDPA gives exactly 0):
ACCUMULATION_ULPS fp32 ulps, far below one bf16 or fp16 ulp. The baseline error enters at most
BASELINE_MAX_ULPS ulps, and the baseline is itself held to that plus the same fp32 accumulation
(SDPA's fp32 gradients cancel as the kernels' do); else the reference or torch is off, and the
bound would mean nothing. Also: no NaN/Inf, and pad rows exactly 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .cases import GRADIENTS, Result

ERROR_FACTOR = 4.0
FLOOR_ULPS = 1.0
ACCUMULATION_ULPS = 8.0
BASELINE_MAX_ULPS = 16.0


@dataclass(frozen=True)
class Verdict:
    """How one run's out, dq, dk and dv compare with the reference."""

    errors: dict[str, float]  # max abs error
    bounds: dict[str, float]
    baseline: dict[str, float]  # SDPA's max abs error (as it enters the bound)
    problems: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def ratio(self) -> float:
        """Worst error / bound (inf for NaN/Inf)."""
        return max((self.errors[n] / self.bounds[n] if self.bounds[n] > 0 else math.inf)
                   if self.errors[n] > 0 else 0.0 for n in GRADIENTS)

    def describe(self) -> str:
        rows = [f"  {n}: error {self.errors[n]:.3g}, SDPA's {self.baseline[n]:.3g}, bound {self.bounds[n]:.3g}"
                for n in GRADIENTS]
        return "\n".join(["; ".join(self.problems) or "passed", *rows])


def max_abs_error(actual: Tensor, expected: Tensor) -> float:
    """Max |actual - expected| in ``expected``'s dtype; inf if ``actual`` is not finite."""
    if actual.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(actual).all()):
        return math.inf
    return (actual.to(expected.dtype) - expected).abs().max().item()


def ulp_scale(expected: Tensor, dtype: torch.dtype) -> float:
    """One ulp of ``dtype`` at the larger of the tensor's magnitude and the inputs' (1)."""
    magnitude = expected.abs().max().item() if expected.numel() else 0.0
    return torch.finfo(dtype).eps * max(magnitude, 1.0)


def judge(result: Result, expected: Result, baseline: Result | None, dtype: torch.dtype) -> Verdict:
    """``result`` against the reference under the module's bound; with ``baseline`` None,
    ``result`` is the baseline, held to BASELINE_MAX_ULPS."""
    errors, bounds, base_errors, problems = {}, {}, {}, []
    for name in GRADIENTS:
        got, ref = getattr(result, name), getattr(expected, name)
        ulp = ulp_scale(ref, dtype)
        accumulation = ACCUMULATION_ULPS * ulp_scale(ref, torch.float32)
        errors[name] = max_abs_error(got, ref)
        if baseline is None:
            # SDPA accumulates in fp32 too: a result that cancels keeps that rounding
            base_errors[name], bounds[name] = errors[name], BASELINE_MAX_ULPS * ulp + accumulation
        else:
            base = max_abs_error(getattr(baseline, name), ref)
            base_errors[name] = min(base, BASELINE_MAX_ULPS * ulp)  # inf/NaN too: the cap
            bounds[name] = ERROR_FACTOR * base_errors[name] + FLOOR_ULPS * ulp + accumulation
        if math.isinf(errors[name]):
            problems.append(f"{name} has NaN/Inf")
        elif errors[name] > bounds[name]:
            problems.append(f"{name} error {errors[name]:.3g} > bound {bounds[name]:.3g} "
                            f"(SDPA's error {base_errors[name]:.3g})")
    if result.pad_max != 0:
        problems.append(f"pad rows hold |value| up to {result.pad_max:.3g} (must be 0)")
    return Verdict(errors, bounds, base_errors, tuple(problems))
