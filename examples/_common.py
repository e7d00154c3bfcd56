"""Helpers shared by the examples and the GPU script ``scripts/gpu_check.py``.

Launching (``torchrun`` or a self-spawned group of processes), a packed batch of documents,
attention with and without context parallelism, and the comparison against docs/design.md §6.
Not part of the library: the example keeps its own plumbing here so the script it shows stays
about the API.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

import hcp_compile
from hcp_compile.testing.cases import PackedBatch  # the global tensors of a batch, as the tests build them

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

GRADIENTS = ("out", "dq", "dk", "dv")


# --------------------------------------------------------------------------- tolerances


def tolerance(dtype: torch.dtype, gqa: bool) -> float:
    """atol = rtol against single-device attention (docs/design.md §6)."""
    if dtype == torch.bfloat16:
        return 3.5e-2 if gqa else 2.5e-2
    if dtype == torch.float16:
        return 5e-3
    if dtype == torch.float64:
        return 1e-10  # float64 inputs merge and accumulate in float64 too
    return 1e-4


# --------------------------------------------------------------------------- launching


@dataclass(frozen=True)
class Worker:
    """This process's place in the job."""

    rank: int
    world_size: int
    device: torch.device


WorkerFn = Callable[[Worker, argparse.Namespace], bool]


def add_launch_args(
    parser: argparse.ArgumentParser, *, ulysses: int, ring: int, device: str, dtype: str
) -> None:
    """The options both scripts share: mesh shape, device, dtype and seed."""
    parser.add_argument("--ulysses", type=int, default=ulysses, help="Ulysses group size A")
    parser.add_argument("--ring", type=int, default=ring, help="ring size R")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=device)
    parser.add_argument("--share-gpu", action="store_true", help=SHARE_GPU_HELP)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=dtype)
    parser.add_argument("--seed", type=int, default=0)


SHARE_GPU_HELP = (
    "every rank on cuda:0, over gloo (which stages CUDA tensors through the host): several "
    "ranks on a machine of one GPU, for correctness and per-rank memory, not for speed"
)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: WorkerFn, args: argparse.Namespace, data: int = 1) -> int:
    """Run ``worker`` on ``data * ulysses * ring`` processes and return the exit code.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) this process is one of them; otherwise it
    spawns them itself on a free local port. ``worker`` returns whether its checks passed.
    ``data``: data-parallel replicas of the context-parallel mesh.
    """
    world = data * args.ulysses * args.ring
    if args.share_gpu and args.device != "cuda":
        raise SystemExit("--share-gpu shares a GPU: it needs --device cuda")
    if under_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world:
            replicas = f"--data {data} x " if data > 1 else ""
            raise SystemExit(
                f"torchrun started {env_world} processes but {replicas}--ulysses {args.ulysses} x "
                f"--ring {args.ring} = {world}; make --nproc-per-node (x nodes) equal their product"
            )
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
        return 0 if _run(worker, args, rank, world, local_rank) else 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        mp.spawn(_spawned, args=(worker, args, world), nprocs=world)
    except mp.ProcessExitedException as exc:
        print(f"a worker failed: {exc}")
        return 1
    return 0


def _spawned(rank: int, worker: WorkerFn, args: argparse.Namespace, world: int) -> None:
    if not _run(worker, args, rank, world, local_rank=rank):
        raise SystemExit(1)


