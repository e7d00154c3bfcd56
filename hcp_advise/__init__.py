"""Which ``ulysses x ring`` mesh and placement for a user's batches: a cost model from
measured parts and a chooser over the valid meshes.

    python -m hcp_advise --world 64 --gpus-per-node 8 --heads 32/8 --head-dim 128 \\
        --lengths loguniform:256:32768 --tokens 1048576

The model predicts one causal forward + backward of one attention call per rank, as the sum of
explicit parts, each a pure function that a GPU measurement can check on its own (one module
each: records.py, compute.py, communication.py, overlap.py, host.py; chooser.py, report.py,
command.py):

- compute (:func:`compute_times`): each block's visible query-key pairs (from the real layout
  of the placement rule, :mod:`hcp_compile.batch.layout`) times ``14 * head_dim`` FLOPs per pair
  and query head, at the TF/s measured for the kernel on the device kind and the block's
  composition (one document, log-uniform or short documents) and, where the device recorded
  several call sizes, for calls of the block's work (:func:`kernel_table`: what
  ``python -m hcp_advise --measure`` stored for that GPU kind, measure.py, else
  kernels/measured.json); the forward takes 2 of the 7 products (docs/design.md §7);
- all-to-all (:func:`exchange_times`) and ring (:func:`hop_times`): the bytes that
  ``batch.traffic.call_traffic`` counts for the rank, over the link of each level
  (:class:`Links`), plus a latency per collective;
- overlap (:func:`ring_forward`, :func:`ring_backward`, :func:`pipeline`): what the code
  overlaps (docs/design.md §3.3, §3.6, §4): every ring hop travels behind the step before the
  one that reads it, the backward's dKV hop behind the next step, its last hop exposed; head
  group ``g + 1``'s exchange behind group ``g``'s ring, group 0's behind the local region;
- passes (:func:`pass_bytes`, :func:`pass_times`): the GPU's memory-bound work besides the
  attention kernels (merges of partial outputs, fp32 sums of dq and dKV, packing and joining
  copies), the bytes each pass reads and writes at the bandwidth such passes reach
  (``PASS_BYTES_PER_S``, from a copy in a stored H200 trace); a ring step's run on the compute
  stream with its kernels, the others before and after the pipelines;
- host (:func:`host_counts`, :func:`host_times`, :func:`lead_counts`, :func:`step_with_host`):
  the seconds a rank's host takes to issue each phase of its eager call, from its kernel calls,
  ring-step iterations and head groups at the constants hcp_advise/host_measured.json records
  for the device, mode and kernel (``benchmarks/host_times.py`` measures them). The GPU cannot
  start a kernel before the host has issued it: a phase's GPU work waits for the host's work
  before its first kernel (the forward's is exposed, the backward's runs under the forward's GPU
  work), and a phase ends no sooner than its host has issued its last block and the GPU has run
  it. Where no constants are recorded the host part is 0 and the report says so.

A step's time is its slowest rank's, for one call issued alone (the forward's host lead exposed,
as in the check); options within the model's measured error of the best (``MODEL_ERROR``) are
reported as a tie. An option's efficiency is one GPU's time for the whole batch
(:func:`one_gpu_call`: one call of every document, priced as a block) over ``N`` x its step; its
balance (:func:`balance`) a rank's tokens with pads over the mean real tokens per rank. Not
modelled: the host work of a compiled call, contention between an all-to-all and ring hops on one
NVLink domain; ``benchmarks/advisor_check.py`` measures how far
the model is from single ranks (docs/benchmarks.md, "Advisor check"). A
causal sliding window (``window``) lays each batch out for it (``shard_plan(..., window=)``),
limits every block's pairs (:func:`visible_pairs`, exact) and the schedule's steps
(``layout.window_steps``), and times them at the windowed throughput of the kernel CP takes for
it; its host part is that of calls without a window.
"""

from __future__ import annotations

from .records import (
    Advice, BlockWork, ComputeTimes, DEFAULT_DEVICE, ExchangeTimes, HopTimes, HostCounts, Links,
    MODEL_ERROR, MODEL_ERROR_WINDOW, OneGpuCall, Option, PASS_BYTES_PER_S, Passes, PhaseTimes, Prediction, SCHEME,
)
from .measurements import KernelTable, Timing, cache_dir, cache_file, entry_of, kernel_table
from .compute import (
    block_composition, block_seconds, block_work, compute_times, cuts_short_segments, one_gpu_call, visible_pairs,
)
from .communication import exchange_bytes, exchange_times, hop_times, rank_sizes, ring_link
from .host import host_counts, host_leads, host_times, kernel_calls, lead_counts, step_with_host
from .passes import active_steps, pass_bytes, pass_times
from .overlap import pipeline, predict_rank, ring_backward, ring_forward
from .chooser import advise, balance, cuda_kernel, mesh_options, predict
from .report import format_advice, tied
from .command import batches_from, cu_seqlens_of, main

__all__ = [
    "Advice",
    "BlockWork",
    "ComputeTimes",
    "DEFAULT_DEVICE",
    "ExchangeTimes",
    "HopTimes",
    "HostCounts",
    "KernelTable",
    "Links",
    "MODEL_ERROR",
    "MODEL_ERROR_WINDOW",
    "OneGpuCall",
    "Option",
    "PASS_BYTES_PER_S",
    "Passes",
    "PhaseTimes",
    "Prediction",
    "SCHEME",
    "Timing",
    "active_steps",
    "advise",
    "balance",
    "batches_from",
    "block_composition",
    "block_seconds",
    "block_work",
    "visible_pairs",
    "cache_dir",
    "cache_file",
    "compute_times",
    "cu_seqlens_of",
    "cuda_kernel",
    "cuts_short_segments",
    "entry_of",
    "exchange_bytes",
    "exchange_times",
    "format_advice",
    "hop_times",
    "host_counts",
    "host_leads",
    "host_times",
    "kernel_calls",
    "kernel_table",
    "lead_counts",
    "main",
    "mesh_options",
    "one_gpu_call",
    "pass_bytes",
    "pass_times",
    "pipeline",
    "predict",
    "predict_rank",
    "rank_sizes",
    "ring_backward",
    "ring_forward",
    "ring_link",
    "step_with_host",
    "tied",
]
