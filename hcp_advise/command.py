"""``python -m hcp_advise``: batches from a spec, the arguments, the report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from hcp_compile.batch.packing import log_uniform_lengths
from hcp_compile.batch.placements import PLACEMENTS
from hcp_compile.batch.traffic import CallShape
from hcp_compile.kernels import KERNEL_CHOICES, measured
from hcp_compile.validation import InputError

from . import measure
from .chooser import advise
from .measurements import CACHE_ENV, KernelTable, cache_dir, cache_file, kernel_table
from .records import DEFAULT_DEVICE, Links
from .report import format_advice, wrapped

DESCRIPTION = ("Which ulysses x ring mesh and placement for your batches: per option the predicted step "
               "time per rank and its exposed communication, and why the best wins; options closer to the "
               "best than the model's measured error are shown as a tie. Kernel times are stored for the "
               f"{DEFAULT_DEVICE}; for another GPU run it once with --measure on that GPU.")


def cu_seqlens_of(lengths: Sequence[int]) -> Tensor:
    return torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.int32)


def batches_from(spec: str, tokens: int, count: int, seed: int) -> list[Tensor]:
    """``"one"``: one document of ``tokens``; ``"loguniform:LOW:HIGH"``: ``count`` batches of
    ``tokens`` drawn with seeds ``seed..``; otherwise a file, one batch per line of
    whitespace-separated document lengths."""
    if spec == "one":
        return [cu_seqlens_of([tokens])]
    if spec.startswith("loguniform:"):
        try:
            low, high = (int(x) for x in spec.split(":")[1:])
        except ValueError:
            raise InputError(f"lengths: expected loguniform:LOW:HIGH with ints, got {spec!r}") from None
        if not 1 <= low <= high:
            raise InputError(f"lengths: expected 1 <= LOW <= HIGH in loguniform:LOW:HIGH, got {spec!r}")
        return [cu_seqlens_of(log_uniform_lengths(tokens, low, high, seed + i)) for i in range(count)]
    path = Path(spec)
    if not path.is_file():
        raise InputError(f"lengths: expected 'one', 'loguniform:LOW:HIGH' or a file of document "
                         f"lengths (one batch per line), got {spec!r}, which is no file")
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
    try:
        return [cu_seqlens_of([int(x) for x in line]) for line in lines]
    except ValueError:
        raise InputError(f"lengths: {spec} must hold whitespace-separated int lengths, one batch per line") from None


def parse_heads(text: str) -> tuple[int, int]:
    try:
        heads_q, heads_kv = (int(x) for x in text.split("/"))
    except ValueError:
        raise InputError(f"heads: expected HQ/HKV (e.g. 32/8), got {text!r}") from None
    return heads_q, heads_kv


# the link options: their Links field, and how many of its units make one of the option's
LINK_OPTIONS = {
    "all_to_all_gbs": ("all_to_all_bytes_per_s", 1e9),
    "ring_nvlink_gbs": ("ring_nvlink_bytes_per_s", 1e9),
    "network_gbs": ("network_bytes_per_s", 1e9),
    "nvlink_latency_us": ("nvlink_latency_s", 1e-6),
    "network_latency_us": ("network_latency_s", 1e-6),
}
NVLINK_FIELDS = ("all_to_all_bytes_per_s", "ring_nvlink_bytes_per_s", "nvlink_latency_s")  # what --measure can measure


class _Given(argparse.Action):
    """Stores the value and notes that it was given: a value ``--measure`` measured must not
    replace it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def local_device_kind() -> str:
    """This machine's GPU kind where it has one (as measurements are recorded by), else the one
    whose measurements the package stores."""
    return measured.device_kind(torch.device("cuda")) if torch.cuda.is_available() else DEFAULT_DEVICE


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(prog="python -m hcp_advise", description=DESCRIPTION)
    add = result.add_argument
    add("--world", type=int, help="GPUs of the CP mesh, ulysses x ring (required, except with --measure alone)")
    add("--gpus-per-node", type=int, default=8,
        help="GPUs per node; a Ulysses group stays inside one, a ring of more crosses the network "
             "(default %(default)s)")
    add("--heads", default="32/8", help="query/key-value heads, HQ/HKV (default %(default)s)")
    add("--head-dim", type=int, default=128, help="elements per head (default %(default)s)")
    add("--lengths", default="loguniform:256:32768",
        help="the batches: 'one' (one document of --tokens), 'loguniform:LOW:HIGH' (document lengths in tokens, "
             "drawn log-uniformly) or a file of whitespace-separated lengths, one batch per line (default %(default)s)")
    add("--tokens", type=int, default=1 << 20, help="tokens per drawn batch, all ranks together (default %(default)s)")
    add("--batches", type=int, default=1, help="drawn batches to average over (default %(default)s)")
    add("--seed", type=int, default=0,
        help="seed of the first drawn batch, the next ones +1 each (default %(default)s)")
    add("--placements", default=",".join(PLACEMENTS),
        help="comma-separated placements to compare (default %(default)s)")
    add("--kernel", default="auto",
        help=f"block kernel, one of {', '.join(KERNEL_CHOICES)}; 'auto': what context_parallel's auto takes on "
             "the device kind, the best measured (default %(default)s)")
    add("--device-kind", default=local_device_kind(),
        help="the GPU whose kernel measurements time the blocks, as torch.cuda.get_device_name() names it "
             "(default: this machine's GPU, else the stored one; here %(default)s)")
    add("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
        help="of q, k, v (default %(default)s)")
    add("--window", type=int, default=-1,
        help="a causal sliding window: the keys each query sees back, in tokens (default %(default)s: none)")
    defaults = Links()
    for name, help_text in [
        ("all_to_all_gbs", "NVLink all-to-all bandwidth, GB/s per GPU and direction (default %(default)s, an H200's, "
                           "measured; on a device kind measured with --measure on 2+ GPUs, what it measured)"),
        ("ring_nvlink_gbs", "bandwidth of a ring hop over NVLink, GB/s per GPU and direction (default %(default)s, an "
                            "H200's, measured; as --all-to-all-gbs after --measure)"),
        ("network_gbs", "bandwidth across nodes, GB/s per GPU and direction (default %(default)s: 400 Gb/s, nominal)"),
        ("nvlink_latency_us", "latency of one NVLink collective, microseconds (default %(default)s, assumed; as "
                              "--all-to-all-gbs after --measure)"),
        ("network_latency_us", "latency of one collective across nodes, microseconds (default %(default)s, assumed)"),
    ]:
        field, scale = LINK_OPTIONS[name]
        add(f"--{name.replace('_', '-')}", type=float, default=round(getattr(defaults, field) / scale, 9),
            action=_Given, help=help_text)
    add("--verbose", action="store_true",
        help="a table of every part of each prediction (kernel, head groups, ring link, compute, other GPU "
             "work, host, imbalance, exposed all-to-all and ring, bytes), not the 5 columns (default: off)")
    add("--measure", action="store_true",
        help="first measure this machine's GPU (CUDA; about 2 minutes): the kernels' times at --heads, --head-dim, "
             "--dtype (only --kernel unless 'auto'; the window's with --window) and, with 2+ GPUs visible, NVLink; "
             "then store them in --cache-dir, where later calls for this GPU kind read them (default: off)")
    add("--cache-dir", type=Path, default=cache_dir(),
        help=f"folder of the measurements --measure stores, one advisor-<device kind>.json per GPU kind "
             f"(default ${CACHE_ENV}, else ~/.cache/hcp_compile; here %(default)s)")
    return result