def _run(
    worker: WorkerFn, args: argparse.Namespace, rank: int, world: int, local_rank: int
) -> bool:
    if args.device == "cuda":
        device = torch.device("cuda", 0 if args.share_gpu else local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if args.device == "cuda" and not args.share_gpu else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        return worker(Worker(rank, world, device), args)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the batch


def mixed_doc_lengths(total_tokens: int, num_docs: int, seed: int) -> list[int]:
    """``num_docs`` document lengths summing to ``total_tokens``, in random order: one long
    document (an odd length near a quarter of the tokens), a 1- and a 3-token document
    (shorter than one zigzag chunk per ring rank), and random lengths for the rest."""
    if num_docs < 4 or total_tokens < 2 * num_docs + 8:
        raise ValueError(
            f"mixed_doc_lengths: need at least 4 documents and 2 * docs + 8 tokens, got "
            f"{num_docs} documents and {total_tokens} tokens"
        )
    gen = torch.Generator().manual_seed(seed)
    long_doc = (total_tokens // 4) | 1
    rest_docs = num_docs - 3
    rest_tokens = total_tokens - long_doc - 1 - 3
    weights = torch.rand(rest_docs, generator=gen) + 0.1
    rest = 1 + (weights / weights.sum() * (rest_tokens - rest_docs)).floor().long()
    rest[int(torch.randint(rest_docs, (1,), generator=gen))] += rest_tokens - int(rest.sum())
    lengths = torch.cat([torch.tensor([long_doc, 1, 3]), rest])
    return lengths[torch.randperm(num_docs, generator=gen)].tolist()


def make_batch(
    doc_lengths: list[int], heads_q: int, heads_kv: int, head_dim: int,
    dtype: torch.dtype, device: torch.device, seed: int,
) -> PackedBatch:
    """Random q/k/v/dout for the documents; drawn on the CPU from ``seed`` so that every rank
    builds the same global tensors."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(doc_lengths)

    def draw(heads: int) -> Tensor:
        return torch.randn(tokens, heads, head_dim, generator=gen).to(device, dtype)

    cu = torch.tensor([0, *doc_lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
    return PackedBatch(
        cu_seqlens=cu.to(device), max_seqlen=max(doc_lengths),
        q=draw(heads_q), k=draw(heads_kv), v=draw(heads_kv), dout=draw(heads_q),
    )


# --------------------------------------------------------------------------- attention runs


@dataclass(frozen=True)
class Result:
    """Global (unsharded) output and gradients of one attention run."""

    out: Tensor
    dq: Tensor
    dk: Tensor
    dv: Tensor
    pad_max: float = 0.0  # CP only: largest |value| of the local output or gradients on pads

    def tensors(self) -> dict[str, Tensor]:
        return {"out": self.out, "dq": self.dq, "dk": self.dk, "dv": self.dv}


def single_device(
    batch: PackedBatch, causal: bool, dtype: torch.dtype | None = None,
    window: tuple[int, int] = (-1, -1),
) -> Result:
    """Plain ``varlen_attention`` (no CP) on the full tensors, optionally cast to ``dtype``."""
    q, k, v = (
        t.to(dtype or t.dtype).detach().requires_grad_() for t in (batch.q, batch.k, batch.v)
    )
    out = hcp_compile.varlen_attention(
        q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen,
        causal=causal, window_size=window,
    )
    out.backward(batch.dout.to(out.dtype))
    return Result(out.detach(), q.grad, k.grad, v.grad)


PAD_FILL = 7.0


def context_parallel(
    batch: PackedBatch, mesh, plan: hcp_compile.ShardPlan, causal: bool, kernel: str = "auto",
    window: tuple[int, int] = (-1, -1), recompute_exchange: bool = False, scheme: str = "ring",
) -> Result:
    """Hierarchical CP attention on this rank's shards, backward, then unshard everything.

    Pads are filled with a non-zero value on the way in (inputs and output gradient), and the
    largest |value| on pads of the local output and gradients, over all ranks, is reported:
    the contract says it is 0.

    Collective: every rank of ``mesh`` must call it."""
    q, k, v = (plan.shard(t, PAD_FILL).requires_grad_() for t in (batch.q, batch.k, batch.v))
    with hcp_compile.context_parallel(mesh, kernel=kernel, placement=plan.placement,
                                      recompute_exchange=recompute_exchange, scheme=scheme):
        out = hcp_compile.varlen_attention(
            q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen,
            causal=causal, window_size=window,
        )
    out.backward(plan.shard(batch.dout, PAD_FILL))
    local = (out.detach(), q.grad, k.grad, v.grad)
    pad = ~plan.valid.reshape(-1, 1, 1)
    pad_max = torch.stack([torch.where(pad, t, 0).abs().amax() for t in local]).amax()
    pad_max = pad_max.float().reshape(1)
    dist.all_reduce(pad_max, op=dist.ReduceOp.MAX)
    return Result(*(plan.unshard(t) for t in local), pad_max=pad_max.item())


# --------------------------------------------------------------------------- comparing


def max_abs_error(actual: Tensor, expected: Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item()


def bound_ratio(actual: Tensor, expected: Tensor, tol: float) -> float:
    """Worst ``|actual - expected| / (tol + tol * |expected|)``: assert_close's criterion with
    atol = rtol = ``tol`` holds where this is <= 1. Infinite if ``actual`` has NaN/Inf."""
    a, e = actual.double(), expected.double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return ((a - e).abs() / (tol + tol * e.abs())).max().item()


@dataclass(frozen=True)
class Comparison:
    errors: dict[str, float]  # max abs error of out, dq, dk, dv
    ratio: float  # worst bound_ratio over the four
    tol: float
    pad_max: float  # must be 0: pads give output 0 and no gradient

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0 and self.pad_max == 0


def compare(actual: Result, expected: Result, tol: float) -> Comparison:
    """Max abs errors of out/dq/dk/dv, and how close the worst element is to the tolerance."""
    pairs = list(zip(actual.tensors().values(), expected.tensors().values()))
    errors = {name: max_abs_error(a, e) for name, (a, e) in zip(GRADIENTS, pairs)}
    ratio = max(bound_ratio(a, e, tol) for a, e in pairs)
    return Comparison(errors, ratio, tol, actual.pad_max)


def rank_layout(mesh, plan: hcp_compile.ShardPlan) -> list[list[int]]:
    """Per rank, in rank order: ``[rank, ring, ulysses, local tokens, real tokens, pads]``.
    Collective (all_gather_object)."""
    real = int(plan.valid.sum())
    mine = [
        dist.get_rank(), mesh.get_local_rank("ring"), mesh.get_local_rank("ulysses"),
        plan.local_tokens, real, plan.local_tokens - real,
    ]
    rows: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(rows, mine)
    return rows


LAYOUT_HEADERS = ["rank", "ring", "ulysses", "local tokens", "real tokens", "pads"]
