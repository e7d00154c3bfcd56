"""Train a small Llama-style decoder on packed documents with hierarchical context parallelism.

    python examples/train_packed.py                  # 4 CPU processes (gloo): ulysses 2 x ring 2
    torchrun --nproc-per-node 8 examples/train_packed.py --device cuda --ulysses 4 --ring 2
    torchrun --nproc-per-node 8 examples/train_packed.py --device cuda --data 2 --ulysses 2 --ring 2

The model is single-device code (RoPE, GQA, RMSNorm, SwiGLU) compiled with
``torch.compile(model, backend="hcp", options={"mesh": cp_mesh})``. Each step every rank of a
context-parallel (CP) group builds the same global packed batch, in the form packing collators
emit (one row of tokens, ``position_ids`` restarting at 0 at each document), and keeps its
shard. What a trainer must do beyond single-device training is in ``train_step``:

1. labels shifted to the next token WITHIN each document before sharding (a shard does not
   hold its tokens' successors), sharded with ``pad_value=-100`` so pads carry no loss;
2. loss = sum of the local token losses / the real-token count of the whole batch
   (all-reduced over the CP group), so that the CP ranks' gradients SUM to the single-device
   gradient;
3. gradients summed over the CP ranks and averaged over data-parallel replicas (``--data``:
   each replica trains on different batches);
4. the token dim, ``cu_seqlens`` and ``max_seqlen`` marked dynamic, so that batches of new
   document counts and lengths do not recompile: one graph serves every step.

On the first step, rank 0 checks the loss and the synchronized gradients against the same
model run in this one process without CP (plain ``hcp_compile.varlen_attention`` on each
whole batch). Without torchrun the script spawns ``data x ulysses x ring`` processes itself.

``--loader-workers N`` moves the batch and its plan off the step: DataLoader workers build each
step's batch and ``hcp_compile.prepare_batch`` for this rank while earlier steps train, and the
step only adopts it (``shard_plan(prepared, mesh)``). On a GPU host the plan's small CPU ops on
the step cost milliseconds, more after a compile has left work on the cores
(docs/benchmarks.md, "One CP rank's stream").
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

import hcp_compile
from hcp_compile.compiled.backend import INNER_COMPILERS
from _common import DTYPES, Worker, add_launch_args, launch, tolerance, under_torchrun
from packed_model import Attention  # RoPE at the given positions, GQA, varlen attention

IGNORE = -100  # the label of tokens without a loss: last token of a document, and pads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_launch_args(parser, ulysses=2, ring=2, device="cpu", dtype="float32")
    parser.add_argument("--data", type=int, default=1, help="data-parallel replicas D")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=320,
                        help="token budget of each packed batch (per replica)")
    parser.add_argument("--min-doc", type=int, default=12)
    parser.add_argument("--max-doc", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--loader-workers", type=int, default=0,
                        help="DataLoader workers that build each step's batch and its prepared plan ahead "
                             "(0: both on the step)")
    parser.add_argument("--inner", choices=INNER_COMPILERS, default=None,
                        help="compiler after the rewrite; default inductor on cuda, aot_eager on cpu")
    parser.add_argument("--plot", default="train_packed_loss.png",
                        help="loss curve (written when matplotlib is installed)")
    parser.set_defaults(launched=time.time())  # wall clock: comparable in spawned processes
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.loader_workers < 0:
        parser.error("--loader-workers must be at least 0")
    if not 2 * args.max_doc <= args.tokens:
        parser.error("--tokens must be at least 2 * --max-doc: every batch packs >= 2 documents")
    return args


# --------------------------------------------------------------------------- the model


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = SwiGLU(dim, 4 * dim)

    def forward(self, x: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        x = x + self.attention(self.attention_norm(x), positions, cu_seqlens, max_seqlen)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Single-device code on a packed batch: ``tokens [T]`` -> next-token logits ``[T, vocab]``."""

    def __init__(self, vocab: int, dim: int, heads: int, kv_heads: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderBlock(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions, cu_seqlens, max_seqlen)
        return self.head(self.norm(x))


# --------------------------------------------------------------------------- the data


@dataclass(frozen=True)
class PackedBatch:
    """One packed row, global (the same on every rank of a CP group)."""

    input_ids: Tensor  # [T] int64
    position_ids: Tensor  # [T] position inside the document: what packing collators emit
    labels: Tensor  # [T] next token inside the document, IGNORE at each document's end
    cu_seqlens: Tensor  # [docs + 1] int32, derived from position_ids
    max_seqlen: int

    @property
    def documents(self) -> int:
        return self.cu_seqlens.numel() - 1


def synthetic_documents(generator: torch.Generator, args: argparse.Namespace) -> list[Tensor]:
    """Documents of random lengths filling at most the token budget. Each counts through the
    vocabulary from a random start with a random stride of 1 to 4: the first token's successor
    is a guess among the strides, every later one follows from the two before it, so the loss
    can fall from log(vocab) towards ~0 as the model learns to look back."""
    documents, used = [], 0
    while True:
        length = int(torch.randint(args.min_doc, args.max_doc + 1, (1,), generator=generator))
        if used + length > args.tokens:
            return documents
        start = int(torch.randint(args.vocab, (1,), generator=generator))
        stride = int(torch.randint(1, 5, (1,), generator=generator))
        documents.append((start + stride * torch.arange(length)) % args.vocab)
        used += length


def pack(documents: list[Tensor], device: torch.device) -> PackedBatch:
    """Concatenate the documents the way DataCollatorWithFlattening does, then derive the
    attention boundaries and the labels from its ``position_ids``."""
    input_ids = torch.cat(documents)
    position_ids = torch.cat([torch.arange(len(d)) for d in documents])
    labels = next_token_labels(input_ids, position_ids)
    cu_seqlens, max_seqlen = hcp_compile.cu_seqlens_from_position_ids(position_ids)
    tensors = (input_ids, position_ids, labels, cu_seqlens)
    return PackedBatch(*(t.to(device) for t in tensors), max_seqlen)


def next_token_labels(input_ids: Tensor, position_ids: Tensor) -> Tensor:
    """``labels[i] = input_ids[i + 1]`` inside a document, IGNORE on its last token. Shifted
    on the global row: after sharding, a token's successor may live on another rank."""
    document_ends = torch.cat([position_ids[1:] == 0, torch.tensor([True])])
    return input_ids.roll(-1).masked_fill(document_ends, IGNORE)


def batch_for(step: int, replica: int, args: argparse.Namespace, device: torch.device) -> PackedBatch:
    """The batch of one data-parallel replica at one step: the same on the ranks of its CP
    group (seeded by step and replica), different between replicas."""
    generator = torch.Generator().manual_seed(hash((args.seed, step, replica)))  # same everywhere
    return pack(synthetic_documents(generator, args), device)


class PlannedBatches(torch.utils.data.Dataset):
    """``--loader-workers``: each step's batch (on the CPU) with its plan prepared for this CP
    rank (``hcp_compile.prepare_batch``: no process group, it pickles), built in a worker."""

    def __init__(self, args: argparse.Namespace, replica: int, cp_rank: int):
        self.args, self.replica, self.cp_rank = args, replica, cp_rank

    def __len__(self) -> int:
        return self.args.steps

    def __getitem__(self, step: int) -> tuple[PackedBatch, hcp_compile.PreparedBatch]:
        batch = batch_for(step, self.replica, self.args, torch.device("cpu"))
        prepared = hcp_compile.prepare_batch(batch.cu_seqlens, ulysses=self.args.ulysses, ring=self.args.ring,
                                             rank=self.cp_rank)
        return batch, prepared


def step_batches(args: argparse.Namespace, replica: int, cp_mesh: DeviceMesh,
            device: torch.device) -> Iterator[tuple[PackedBatch, hcp_compile.PreparedBatch | None]]:
    """Each step's batch on ``device``, with its prepared plan where workers built it."""
    if args.loader_workers == 0:
        for step in range(args.steps):
            yield batch_for(step, replica, args, device), None
        return
    cp_rank = cp_mesh.get_local_rank("ring") * args.ulysses + cp_mesh.get_local_rank("ulysses")
    loader = torch.utils.data.DataLoader(PlannedBatches(args, replica, cp_rank), batch_size=None,
                                         num_workers=args.loader_workers)
    for batch, prepared in loader:
        moved = (t.to(device) for t in (batch.input_ids, batch.position_ids, batch.labels, batch.cu_seqlens))
        yield PackedBatch(*moved, batch.max_seqlen), prepared


# --------------------------------------------------------------------------- one training step


@dataclass(frozen=True)
class Trainer:
    model: nn.Module  # the parameters
    compiled: nn.Module  # torch.compile(model, backend="hcp")
    optimizer: torch.optim.Optimizer
    cp_mesh: DeviceMesh  # the ("ring", "ulysses") mesh of this rank's data replica
    data: int  # data-parallel replicas


def train_step(
    trainer: Trainer, batch: PackedBatch, prepared: hcp_compile.PreparedBatch | None = None
) -> tuple[float, int]:
    """Forward, backward and gradient synchronization on this rank's shard of ``batch``
    (the optimizer has not stepped yet), planned from ``prepared`` where a worker built it.
    Returns the loss averaged over replicas and the real tokens of all replicas' batches."""
    plan = hcp_compile.shard_plan(prepared if prepared is not None else batch.cu_seqlens, trainer.cp_mesh)
    tokens = plan.shard(batch.input_ids)  # pads get token 0: masked below and in attention
    labels = plan.shard(batch.labels, pad_value=IGNORE)  # (1) pads carry no loss
    positions = plan.position_ids  # RoPE positions inside each document, for this shard
    # (4) the local token count, the document count and the longest document change every
    # batch: traced as symbols from the first compile on instead of specialized. Tensor dims
    # are marked; the int max_seqlen is named by its source (there is no mark for ints), else
    # the second batch would recompile to make it dynamic.
    for tensor in (tokens, positions, batch.cu_seqlens):
        torch._dynamo.mark_dynamic(tensor, 0)
    with torch.compiler.config.patch(dynamic_sources="L['max_seqlen']"):
        logits = trainer.compiled(tokens, positions, batch.cu_seqlens, batch.max_seqlen)
    token_losses = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")
    loss = token_losses / real_label_count(labels, trainer.cp_mesh)  # (2)
    loss.backward()
    synchronize_gradients(trainer.model, trainer.data)  # (3)
    return step_totals(loss.detach(), plan.valid, trainer.data)


def real_label_count(labels: Tensor, cp_mesh: DeviceMesh) -> Tensor:
    """Tokens with a label in the whole batch: the local count summed over the CP group.
    Dividing by the local count instead would weight each rank's tokens differently from
    the single-device mean."""
    count = (labels != IGNORE).sum()
    for dim in ("ulysses", "ring"):
        dist.all_reduce(count, group=cp_mesh.get_group(dim))
    return count


def synchronize_gradients(model: nn.Module, data: int) -> None:
    """Sum over the CP ranks (each holds its tokens' share of the batch gradient) and average
    over replicas, in one all-reduce of the flattened gradients. The mesh spans the world
    here; a trainer with more parallel dims reduces over the (data, ring, ulysses) ranks only,
    usually through DDP/FSDP on the flattened mesh."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= data
    for grad, synced in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(synced.view_as(grad))


def step_totals(local_loss: Tensor, valid: Tensor, data: int) -> tuple[float, int]:
    """Each rank's loss is its tokens' share, so the sum over a CP group is the batch loss;
    summed over the world it is ``data`` batch losses. One all-reduce for both numbers."""
    totals = torch.stack([local_loss.double(), valid.sum().double()])
    dist.all_reduce(totals)
    loss, tokens = totals.tolist()
    return loss / data, int(tokens)


# --------------------------------------------------------------------------- the first-step check


def reference_step(model: nn.Module, batches: list[PackedBatch]) -> tuple[float, dict[str, Tensor]]:
    """Loss and gradients of ``model`` in this process alone, no CP: the mean over the
    replicas' batches of each whole batch's mean token loss."""
    model.zero_grad()
    losses = []
    for batch in batches:
        logits = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)
        losses.append(F.cross_entropy(logits.float(), batch.labels, ignore_index=IGNORE))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """Max abs error relative to the largest |expected|: the scale of the tensor, so
    near-zero entries do not dominate."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def check_first_step(
    cp_loss: float, model: nn.Module, reference: nn.Module, batches: list[PackedBatch], tol: float
) -> bool:
    """Print how far the CP step's loss and synchronized gradients are from the one-process
    run, and whether that is within ``tol`` (relative)."""
    ref_loss, ref_grads = reference_step(reference, batches)
    loss_error = abs(cp_loss - ref_loss) / abs(ref_loss)
    grad_errors = {
        name: relative_error(p.grad, ref_grads[name]) for name, p in model.named_parameters()
    }
    worst = max(grad_errors, key=grad_errors.get)
    ok = loss_error <= tol and grad_errors[worst] <= tol
    print(
        f"first-step check vs one process without CP: loss {cp_loss:.6f} vs {ref_loss:.6f} "
        f"(relative error {loss_error:.1e}), gradients max relative error "
        f"{grad_errors[worst]:.1e} ({worst}); tolerance {tol:g}: {'PASS' if ok else 'FAIL'}",
        flush=True,
    )
    return ok


