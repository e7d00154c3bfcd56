"""Fine-tune a Hugging Face transformers model on a packed batch with hierarchical context
parallelism (``attn_implementation="hcp"``).

    python examples/finetune_hf.py                  # 4 CPU processes (gloo): ulysses 2 x ring 2
    python examples/finetune_hf.py --compile        # the same, torch.compile(backend="hcp")
    torchrun --nproc-per-node 8 examples/finetune_hf.py --device cuda --ulysses 4 --ring 2

A tiny randomly initialized ``LlamaForCausalLM`` (no download; any model whose attention goes
through transformers' attention registry works the same way) is trained for a few steps on one
packed batch from ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``. Every rank
builds the same global batch and feeds the model its shard: ``plan.shard(input_ids)``,
``position_ids=plan.position_ids`` and the GLOBAL ``cu_seq_lens_*``/``max_length_*``. The loss
is the sum of the shard's next-token losses over the real-token count of the whole batch, so
that the ranks' gradients sum to the one-device gradient. Rank 0 checks the first step's loss
against the same model run on the whole batch in one process. Without torchrun the script
spawns ``ulysses x ring`` processes itself.
"""

from __future__ import annotations

import argparse
import copy
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import hcp_compile  # registers attn_implementation="hcp" with transformers
from _common import DTYPES, Worker, add_launch_args, launch, tolerance
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

IGNORE = -100  # transformers' ignore index: no loss on this token
PACKED_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_launch_args(parser, ulysses=2, ring=2, device="cpu", dtype="float32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--docs", type=int, default=6, help="documents in the packed batch")
    parser.add_argument("--max-doc", type=int, default=40, help="longest document")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile(model, backend='hcp') instead of context_parallel")
    return parser.parse_args(argv)


def tiny_llama(dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                         max_position_embeddings=256, use_cache=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation="hcp").to(device, dtype)


def packed_batch(args: argparse.Namespace, vocab: int, device: torch.device) -> dict:
    """Documents of random lengths, each counting through the vocabulary with its own stride
    (learnable), packed by transformers' collator into one row."""
    generator = torch.Generator().manual_seed(args.seed)
    documents = []
    for _ in range(args.docs):
        length = int(torch.randint(2, args.max_doc + 1, (1,), generator=generator))
        start, stride = (int(torch.randint(n, (1,), generator=generator)) for n in (vocab, 5))
        tokens = (start + (stride + 1) * torch.arange(length)) % vocab
        documents.append({"input_ids": tokens.tolist()})
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(documents)
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


def next_token_targets(labels: Tensor) -> Tensor:
    """``[T]``: each token's next label. The collator puts IGNORE on each document's first
    token, so no token learns to predict the next document. Shifted on the GLOBAL row: after
    sharding, a token's successor may live on another rank."""
    return torch.cat([labels[0, 1:], labels.new_full((1,), IGNORE)])


def cp_step(model, mesh, batch: dict, num_targets: int, compiled: bool) -> Tensor:
    """Forward and backward on this rank's shard; returns the local share of the loss."""
    plan = hcp_compile.shard_plan(batch["cu_seq_lens_q"], mesh)
    inputs = {
        "input_ids": plan.shard(batch["input_ids"][0])[None],
        "position_ids": plan.position_ids[None],  # positions inside each document, for RoPE
        **{name: batch[name] for name in PACKED_KEYWORDS},  # GLOBAL document boundaries
    }
    targets = plan.shard(next_token_targets(batch["labels"]), pad_value=IGNORE)
    # the compiled graph carries the CP rewrite; eagerly, the context switches attention to CP
    with nullcontext() if compiled else hcp_compile.context_parallel(mesh):
        logits = model(**inputs).logits[0]
    loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")
    loss = loss / num_targets
    loss.backward()
    return loss.detach()


def one_process_loss(model, batch: dict, num_targets: int) -> float:
    """The same model on the whole batch on this rank alone (no CP); transformers shifts the
    labels itself."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                labels=batch["labels"], num_items_in_batch=num_targets,
                **{name: batch[name] for name in PACKED_KEYWORDS})
    return out.loss.item()


def worker(me: Worker, args: argparse.Namespace) -> bool:
    dtype = DTYPES[args.dtype]
    mesh = hcp_compile.make_mesh(ulysses=args.ulysses, ring=args.ring, device_type=args.device)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = tiny_llama(dtype, me.device)
    reference = copy.deepcopy(model) if me.rank == 0 else None
    batch = packed_batch(args, model.config.vocab_size, me.device)
    num_targets = int((next_token_targets(batch["labels"]) != IGNORE).sum())
    step_model = model
    if args.compile:
        inner = "inductor" if args.device == "cuda" else "aot_eager"
        step_model = torch.compile(model, backend="hcp", options={"mesh": mesh, "inner": inner})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    losses = []
    for _ in range(args.steps):
        loss = cp_step(step_model, mesh, batch, num_targets, args.compile)
        for parameter in model.parameters():  # each rank holds its tokens' share
            dist.all_reduce(parameter.grad)
        dist.all_reduce(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if me.rank != 0:
        return True

    expected = one_process_loss(reference, batch, num_targets)
    tol = tolerance(dtype, gqa=True)
    ok = abs(losses[0] - expected) <= tol + tol * abs(expected)
    lengths = (batch["cu_seq_lens_q"][1:] - batch["cu_seq_lens_q"][:-1]).tolist()
    mode = "compiled (backend='hcp')" if args.compile else "eager (context_parallel)"
    print(f"documents {lengths}, ulysses {args.ulysses} x ring {args.ring}, {mode}, {args.dtype}")
    print("loss per step:", " ".join(f"{loss:.4f}" for loss in losses))
    print(f"step 1 loss under CP {losses[0]:.6f}, one process {expected:.6f}: "
          f"{'PASS' if ok else 'FAIL'} (tolerance {tol:g})")
    return ok


def main(argv: list[str] | None = None) -> int:
    return launch(worker, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
