"""FSDP2 and hierarchical context parallelism on the same ranks, eager and compiled.

    python examples/fsdp2_compile.py                      # 4 CPU processes (gloo): ulysses 2 x ring 2
    torchrun --nproc-per-node 8 examples/fsdp2_compile.py --device cuda --ulysses 4 --ring 2

Composed as torchtitan composes data and context parallelism: the context-parallel (CP) ranks
also shard the parameters. Every rank holds a shard of the packed tokens (laid out by
``hcp_compile.shard_plan`` over a ``("ring", "ulysses")`` mesh) and a shard of every parameter
(``torch.distributed.fsdp.fully_shard`` over all the ranks, per decoder layer then the root).
What the composition needs beyond each alone:

1. FSDP's mesh is the CP ranks flattened (torchtitan's ``dp_shard_cp``; here with no separate
   data dimension, the whole world);
2. the loss is the sum of the shard's token losses over the real-label count of the WHOLE batch,
   so the ranks' gradients SUM to the one-process gradient; FSDP averages over its ranks by
   default, so its division is turned off (``set_gradient_divide_factor(1.0)`` on every FSDP
   module, as torchtitan does for its global-token loss, and ``set_force_sum_reduction_for_comms``
   for a plain SUM, the one reduction gloo has);
3. compiled: each decoder layer is compiled with ``backend="hcp"`` before ``fully_shard``
   (torchtitan's per-block compile), so FSDP's all-gathers and reduce-scatters run in its hooks
   around the graphs and the attention's collectives inside them; a forward pre-hook marks each
   layer's batch dims dynamic, so one graph serves every layer and batch.

Each mode (``eager``: ``hcp_compile.context_parallel``; ``compiled``) trains ``--steps`` SGD steps
on new batches from the same initial weights. Rank 0 checks every step's loss and gradients
(each sharded gradient gathered into the full tensor) against the same model trained in this
one process on the whole batches without CP or FSDP, in float64 on the CPU, errors relative to
each gradient's largest |value|. A run in float64 (the CPU default) must match to 1e-10; a run
in a lower precision (the GPU default bf16, with fp32 parameters and gradient reduction as
torchtitan's mixed precision) within 4 x what that precision costs the same model on one device,
plus 1e-4 (``compile_model.py``'s bound, relative to the scale).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import hcp_compile
from hcp_compile.compiled.backend import INNER_COMPILERS
from _common import DTYPES, Worker, add_launch_args, launch, under_torchrun
from train_packed import IGNORE, Decoder, PackedBatch, pack, synthetic_documents

MODES = ("eager", "compiled")
# the bound of the check, relative to a gradient's largest |value| (see the docstring)
FLOAT64_TOL = 1e-10
ONE_DEVICE_FACTOR = 4.0
FLOOR_TOL = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_launch_args(parser, ulysses=2, ring=2, device="cpu", dtype="float64")
    parser.set_defaults(dtype=None)  # resolved below: float64 on CPU, bfloat16 on CUDA
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96, help="token budget of each packed batch")
    parser.add_argument("--min-doc", type=int, default=4)
    parser.add_argument("--max-doc", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--inner", choices=INNER_COMPILERS, default=None,
                        help="compiler after the rewrite; default inductor on cuda, aot_eager on cpu")
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float64"
    if args.inner is None:
        args.inner = "inductor" if args.device == "cuda" else "aot_eager"
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.share_gpu:
        parser.error("--share-gpu: FSDP2 all-gathers the parameters and gloo's all-gather of CUDA "
                     "tensors crashes (docs/design.md §7), so ranks cannot share one GPU here; "
                     "run one rank per GPU with torchrun (NCCL), or on CPU")
    if not 2 * args.max_doc <= args.tokens:
        parser.error("--tokens must be at least 2 * --max-doc: every batch packs >= 2 documents")
    return args


# --------------------------------------------------------------------------- the composition


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The parameters' and gradient reduction's dtype: float64 for a float64 run, else float32
    (FSDP's mixed precision casts the all-gathered parameters to ``dtype`` for the compute)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def parallelize(model: Decoder, cp_mesh: DeviceMesh, fsdp_mesh: DeviceMesh, dtype: torch.dtype,
                compiled: bool, inner: str) -> Decoder:
    """torchtitan's order: compile each decoder layer (optionally), then ``fully_shard`` each
    layer, then the root (embedding, final norm and head), in place."""
    reduce_dtype = master_dtype(dtype)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype if dtype != reduce_dtype else None,
                                     reduce_dtype=reduce_dtype)
    for name, layer in model.layers.named_children():
        if compiled:
            # fullgraph: one graph per layer; FSDP's hooks run around it, on the wrapper
            layer = torch.compile(layer, backend="hcp", fullgraph=True,
                                  options={"mesh": cp_mesh, "inner": inner})
            layer.register_forward_pre_hook(mark_batch_dynamic)
            model.layers.register_module(name, layer)
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp_policy)
    for module in model.modules():  # (2) the ranks' gradients are shares: sum them, do not average
        if isinstance(module, FSDPModule):  # (each FSDP module sets its own parameter group)
            module.set_gradient_divide_factor(1.0)
            # a plain SUM: with a factor FSDP reduces fp32/bf16 by PREMUL_SUM, which gloo lacks
            module.set_force_sum_reduction_for_comms(True)
    return model


def mark_batch_dynamic(layer: nn.Module, args: tuple) -> None:
    """A compiled layer's forward pre-hook: the local token count and the document count change
    with every batch, so they are traced as symbols from the first compile on (one graph for
    all batches, as ``train_packed.py`` does for its whole model). Marked here, since a layer's
    input comes from the embedding, run eagerly; ``max_seqlen`` (an int) is named dynamic in
    ``train_step``."""
    x, positions, cu_seqlens, _ = args
    for tensor in (x, positions, cu_seqlens):
        torch._dynamo.mark_dynamic(tensor, 0)


def train_step(model: nn.Module, batch: PackedBatch, cp_mesh: DeviceMesh, eager: bool) -> Tensor:
    """Forward and backward of this rank's shard of ``batch``; returns the whole batch's loss.
    FSDP reduce-scatters the gradients during the backward."""
    plan = hcp_compile.shard_plan(batch.cu_seqlens, cp_mesh)
    tokens = plan.shard(batch.input_ids)  # pads get token 0: no label, no attention
    labels = plan.shard(batch.labels, pad_value=IGNORE)
    # eager CP is a context around the forward (the backward follows what it recorded); the
    # compiled layers carry their collectives in their graphs, traced with a symbolic max_seqlen
    if eager:
        context = hcp_compile.context_parallel(cp_mesh)
    else:
        context = torch.compiler.config.patch(dynamic_sources="L['max_seqlen']")
    with context:
        logits = model(tokens, plan.position_ids, batch.cu_seqlens, batch.max_seqlen)
    token_losses = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                                   labels, ignore_index=IGNORE, reduction="sum")
    count = (labels != IGNORE).sum()
    dist.all_reduce(count)  # every rank of the world is a CP rank of this batch
    loss = token_losses / count  # (2) this rank's share of the batch's mean token loss
    loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss


def full_gradients(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter's gradient gathered from its FSDP shards (collective), by the name the
    parameter has in the plain model."""
    return {clean(name): p.grad.full_tensor().detach().double().cpu()
            for name, p in model.named_parameters()}