# --------------------------------------------------------------------------- the run


def compiled_graphs() -> int:
    """Dynamo frames compiled so far in this process: 1 + the recompiles."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def plot_losses(losses: list[float], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set(xlabel="step", ylabel="loss (mean per token)", title="train_packed.py")
    fig.tight_layout()
    fig.savefig(path)
    print(f"loss curve: {path}")


def report(me: Worker, message: str) -> None:
    if me.rank == 0:
        print(message, flush=True)


def build_trainer(me: Worker, args: argparse.Namespace) -> tuple[Trainer, nn.Module | None, int]:
    """The mesh, the model (the same initial weights on every rank), its compiled form and the
    optimizer; also rank 0's uncompiled copy for the first-step check, and this rank's data
    replica."""
    dtype = DTYPES[args.dtype]
    mesh = hcp_compile.make_mesh(args.ulysses, args.ring, args.device, data=args.data)
    cp_mesh = mesh["ring", "ulysses"] if args.data > 1 else mesh
    replica = mesh.get_local_rank("data") if args.data > 1 else 0
    report(me, f"{me.world_size} ranks up (data {args.data} x ulysses {args.ulysses} x ring "
               f"{args.ring}, {args.device}, {args.dtype}) after "
               f"{time.time() - args.launched:.1f} s")
    torch.manual_seed(args.seed)
    model = Decoder(args.vocab, args.dim, args.heads, args.kv_heads, args.layers)
    model = model.to(me.device, dtype)
    reference = copy.deepcopy(model) if me.rank == 0 else None
    inner = args.inner or ("inductor" if args.device == "cuda" else "aot_eager")
    compiled = torch.compile(model, backend="hcp", options={"mesh": cp_mesh, "inner": inner})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    report(me, f"compiling on the first step (backend hcp, inner compiler {inner})...")
    return Trainer(model, compiled, optimizer, cp_mesh, args.data), reference, replica


def worker(me: Worker, args: argparse.Namespace) -> bool:
    if me.device.type == "cpu":  # the ranks share the cores: one thread each, no oversubscription
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // me.world_size))
    trainer, reference, replica = build_trainer(me, args)
    ok, losses = True, []
    steps = step_batches(args, replica, trainer.cp_mesh, me.device)
    for step in range(args.steps):
        tick = time.perf_counter()
        batch, prepared = next(steps)
        loss, tokens = train_step(trainer, batch, prepared)
        seconds = time.perf_counter() - tick
        if step == 0 and reference is not None:
            batches = [batch_for(0, r, args, me.device) for r in range(args.data)]
            tol = tolerance(DTYPES[args.dtype], gqa=args.kv_heads < args.heads)
            ok = check_first_step(loss, trainer.model, reference, batches, tol)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        losses.append(loss)
        speed = f"compiled in {seconds:.1f} s" if step == 0 else f"{tokens / seconds:6.0f} tokens/s"
        report(me, f"step {step + 1:3d} | loss {loss:.4f} | {speed} | batch: {batch.documents} "
                   f"documents, {int(batch.cu_seqlens[-1])} tokens")
        ok = ok and math.isfinite(loss)
    report(me, f"compiled graphs: {compiled_graphs()} in {args.steps} steps of new batch shapes "
               f"(1 compile + {compiled_graphs() - 1} recompiles)")
    report(me, f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; done after "
               f"{time.time() - args.launched:.1f} s")
    if me.rank == 0:
        plot_losses(losses, args.plot)
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not under_torchrun():
        print(f"starting {args.data * args.ulysses * args.ring} processes...", flush=True)
    return launch(worker, args, data=args.data)


if __name__ == "__main__":
    sys.exit(main())
