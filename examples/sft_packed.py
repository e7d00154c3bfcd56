"""TRL's ``SFTTrainer(packing=True)`` (or transformers' ``Trainer`` on
``DataCollatorWithFlattening`` batches) under hierarchical context parallelism, with
``hcp_compile.trainer.ContextParallelMixin``.

    python examples/sft_packed.py                      # 4 CPU processes (gloo): ulysses 2 x ring 2
    python examples/sft_packed.py --trainer trainer    # transformers' Trainer, padding-free collator
    python examples/sft_packed.py --compile            # torch_compile_backend="hcp"
    python examples/sft_packed.py --data 2 --ulysses 2 --ring 1
    torchrun --nproc-per-node 8 examples/sft_packed.py --device cuda --data 2 --ulysses 2 --ring 2

A tiny randomly initialized ``LlamaForCausalLM`` (no download) with ``attn_implementation="hcp"``
learns a synthetic text dataset (built in memory, a character tokenizer): every rank of a
context-parallel group gets the same packed batch and trains on its shard. Rank 0 then runs the
plain trainer class on one process (a subprocess, the same data: ``data`` times the batch) and
checks the logged loss of every step and the final weights against it. Without torchrun the
script spawns ``data x ulysses x ring`` processes itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

import hcp_compile
from _common import Worker, add_launch_args, launch, tolerance
from datasets import Dataset
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig, PreTrainedTokenizerFast,
    Trainer, TrainingArguments,
)
from trl import SFTConfig, SFTTrainer

from hcp_compile.trainer import ContextParallelMixin, ContextParallelTrainer

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "sun", "is", "hot"]


class CPSFTTrainer(ContextParallelMixin, SFTTrainer):
    """SFTTrainer under hcp context parallelism: all it takes."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_launch_args(parser, ulysses=2, ring=2, device="cpu", dtype="float32")
    parser.add_argument("--data", type=int, default=1, help="data-parallel replicas D")
    parser.add_argument("--trainer", choices=("sft", "trainer"), default="sft")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=4,
                        help="examples per step, over all data replicas (a multiple of --data)")
    parser.add_argument("--compile", action="store_true", help="torch_compile_backend='hcp'")
    parser.add_argument("--reference", metavar="JSON", help=argparse.SUPPRESS)  # one process
    return parser.parse_args(argv)


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                   eos_token="<eos>", unk_token="<unk>")


def texts(count: int, seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    sentences = []
    for _ in range(count):
        n = int(torch.randint(1, 13, (1,), generator=generator))
        words = torch.randint(len(WORDS), (n,), generator=generator)
        sentences.append(" ".join(WORDS[int(i)] for i in words) + ".")
    return sentences


def build_trainer(args: argparse.Namespace, out_dir: str, device: torch.device,
                  mesh=None) -> Trainer:
    """The CP trainer on ``mesh``, or the plain trainer class (one process) without it."""
    torch.manual_seed(args.seed)  # the same initial weights in every process
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(CHARS) + 3,
                         max_position_embeddings=256, use_cache=False, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="hcp").to(device)
    replicas = args.data if mesh is not None else 1
    common = dict(output_dir=out_dir, per_device_train_batch_size=args.batch // replicas,
                  gradient_accumulation_steps=2, max_steps=args.steps, learning_rate=5e-3,
                  lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                  report_to=[], use_cpu=device.type == "cpu", seed=args.seed, disable_tqdm=True)
    if args.compile and mesh is not None:  # the reference runs eagerly
        common.update(torch_compile=True, torch_compile_backend="hcp", gradient_checkpointing=False)
    cp = {} if mesh is None else {"mesh": mesh}
    if args.compile and mesh is not None and device.type == "cpu":
        cp["hcp_options"] = {"inner": "aot_eager"}
    tokenizer = char_tokenizer()
    if args.trainer == "sft":
        trainer_class = CPSFTTrainer if mesh is not None else SFTTrainer
        return trainer_class(model=model, args=SFTConfig(packing=True, max_length=64, bf16=False, **common),
                             processing_class=tokenizer,
                             train_dataset=Dataset.from_dict({"text": texts(256, args.seed)}), **cp)
    ids = [tokenizer(text)["input_ids"] for text in texts(256, args.seed)]
    trainer_class = ContextParallelTrainer if mesh is not None else Trainer
    return trainer_class(model=model, args=TrainingArguments(**common),
                         data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True),
                         train_dataset=Dataset.from_dict({"input_ids": ids}), **cp)


def run_summary(trainer: Trainer) -> dict:
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    weights = {name: p.detach().cpu().flatten().tolist() for name, p in trainer.model.named_parameters()}
    return {"losses": losses, "weights": weights}


def one_process(args: argparse.Namespace) -> dict:
    """The plain trainer class in a fresh process (no process group, no CP), same data."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "reference.json")
        argv = [arg for arg in sys.argv[1:] if arg != "--compile"]
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")}
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--reference", out],
                       check=True, env=env)
        with open(out) as file:
            return json.load(file)


def worker(me: Worker, args: argparse.Namespace) -> bool:
    # accelerate reads its process index and count from torchrun's variables
    os.environ.update(RANK=str(me.rank), WORLD_SIZE=str(me.world_size),
                      LOCAL_RANK=os.environ.get("LOCAL_RANK", str(me.rank)))
    mesh = hcp_compile.make_mesh(args.ulysses, args.ring, args.device, data=args.data)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args, tmp, me.device, mesh)
        trainer.train()
        got = run_summary(trainer)
    if me.rank != 0:
        return True
    expected = one_process(args)
    tol = tolerance(torch.float32, gqa=True)
    loss_error = max(abs(a - b) / (1 + abs(b)) for a, b in zip(got["losses"], expected["losses"]))
    weight_error = max(
        (torch.tensor(got["weights"][name]) - torch.tensor(values)).abs().max().item()
        for name, values in expected["weights"].items()
    )
    ok = len(got["losses"]) == len(expected["losses"]) and max(loss_error, weight_error) <= 10 * tol
    mode = "compiled (torch_compile_backend='hcp')" if args.compile else "eager (context_parallel)"
    print(f"{args.trainer}: data {args.data} x ulysses {args.ulysses} x ring {args.ring}, {mode}")
    print("loss per step, CP:         ", " ".join(f"{x:.4f}" for x in got["losses"]))
    print("loss per step, one process:", " ".join(f"{x:.4f}" for x in expected["losses"]))
    print(f"max relative loss difference {loss_error:.2e}, max weight difference {weight_error:.2e} "
          f"after {args.steps} steps: {'PASS' if ok else 'FAIL'} (bound {10 * tol:g})")
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.batch % args.data:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --data {args.data}")
    if args.reference:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = build_trainer(args, tmp, torch.device(args.device))
            trainer.train()
            with open(args.reference, "w") as file:
                json.dump(run_summary(trainer), file)
        return 0
    return launch(worker, args, data=args.data)


if __name__ == "__main__":
    sys.exit(main())
