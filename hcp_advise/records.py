"""The advisor's records and constants: the links, an option, and the predictions of its parts."""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import Tensor

from hcp_compile.validation import InputError

# FLOPs of one visible query-key pair per query head and unit of head dim, forward + backward:
# 7 products of 2 FLOPs (the count measured.json's TF/s are taken with, benchmarks/speed.py)
FLOPS_PER_PAIR_HEAD_DIM = 14
FORWARD_SHARE = 2 / 7  # the forward's 2 products (q k^T, p v) of the 7 (docs/design.md §7)
SCHEME = "ring"  # the collective scheme whose overlap the model describes (schemes/ring.py)
DEFAULT_DEVICE = "NVIDIA H200"
STORED_MEASUREMENTS = "hcp_compile/kernels/measured.json"  # the runtime's kernel measurements
# Bytes per second that the GPU's memory-bound passes besides the attention kernels (merges, fp32
# sums, packing and joining copies: hcp_advise/passes.py) read and write on the NVIDIA H200, as a
# large device-to-device copy in a committed trace moved them, close to the memory's peak; a
# cuDNN conversion pass in another trace came near it (the traces and figures: docs/benchmarks.md,
# "Advisor check"). Other GPUs: not measured, this figure stands.
PASS_BYTES_PER_S = 4.2e12
# The model's error: the median of |predicted - measured| / measured (the whole prediction: compute,
# passes and host; half the ranks came closer) over the ranks of its check
# (benchmarks/advisor_check.py, each rank measured alone; docs/benchmarks.md, "Advisor check", with
# the run's date and machine): benchmarks/results/advisor_check.json, the ranks of W1-W3 with cudnn;
# under a window advisor_check_w4.json, the ranks of W4 with flex. Predictions closer than this are
# a tie. tests/test_advise_explains.py predicts those files' measured ranks again with the current
# model and checks both figures against the medians it gets.
MODEL_ERROR = 0.051
MODEL_ERROR_WINDOW = 0.106


@dataclass(frozen=True)
class Links:
    """Bandwidth (bytes/s, one direction, per GPU) and latency (s per collective) of each level.

    The NVLink defaults (an all-to-all of 2 ranks, a ring transfer) are measured on an H200
    node (docs/benchmarks.md, "Figures behind the design" §7); the network's is nominal, a
    400 Gb/s link per GPU. The latencies are assumptions to be measured on the GPU machines:
    they matter only where the steps are short (many ring ranks, small batches)."""

    all_to_all_bytes_per_s: float = 440e9
    ring_nvlink_bytes_per_s: float = 290e9
    network_bytes_per_s: float = 50e9
    nvlink_latency_s: float = 10e-6
    network_latency_s: float = 25e-6

    def __post_init__(self) -> None:
        for f in fields(self):
            value, least = getattr(self, f.name), "> 0" if f.name.endswith("bytes_per_s") else ">= 0"
            if not isinstance(value, (int, float)) or not (value > 0 if least == "> 0" else value >= 0):
                raise InputError(f"links.{f.name}: expected a number {least}, got {value!r}")


@dataclass(frozen=True)
class Option:
    """One mesh and placement: ``make_mesh(ulysses=o.ulysses, ring=o.ring)``,
    ``shard_plan(..., placement=o.placement)``."""

    ulysses: int
    ring: int
    placement: str


