"""A property case (a packed batch and its attention arguments), its data, and its results.

A :class:`PropertyCase` is plain data: hypothesis draws it (``strategies.py``), the parent
process sends it to a world's ranks, and its JSON is the reproducer a failure prints
(``HCP_PROPERTY_REPLAY``, tests/test_gpu_properties.py). Its tensors come from ``data_seed``, so
every rank and every replay builds the same batch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch
from torch import Tensor

from hcp_compile.batch.layout import window_by_position
from hcp_compile.exchange.schemes import DEFAULT_SCHEME
from hcp_compile.kernels import KERNELS, BlockRequest

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
GRADIENTS = ("out", "dq", "dk", "dv")


@dataclass(frozen=True)
class PropertyCase:
    """One random batch, its attention arguments, and where it runs: ``mesh`` (ulysses, ring),
    (1, 1) for one device; ``kernel`` the kernel under test ("auto" included); ``scheme`` the
    collective scheme under CP."""

    lengths: tuple[int, ...]
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str  # a key of DTYPES
    causal: bool
    window: tuple[int, int]
    scale: float | None  # softmax_scale (None: 1 / sqrt(head_dim))
    kernel: str
    mesh: tuple[int, int]
    data_seed: int
    layout_window: bool = False  # CP: shard_plan lays the batch out for the case's window
    scheme: str = DEFAULT_SCHEME  # CP: a key of hcp_compile.exchange.schemes.SCHEMES

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.scale is None else self.scale

    def describe(self) -> str:
        mask = ("causal" if self.causal else "full") + (f" window {self.window}" if self.window != (-1, -1) else "")
        mask += ", laid out for the window" if self.layout_window else ""
        scale = "" if self.scale is None else f" scale {self.scale:.4g}"
        scheme = "" if self.scheme == DEFAULT_SCHEME else f" scheme {self.scheme}"
        return (f"{self.tokens} tokens in {len(self.lengths)} docs (longest {max(self.lengths)}), heads "
                f"{self.heads_q}/{self.heads_kv} x {self.head_dim}, {self.dtype}, {mask}{scale}, kernel "
                f"{self.kernel}, mesh {self.mesh[0]}x{self.mesh[1]}{scheme}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> PropertyCase:
        fields = json.loads(text)
        for name in ("lengths", "window", "mesh"):  # JSON has lists only
            fields[name] = tuple(fields[name])
        return cls(**fields)


@dataclass(frozen=True)
class PackedBatch:
    """A case's global tensors, the same on every rank."""

    cu_seqlens: Tensor  # [docs + 1] int32
    max_seqlen: int
    q: Tensor  # [T, Hq, D]
    k: Tensor  # [T, Hkv, D]
    v: Tensor  # [T, Hkv, D]
    dout: Tensor  # [T, Hq, D]: the gradient fed to backward


@dataclass(frozen=True)
class Result:
    """Output and gradients of one run, global rows; ``pad_max``: the largest |value| a CP
    run left on pad rows (0 on one device)."""

    out: Tensor
    dq: Tensor
    dk: Tensor
    dv: Tensor
    pad_max: float = 0.0


def make_batch(case: PropertyCase, device: torch.device) -> PackedBatch:
    """Standard normal q, k, v and dout drawn on ``device`` from the case's ``data_seed``."""
    generator = torch.Generator(device=device).manual_seed(case.data_seed)

    def normal(heads: int) -> Tensor:
        x = torch.randn(case.tokens, heads, case.head_dim, generator=generator, device=device)
        return x.to(case.torch_dtype)

    cu = torch.tensor([0, *case.lengths], dtype=torch.int64).cumsum(0).to(device, torch.int32)
    return PackedBatch(cu, max(case.lengths), normal(case.heads_q), normal(case.heads_kv),
                       normal(case.heads_kv), normal(case.heads_q))


def claim(kernel: str, case: PropertyCase, device: str) -> str | None:
    """None when ``kernel`` takes the case's calls on ``device`` under its mesh's ring (a window
    on a ring of several ranks masks by positions), else the kernel's reason; "auto" takes all."""
    if kernel == "auto":
        return None
    request = BlockRequest(torch.device(device), case.torch_dtype, case.head_dim, case.heads_q, case.heads_kv,
                           case.window, window_by_position(case.window, case.mesh[1]))
    return KERNELS[kernel].supports(request)