def links_of(args: argparse.Namespace, table: KernelTable) -> tuple[Links, list[str]]:
    """The links: each option given, else what ``--measure`` measured for the device kind, else
    the option's default (an H200's); and a line where a GPU other than the H200 gets an H200's
    NVLink figures."""
    given = getattr(args, "given", set())
    values, kept = {}, []
    for name, (field, scale) in LINK_OPTIONS.items():
        if field in table.links and name not in given:
            values[field] = table.links[field]
        else:
            values[field] = getattr(args, name) * scale
            if name not in given and field in NVLINK_FIELDS:
                kept.append(f"--{name.replace('_', '-')}")
    note = []
    if kept and table.device_kind != DEFAULT_DEVICE:
        note = [f"links: an NVIDIA H200's NVLink figures for the {table.device_kind} "
                f"({table.links_note or 'its NVLink was not measured'}); pass {', '.join(kept)} for its own"]
    return Links(**values), note


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None, log: Callable[[str], object] = _progress) -> str:
    """The report of ``python -m hcp_advise ARGV``; ``log``: where ``--measure`` says what it times."""
    command = parser()
    args = command.parse_args(argv)
    if args.world is None and not args.measure:
        command.error("--world is required: the GPUs of the CP mesh")
    heads_q, heads_kv = parse_heads(args.heads)
    dtype = getattr(torch, args.dtype)
    measured_lines = []
    if args.measure:
        if not torch.cuda.is_available():
            raise InputError("measure: needs a CUDA GPU, of the kind to advise for; torch sees none on this machine")
        here = local_device_kind()
        if args.device_kind != here:
            raise InputError(f"device_kind: --measure measures this machine's GPU, {here!r}, not "
                             f"{args.device_kind!r}; leave --device-kind out, or run it on that GPU")
        measured_lines = measure.measure(here, args.kernel, CallShape(heads_q, heads_kv, args.head_dim, dtype),
                                         args.window, cache_file(here, args.cache_dir), log)
        if args.world is None:
            return "\n".join(measured_lines)
    links, links_note = links_of(args, kernel_table(args.device_kind, args.cache_dir))
    batches = batches_from(args.lengths, args.tokens, args.batches, args.seed)
    advice = advise(batches, world=args.world, gpus_per_node=args.gpus_per_node, heads_q=heads_q,
                    heads_kv=heads_kv, head_dim=args.head_dim, dtype=dtype,
                    placements=[p for p in args.placements.split(",") if p], kernel=args.kernel,
                    device_kind=args.device_kind, links=links, window=args.window, cache_dir=args.cache_dir)
    return "\n".join([*measured_lines, format_advice(advice, args.verbose), *map(wrapped, links_note)])
