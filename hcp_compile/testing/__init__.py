"""Testing support for hcp_compile (as ``torch.testing`` is for torch): what the test suite and
the GPU property cases (tests/test_gpu_properties.py) share, for any code that checks the
library. ``import hcp_compile`` imports nothing of it; only ``strategies`` needs hypothesis (a
test dependency).

- ``worlds``: process worlds: a gloo world of N ranks per mesh that runs a suite of cases on
  each rank and collects every rank's record (failures included); ``served``: a world that
  runs requests one at a time (hypothesis-driven CP cases).
- ``reference``: the independent float64 single-device attention (a loop over documents and
  heads); ``scaled_reference``: the same for batches of any size on any device, and torch's
  SDPA baseline.
- ``cases``, ``profiles``, ``strategies``: property cases, what a device's are drawn from, and
  the hypothesis strategies that draw them (packed batches with documents of length 0, 1, odd
  and long, heads and GQA, causal and windowed masks, dtypes, kernels from the registry).
- ``bounds``: the error bound a property case's results must meet; ``runs``: running a case on
  one device or under CP (every placement of the registry, eager and compiled).
"""