def clean(name: str) -> str:
    return name.replace("_orig_mod.", "")  # torch.compile's wrapper of a layer


# --------------------------------------------------------------------------- one process


@dataclass(frozen=True)
class StepResult:
    loss: float  # the whole batch's mean token loss
    grads: dict[str, Tensor]  # full gradients, float64 on the CPU


def on(batch: PackedBatch, device: torch.device) -> PackedBatch:
    tensors = (batch.input_ids, batch.position_ids, batch.labels, batch.cu_seqlens)
    return PackedBatch(*(t.to(device) for t in tensors), batch.max_seqlen)


def train_one_process(model: nn.Module, batches: list[PackedBatch], lr: float,
                      device: torch.device) -> list[StepResult]:
    """The same SGD steps on the whole batches in this process: no CP, no FSDP."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    results = []
    for batch in batches:
        batch = on(batch, device)
        logits = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)
        loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                               batch.labels, ignore_index=IGNORE)
        loss.backward()
        results.append(StepResult(loss.item(), {name: p.grad.detach().double().cpu()
                                                for name, p in model.named_parameters()}))
        optimizer.step()
        optimizer.zero_grad()
    return results


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """Max abs difference over the largest |expected|: the tensor's scale, so that near-zero
    entries do not dominate."""
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-300))


# --------------------------------------------------------------------------- the run


def worker(me: Worker, args: argparse.Namespace) -> bool:
    if me.device.type == "cpu":  # the ranks share the cores: one thread each, no oversubscription
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // me.world_size))
    dtype = DTYPES[args.dtype]
    cp_mesh = hcp_compile.make_mesh(args.ulysses, args.ring, args.device)  # ("ring", "ulysses")
    # (1) FSDP over the same ranks; with a data dimension this would be the flattened
    # ("data", "ring", "ulysses") mesh, torchtitan's dp_shard_cp
    fsdp_mesh = init_device_mesh(args.device, (me.world_size,), mesh_dim_names=("fsdp",))
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    initial = Decoder(args.vocab, args.dim, args.heads, args.kv_heads, args.layers)
    generator = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    batches = [pack(synthetic_documents(generator, args), torch.device("cpu"))
               for _ in range(args.steps)]

    results: dict[str, list[StepResult]] = {}
    seconds: dict[str, float] = {}
    for mode in args.modes:
        started = time.perf_counter()
        model = copy.deepcopy(initial).to(me.device, master_dtype(dtype))
        model = parallelize(model, cp_mesh, fsdp_mesh, dtype, mode == "compiled", args.inner)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # on the sharded parameters
        results[mode] = []
        for batch in batches:
            loss = train_step(model, on(batch, me.device), cp_mesh, eager=mode == "eager")
            results[mode].append(StepResult(loss.item(), full_gradients(model)))
            optimizer.step()
            optimizer.zero_grad()
        seconds[mode] = time.perf_counter() - started
    if me.rank != 0:
        return True
    print(f"\nFSDP2 over all {me.world_size} ranks + hcp CP ulysses {args.ulysses} x ring {args.ring}, "
          f"{args.device}, {args.dtype}; "
          f"{args.steps} SGD steps on batches of {[b.documents for b in batches]} documents, "
          f"{[int(b.cu_seqlens[-1]) for b in batches]} tokens")
    for mode, took in seconds.items():
        graphs = compiled_graphs()
        compiled = (f" (backend hcp, inner {args.inner}; {graphs} graph{'s' * (graphs != 1)} for "
                    f"{args.layers} layers x {args.steps} batches; compile included)")
        print(f"{mode}: {took:.1f} s{compiled if mode == 'compiled' else ''}")
    return check(results, initial, batches, args, me.device)


def compiled_graphs() -> int:
    """Dynamo graphs compiled in this process: every layer and batch runs the first one."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def check(results: dict[str, list[StepResult]], initial: nn.Module, batches: list[PackedBatch],
          args: argparse.Namespace, device: torch.device) -> bool:
    """Rank 0: each mode's losses and gradients against one process in float64 (and, for a
    lower precision, against what it costs on one device); prints the table."""
    dtype = DTYPES[args.dtype]
    expected = train_one_process(copy.deepcopy(initial).double(), batches, args.lr, torch.device("cpu"))
    one_device = None
    if dtype != torch.float64:  # the same model in the run's dtype on one device, no CP
        one_device = train_one_process(copy.deepcopy(initial).to(device, dtype), batches, args.lr, device)
    rows, ok = [], True
    for mode, steps in results.items():
        for step, (got, want) in enumerate(zip(steps, expected)):
            errors = {name: relative_error(grad, want.grads[name]) for name, grad in got.grads.items()}
            worst = max(errors, key=errors.get)
            max_diff = max(float((grad - want.grads[name]).abs().max()) for name, grad in got.grads.items())
            loss_error = abs(got.loss - want.loss) / abs(want.loss)
            bound = FLOAT64_TOL
            if one_device is not None:
                own = max(relative_error(grad, want.grads[name]) for name, grad in one_device[step].grads.items())
                bound = ONE_DEVICE_FACTOR * own + FLOOR_TOL
            passed = max(loss_error, errors[worst]) <= bound
            ok = ok and passed
            rows.append((mode, step + 1, f"{got.loss:.6f}", f"{want.loss:.6f}", f"{loss_error:.1e}",
                         f"{max_diff:.1e}", f"{errors[worst]:.1e}", worst, f"{bound:.0e}",
                         "PASS" if passed else "FAIL"))
    print("\nagainst one process without CP or FSDP (float64, CPU); errors relative to the "
          "largest |value| of each\n")
    print(tabulate(rows, disable_numparse=True, headers=[
        "mode", "step", "loss", "loss 1 process", "loss error", "max |grad diff|",
        "max grad error", "(parameter)", "bound", ""]))
    print(f"\n{'PASS' if ok else 'FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not under_torchrun():
        print(f"starting {args.ulysses * args.ring} processes...", flush=True)
    return launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