@dataclass(frozen=True)
class BlockWork:
    """The causal query-key pairs of every block of every rank, each counted per query head of
    the block (a stream block runs ``1/A`` of the heads, so its pairs are divided by ``A``),
    and each block's composition (a key of measured.json, None for an empty block)."""

    local: Tensor  # [R, A] pairs of the local region (all heads)
    steps: Tensor  # [R, S] pairs of ring step s of ring rank r, per Ulysses rank (1/A heads)
    local_kind: list[list[str | None]]  # [R][A]
    step_kind: list[list[str | None]]  # [R][S]


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds of the compute of one rank: forward and backward of its local region and of
    each ring step (all head groups together)."""

    local_forward: float
    local_backward: float
    step_forward: tuple[float, ...]
    step_backward: tuple[float, ...]

    @property
    def total(self) -> float:
        return self.local_forward + self.local_backward + sum(self.step_forward) + sum(self.step_backward)


@dataclass(frozen=True)
class Passes:
    """The memory-bound GPU passes of one rank's call besides its attention kernels
    (:mod:`hcp_advise.passes`), all head groups together, in seconds (in bytes where
    :func:`passes.pass_bytes` returns them): per phase the passes once per call or head group
    (packing the exchange's send buffers, joining what comes back, assembling the regions) and
    those of each ring step (the merge or fp32 sum of its block's result, its copies)."""

    forward: float = 0.0
    backward: float = 0.0
    step_forward: tuple[float, ...] = ()
    step_backward: tuple[float, ...] = ()

    @property
    def total(self) -> float:
        return self.forward + self.backward + sum(self.step_forward) + sum(self.step_backward)

    def scaled(self, factor: float) -> Passes:
        return Passes(self.forward * factor, self.backward * factor,
                      tuple(s * factor for s in self.step_forward), tuple(s * factor for s in self.step_backward))


@dataclass(frozen=True)
class ExchangeTimes:
    """Seconds of one head group's all-to-alls: before its ring (q and KV; in the backward
    dout) and after it (the output; dq and dKV)."""

    forward_in: float = 0.0
    forward_out: float = 0.0
    backward_in: float = 0.0
    backward_out: float = 0.0


@dataclass(frozen=True)
class HopTimes:
    """Seconds of one head group's ring hops: a forward KV hop, a backward KV hop, a backward
    dKV hop before the last, the last dKV hop (the finished sum in the input dtype)."""

    forward: float = 0.0
    backward_kv: float = 0.0
    backward_dkv: float = 0.0
    last_dkv: float = 0.0


@dataclass(frozen=True)
class HostCounts:
    """What one rank's host issues per phase of a call (forward and backward alike): kernel
    calls, ring-step iterations (every head group's steps) and head groups."""

    calls: int
    steps: int
    groups: int


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds of the forward and the backward of a rank's call: what its host takes to issue
    them (:func:`host.host_times`; 0: not modelled), or a part of that, or its GPU's."""

    forward: float = 0.0
    backward: float = 0.0


@dataclass(frozen=True)
class RankPrediction:
    """One rank's predicted forward + backward of one attention call, in seconds."""

    step: float
    compute: float
    exposed_all_to_all: float
    exposed_ring: float
    all_to_all_bytes: int
    ring_bytes: int
    host: float = 0.0  # its host time, forward + backward
    host_wait: float = 0.0  # what the host adds to the step beyond the GPU's
    passes: float = 0.0  # its GPU's memory-bound passes besides the attention kernels


@dataclass(frozen=True)
class Prediction:
    """An option's prediction: the slowest rank's parts, averaged over the batches."""

    option: Option
    kernel: str  # the block kernel of this mesh (under a window a ring may need another)
    head_groups: int
    ring_link: str  # "nvlink", "network" or "-" (no ring)
    step_s: float
    compute_s: float
    mean_compute_s: float  # the mean rank's compute: step_s against it shows the imbalance
    exposed_all_to_all_s: float
    exposed_ring_s: float
    all_to_all_bytes: float  # per rank and call, the slowest rank's
    ring_bytes: float
    host_s: float = 0.0  # the slowest rank's host time (0: not modelled, see Advice.host_modelled)
    host_wait_s: float = 0.0  # what waiting for the host adds to step_s
    passes_s: float = 0.0  # the slowest rank's memory-bound passes besides attention (merges, copies)
    one_gpu_s: float = 0.0  # one GPU's compute of the whole batch (OneGpuCall.seconds), 0: not predicted
    # a rank's tokens, pads included (equal on every rank), over the mean real tokens per rank: what
    # the layout adds to a rank's memory against N GPUs sharing the batch evenly
    balance: float = 1.0

    @property
    def ulysses(self) -> int:
        return self.option.ulysses

    @property
    def ring(self) -> int:
        return self.option.ring

    @property
    def placement(self) -> str:
        return self.option.placement

    @property
    def exposed_s(self) -> float:
        return self.exposed_all_to_all_s + self.exposed_ring_s

    @property
    def efficiency(self) -> float:
        """One GPU's predicted time for the whole batch over ``N`` x the slowest rank's."""
        ranks = self.ulysses * self.ring
        return self.one_gpu_s / (ranks * self.step_s) if self.step_s else 0.0


@dataclass(frozen=True)
class OneGpuCall:
    """One GPU's forward + backward of a whole batch: one call of all its documents, priced as
    the compute model prices a block (:func:`compute.one_gpu_call`)."""

    kernel: str
    composition: str | None  # a key of measured.json; None for a batch without real tokens
    flops: float
    seconds: float
    # the smallest and largest call (FLOPs) measured for the kernel on the composition; None
    # where fewer than two sizes were recorded (then the main table's rate alone speaks)
    measured_flops: tuple[float, float] | None

    @property
    def within_measured(self) -> bool:
        """Whether the call's work lies inside the measured call sizes: outside them its rate
        is the nearest measured call's, an extrapolation."""
        if self.composition is None:
            return True
        return self.measured_flops is not None and self.measured_flops[0] <= self.flops <= self.measured_flops[1]


@dataclass(frozen=True)
class Advice:
    """The predictions, fastest first; ``best`` is the first."""

    predictions: tuple[Prediction, ...]
    device_kind: str
    batches: int
    seconds: float  # how long the advice took
    mode: str = "hcp-eager"
    host_modelled: bool = False  # hcp_advise/host_measured.json has the device, mode and kernels
    measurements: str = STORED_MEASUREMENTS  # the file of the kernel times (measurements.KernelTable.source)
    model_error: float = MODEL_ERROR  # closer predictions are a tie
    # the splits of the world that were not predicted: (ulysses, ring, why), smallest ulysses first
    left_out: tuple[tuple[int, int, str], ...] = ()
    one_gpu: tuple[OneGpuCall, ...] = ()  # each batch's call on one GPU, the efficiencies' numerator

    @property
    def best(self) -> Prediction:
        return self.predictions[0]

    @property
    def kernel(self) -> str:
        """The best option's kernel."""
        return self.best.kernel
