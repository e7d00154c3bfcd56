"""Capacity: how many tokens one training step fits on N GPUs (issue 48, item 1).

    python -m benchmarks.capacity --modes one-gpu-eager,one-gpu-compiled --out $OUT/one.json
    python -m benchmarks.capacity --modes hcp-eager,hcp-compiled --meshes 2x1,2x2,2x4 --out $OUT/cp.json
    python -m benchmarks.capacity --merge $OUT/one.json $OUT/cp.json --plot $OUT/capacity.png
    python -m benchmarks.capacity --device cpu --tiny --meshes 2x1 --out /tmp/c.json  # CPU smoke run

The largest global batch whose whole training step (decoder layers of Llama 3 8B's shapes) fits
a per-process memory cap, per mode, mesh, checkpointing and workload, with its peak memory, step
time and ratio to N x one GPU's. AxR rows: one rank alone over torch's fake process group (its
memory; its compute time without communication). The search: :func:`fitted_start`, then
:func:`largest_fitting`. docs/benchmarks.md, "Capacity: tokens per step on N ranks", says more.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import hcp_compile
from benchmarks.capacity_report import ONE_GPU_MODES, Row, merge, plot, relate, table, write_json
from benchmarks.common import log_uniform_lengths
from benchmarks.speed_setup import cu_seqlens, fake_process_group

CP_MODES = ("hcp-eager", "hcp-compiled")
MODES = (*ONE_GPU_MODES, *CP_MODES)
WORKLOADS = ("W2", "one-doc")
W2_RANGE = (256, 32768)
TINY_SHRINK = 64  # --tiny: W2's lengths divided by this
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    dtype: torch.dtype


LLAMA3_8B = ModelShape(4096, 32, 8, 128, 14336, torch.bfloat16)
TINY = ModelShape(64, 4, 2, 16, 128, torch.float32)


def rope(x: Tensor, positions: Tensor, base: float = 500000.0) -> Tensor:
    """Rotary embedding (Llama 3's base) of ``x [T, H, D]`` at ``positions [T]``, half against half."""
    half = x.shape[-1] // 2
    inverse = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = (positions.float()[:, None] * inverse)[:, None, :]  # [T, 1, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class Block(nn.Module):
    """A Llama decoder layer on packed ``x [T, hidden]``, under non-reentrant checkpointing if asked."""

    def __init__(self, shape: ModelShape, checkpointed: bool, device: torch.device):
        super().__init__()
        kw = {"device": device, "dtype": shape.dtype}
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.shape, self.checkpointed, self.split = shape, checkpointed, (q, kv, kv)
        self.attention_norm = nn.RMSNorm(shape.hidden, eps=1e-5, **kw)
        self.qkv = nn.Linear(shape.hidden, q + 2 * kv, bias=False, **kw)
        self.out = nn.Linear(q, shape.hidden, bias=False, **kw)
        self.mlp_norm = nn.RMSNorm(shape.hidden, eps=1e-5, **kw)
        self.gate_up = nn.Linear(shape.hidden, 2 * shape.mlp, bias=False, **kw)
        self.down = nn.Linear(shape.mlp, shape.hidden, bias=False, **kw)

    def forward(self, x: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        run = functools.partial(checkpoint, self.layer, use_reentrant=False) if self.checkpointed else self.layer
        return run(x, positions, cu_seqlens, max_seqlen)

    def layer(self, x: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        s = self.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(self.split, dim=-1)
        q = rope(q.unflatten(-1, (s.heads, s.head_dim)), positions)
        k = rope(k.unflatten(-1, (s.kv_heads, s.head_dim)), positions)
        v = v.unflatten(-1, (s.kv_heads, s.head_dim))
        attended = hcp_compile.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                causal=True)
        x = x + self.out(attended.flatten(1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


@dataclass(frozen=True)
class Setup:  # a trainer's configuration but its mesh
    shape: ModelShape
    layers: int
    mode: str
    checkpointing: bool
    device: torch.device
    inner: str  # the compiled modes' compiler (hcp's inner; one-gpu-compiled's backend)
    fake: bool = False  # over the fake process group: received data is garbage


@dataclass
class StepBatch:  # one rank's inputs of a step, and the GLOBAL documents
    x: Tensor  # [local tokens, hidden]
    positions: Tensor
    cu: Tensor
    longest: int
    valid: Tensor | None  # under CP: the real (not pad) local tokens
    real_tokens: int  # the whole batch's, over all ranks


def document_positions(cu: Tensor) -> Tensor:
    """Each token's position inside its document (one GPU's RoPE positions)."""
    lengths = (cu[1:] - cu[:-1]).long()
    return torch.arange(int(cu[-1]), device=cu.device) - torch.repeat_interleave(cu[:-1].long(), lengths)


class Trainer:
    """One configuration's model, AdamW and training step on one rank (``mesh`` None: one GPU)."""

    def __init__(self, setup: Setup, mesh: dist.device_mesh.DeviceMesh | None = None):
        compiled = setup.mode.endswith("compiled")
        torch.manual_seed(0)  # the same weights in every trainer: the tests compare two
        self.setup, self.mesh = setup, mesh
        self.blocks = [Block(setup.shape, setup.checkpointing, setup.device) for _ in range(setup.layers)]
        self.norm = nn.RMSNorm(setup.shape.hidden, eps=1e-5, device=setup.device, dtype=setup.shape.dtype)
        self.parameters = [p for m in (*self.blocks, self.norm) for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=1e-5, fused=setup.device.type == "cuda")
        # one backend for every block: the blocks share Block.forward's code, whose graphs
        # Dynamo keeps per backend (one backend each would reach its recompile limit)
        hcp = setup.mode == "hcp-compiled"  # else plain torch.compile with the same compiler
        backend = hcp_compile.backend(mesh=mesh, inner=setup.inner) if hcp else setup.inner
        self.calls = [self._compiled(b, backend) for b in self.blocks] if compiled else self.blocks

    @staticmethod
    def _compiled(block: Block, backend: str | Callable) -> Callable[..., Tensor]:
        compiled = torch.compile(block, backend=backend, fullgraph=True)

        def call(x: Tensor, positions: Tensor, cu: Tensor, longest: int) -> Tensor:
            # tokens, documents and the longest document as symbols: one graph for all sizes
            for t in (x, positions, cu):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            with torch.compiler.config.patch(dynamic_sources="L['max_seqlen']"):
                return compiled(x, positions, cu, longest)

        return call

    def batch(self, lengths: Sequence[int], x: Tensor | None = None) -> StepBatch:
        """This rank's batch: ``x`` (global ``[T, hidden]``) sharded, or random hidden states made
        on the rank (not the global tensor: N times its size)."""
        hidden, kw = self.setup.shape.hidden, {"device": self.setup.device, "dtype": self.setup.shape.dtype}
        cu = cu_seqlens(lengths, self.setup.device)
        if self.mesh is None:
            x = torch.randn(sum(lengths), hidden, **kw) if x is None else x
            return StepBatch(x, document_positions(cu), cu, max(lengths), None, sum(lengths))
        plan = hcp_compile.shard_plan(cu, self.mesh)
        x = torch.randn(plan.local_tokens, hidden, **kw) if x is None else plan.shard(x)
        return StepBatch(x, plan.position_ids, cu, max(lengths), plan.valid, sum(lengths))

    def step(self, batch: StepBatch) -> Tensor:
        """One step; returns this rank's share of the loss (the shares sum to one GPU's loss)."""
        self.optimizer.zero_grad(set_to_none=True)
        cp = self.setup.mode == "hcp-eager"
        # the backward inside too: a checkpointed block recomputes its forward there
        with hcp_compile.context_parallel(self.mesh) if cp else contextlib.nullcontext():
            x = batch.x
            for call in self.calls:
                x = call(x, batch.positions, batch.cu, batch.longest)
            per_token = self.norm(x).float().square().mean(-1)
            loss = (per_token if batch.valid is None else per_token * batch.valid).sum() / batch.real_tokens
            loss.backward()
        for p in self.parameters if self.mesh is not None else ():
            dist.all_reduce(p.grad)
            if self.setup.fake:  # garbage received may hold NaN: it must not reach the weights
                p.grad.nan_to_num_(0.0, 0.0, 0.0)
        self.optimizer.step()
        return loss.detach()

    def release(self) -> None:
        """Back to the state between steps: parameters and optimizer states only."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.setup.device.type == "cuda":  # (CPU memory is not measured)
            gc.collect()  # reference cycles of the step hold device memory until collected
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def workload_lengths(workload: str, tokens: int, shrink: int = 1) -> list[int]:
    low, high = (max(1, n // shrink) for n in W2_RANGE)  # W2: seed 0, as benchmarks.speed draws it
    return [tokens] if workload == "one-doc" else log_uniform_lengths(tokens, low, high, seed=0)


def largest_fitting(fits: Callable[[int], bool], start: int, granularity: int, limit: int = 2**40) -> int:
    """The largest multiple of ``granularity`` up to ``limit`` that ``fits`` (true up to some size),
    0 if none: from ``start``, steps of 1, 2, 4, ... units up while sizes fit (down while they
    fail), then bisection; no size twice."""
    if granularity < 1 or limit < granularity:
        raise ValueError(f"largest_fitting: expected 1 <= granularity <= limit, got {granularity}, {limit}")
    known: dict[int, bool] = {}  # by grid units

    def ok(units: int) -> bool:
        if units not in known:
            known[units] = fits(units * granularity)
        return known[units]

    top = limit // granularity
    low, high = 0, top + 1  # the largest size known to fit (0: none), the smallest known to fail
    trial, step, upward = min(top, max(1, round(start / granularity))), 1, None
    while high - low > 1:
        low, high = (trial, high) if ok(trial) else (low, trial)
        upward = low == trial if upward is None else upward
        if upward and high > top:
            trial = min(top, low + step)
        elif not upward and low == 0:
            trial = max(1, high - step)
        else:
            trial = (low + high) // 2
        step *= 2
    return low * granularity


def fitted_start(usage: Callable[[int], float], granularity: int, limit: float) -> int:
    """A size near the capacity: ``usage`` (what the cap limits; inf where the step failed)
    at 2 and 8 grid units, extrapolated linearly to ``limit`` and rounded down to the grid."""
    small, large = 2 * granularity, 8 * granularity
    if math.isinf(low := usage(small)) or math.isinf(high := usage(large)):
        return granularity if math.isinf(low) else small
    if high <= low:  # no growth measured: nothing to extrapolate, start above the fit
        return 2 * large
    predicted = large + (limit - high) * (large - small) / (high - low)
    return max(granularity, int(predicted // granularity) * granularity)


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` or one it wraps (compiled code re-raises inside others) is out of memory."""
    return any(isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower() for e in _chain(error))


def _drop_frames(error: BaseException) -> None:
    """Clear the frames of ``error``'s chain: a kept traceback would hold the step's activations."""
    for e in _chain(error):
        traceback.clear_frames(e.__traceback__)


@dataclass(frozen=True)
class Options:
    granularity: int
    steps: int
    shrink: int
    cap: float  # CUDA: the bytes the allocator may reserve; CPU: the local tokens a rank may hold
    cuda: bool


@dataclass
class Probe:
    fits: bool
    used: float  # CUDA: max reserved bytes; CPU: local tokens; inf where the step failed
    peak_gib: float | None = None  # max allocated (CUDA)


def probe(trainer: Trainer, lengths: list[int], options: Options) -> Probe:
    """One step of ``lengths``, all it made freed after it; out of memory: the size does not fit."""
    try:
        result = _measured_step(trainer, lengths, options)
    except Exception as error:  # noqa: BLE001 - only out-of-memory errors are results
        if not out_of_memory(error):
            raise
        _drop_frames(error)
        result = Probe(False, math.inf)
    trainer.release()
    return result


def _measured_step(trainer: Trainer, lengths: list[int], options: Options) -> Probe:
    batch = trainer.batch(lengths)
    trainer.step(batch)
    if not options.cuda:  # the rank's local tokens stand in for its memory
        return Probe(batch.x.shape[0] <= options.cap, float(batch.x.shape[0]))
    torch.cuda.synchronize()
    return Probe(True, float(torch.cuda.max_memory_reserved()), torch.cuda.max_memory_allocated() / GIB)


def measure_row(trainer: Trainer, row: Row, options: Options) -> Row:
    """The capacity of ``trainer``'s configuration on the row's workload, and steps at it."""
    started, cuda, grid = time.perf_counter(), options.cuda, options.granularity
    results: dict[int, Probe] = {}
    baseline = torch.cuda.memory_allocated() if cuda else 0

    def run(per_rank: int) -> Probe:
        if per_rank not in results:
            lengths = workload_lengths(row.workload, row.gpus * per_rank, options.shrink)
            results[per_rank] = probe(trainer, lengths, options)
        return results[per_rank]

    run(grid)  # the compile and the kernels' first builds, outside the fit
    found = largest_fitting(lambda n: run(n).fits, fitted_start(lambda n: run(n).used, grid, options.cap), grid)
    row.per_rank, row.capacity, row.probes = found, row.gpus * found, len(results)
    if found:
        if cuda:
            row.peak_gib, row.reserved_gib = round(results[found].peak_gib, 3), round(results[found].used / GIB, 3)
        # the median of more steps on one batch, host clock (the probe at this size warmed up),
        # each from a probe's state (the cache of the step before fragments what the cap leaves;
        # on the GPU without this, steps at the capacity ran out of memory); an error here is the
        # row's, its capacity kept
        batch, times = trainer.batch(workload_lengths(row.workload, row.capacity, options.shrink)), []
        for _ in range(options.steps):
            trainer.release()
            begun = time.perf_counter()
            trainer.step(batch)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - begun) * 1e3)
        del batch
        row.step_ms = round(statistics.median(times), 1)
        row.tokens_per_s_per_gpu = round(row.capacity / row.gpus / (row.step_ms / 1e3))
        trainer.release()
    row.leaked_gib = round((torch.cuda.memory_allocated() - baseline) / GIB, 3) if cuda else None
    row.seconds = round(time.perf_counter() - started, 1)
    return row


def confirm_ranks(rows: list[Row], trainer_of: Callable[[int], contextlib.AbstractContextManager[Trainer]],
                  options: Options) -> None:
    """``--all-ranks``: each row's size on every other rank of its mesh, one grid unit less on all
    of them while one fails (``all_ranks_capacity``)."""
    sizes = {id(r): r.per_rank for r in rows}
    pending = [r for r in rows if r.capacity]
    while pending:
        failed: list[Row] = []
        for rank in (r for r in range(pending[0].gpus) if r != pending[0].rank):
            with trainer_of(rank) as trainer:
                failed += [row for row in pending if row not in failed and not probe(
                    trainer, workload_lengths(row.workload, row.gpus * sizes[id(row)], options.shrink), options).fits]
            del trainer  # before the next rank's trainer is built
        for row in failed:
            sizes[id(row)] -= options.granularity
        pending = [r for r in failed if sizes[id(r)] > 0]
    for row in rows:
        row.all_ranks_capacity = row.gpus * sizes[id(row)] if row.capacity else None


def parse_list(text: str, allowed: Sequence[str], option: str, parser: argparse.ArgumentParser) -> list[str]:
    picked = [w.strip() for w in text.split(",") if w.strip()]
    if not picked or any(w not in allowed for w in picked):
        why = " (torch-cp needs real ranks, not the fake process group: not measured here)" * ("torch-cp" in picked)
        parser.error(f"{option}: expected some of {', '.join(allowed)}, got {text!r}{why}")
    return picked


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--device", default="cuda", choices=("cuda", "cpu"))
    add("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    add("--meshes", default="2x1,2x2,2x4", help="ULYSSESxRING, comma-separated, for the hcp modes")
    add("--rank", type=int, default=0, help="the rank of each mesh run alone")
    add("--all-ranks", action="store_true", help="confirm every other rank at the size found")
    add("--checkpointing", default="both", choices=("off", "on", "both"))
    add("--workloads", default=",".join(WORKLOADS))
    add("--layers", type=int, default=4)
    add("--cap-gib", type=float, default=40.0, help="per-process memory cap (CUDA)")
    add("--cap-tokens", type=int, default=512, help="CPU: the local tokens a rank may hold, the cap's stand-in")
    add("--granularity", type=int, help="tokens per rank of the grid (default 512; --tiny 64)")
    add("--steps", type=int, default=3, help="timed steps at the capacity (median)")
    add("--tiny", action="store_true", help="hidden 64, 4/2 heads of 16, MLP 128, float32, W2 lengths / 64")
    add("--inner", help="compiler of the compiled modes (default inductor on CUDA, aot_eager on CPU)")
    add("--out", type=Path, default=Path("benchmarks/results/capacity.json"))
    add("--plot", type=Path, help="capacity against N into this PNG (needs matplotlib)")
    add("--merge", nargs="+", type=Path, metavar="JSON", help="combine these result files instead of measuring")
    args = parser.parse_args(argv)
    args.modes = parse_list(args.modes, MODES, "--modes", parser)
    args.workloads = parse_list(args.workloads, WORKLOADS, "--workloads", parser)
    sides = [w.strip().split("x") for w in args.meshes.split(",") if w.strip()]
    if not all(len(s) == 2 and all(n.isdigit() and int(n) > 0 for n in s) for s in sides):
        parser.error(f"--meshes: expected ULYSSESxRING such as 2x4, comma-separated, got {args.meshes!r}")
    args.meshes = [(int(a), int(r)) for a, r in sides]
    if any(not 0 <= args.rank < a * r for a, r in args.meshes):
        parser.error(f"--rank {args.rank}: expected a rank of every mesh of --meshes")
    if args.granularity is None:
        args.granularity = 64 if args.tiny else 512
    for option in ("granularity", "layers", "steps", "cap_tokens"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} {getattr(args, option)}: expected at least 1")
    if args.cap_gib <= 0:
        parser.error(f"--cap-gib {args.cap_gib}: expected a positive size")
    if args.device == "cuda" and not torch.cuda.is_available() and not args.merge:
        parser.error("--device cuda: no CUDA device here; pass --device cpu (with --tiny)")
    args.inner = args.inner or ("inductor" if args.device == "cuda" else "aot_eager")
    return args


def set_cap(args: argparse.Namespace, device: torch.device) -> float:
    """The cap of every step; on CUDA after the memory held normal samples (a fake collective's output)."""
    if device.type != "cuda":
        print(f"cap: {args.cap_tokens} local tokens per rank (CPU: the memory cap's stand-in)", flush=True)
        return args.cap_tokens
    total = torch.cuda.get_device_properties(device).total_memory
    cap = min(args.cap_gib * GIB, total)
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    if any(m in CP_MODES for m in args.modes):  # within the cap: other processes may share the GPU
        torch.empty(int(0.8 * cap) // 2, dtype=torch.bfloat16, device=device).normal_()
        torch.cuda.empty_cache()
    print(f"cap: {cap / GIB:.2f} GiB of {total / GIB:.2f} GiB ({torch.cuda.get_device_name(device)})", flush=True)
    return cap


@contextlib.contextmanager
def rank_trainer(setup: Setup, mesh: tuple[int, int] | None, rank: int) -> Iterator[Trainer]:
    """One rank's trainer (one GPU, or ``rank`` of ``mesh`` alone) after a warm step; freed after."""
    with fake_process_group(rank, mesh[0] * mesh[1]) if mesh else contextlib.nullcontext():
        trainer = Trainer(setup, hcp_compile.make_mesh(*mesh, setup.device.type) if mesh else None)
        try:
            trainer.step(trainer.batch([64] * (mesh[0] * mesh[1] if mesh else 1)))
            trainer.release()
            yield trainer
        finally:
            del trainer  # the model's memory goes before the next trainer's, and so do
            torch._dynamo.reset()  # its graphs: each configuration compiles afresh, below the recompile limit
            gc.collect()
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    runs, rows = merge(args.merge) if args.merge else measure(args)
    print(table(rows), flush=True)
    write_json(args.out, runs, rows)
    print(f"wrote {args.out}; total {time.perf_counter() - started:.1f} s", flush=True)
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


def measure(args: argparse.Namespace) -> tuple[list[dict], list[Row]]:
    cuda, started = args.device == "cuda", time.perf_counter()
    # an index: torch.cuda's memory controls (the cap) reject a bare "cuda" on torch 2.11
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    options = Options(args.granularity, args.steps, TINY_SHRINK if args.tiny else 1, set_cap(args, device), cuda)
    runs = [{"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
             "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "options": vars(args)}]
    rows: list[Row] = []

    def keep(row: Row | None) -> None:  # and rewrite the file: a run cut short keeps its rows
        if row is not None:
            rows.append(row)
            print(f"{row.mode} {row.mesh} rank {row.rank} checkpointing {row.checkpointing} {row.workload}: " + (
                row.error[:300] if row.error else f"capacity {row.capacity} ({row.per_rank} per rank), peak "
                f"{row.peak_gib} GiB, {row.step_ms} ms/step, {row.tokens_per_s_per_gpu} tok/s/GPU, {row.probes} "
                f"probes, leaked {row.leaked_gib} GiB") + f" [row {row.seconds} s; run "
                f"{time.perf_counter() - started:.0f} s, compiles included]", flush=True)
        relate(rows)
        write_json(args.out, runs, rows)

    for mode in args.modes:
        for mesh in args.meshes if mode in CP_MODES else [None]:
            for checkpointing in {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]:
                setup = Setup(TINY if args.tiny else LLAMA3_8B, args.layers, mode, checkpointing, device,
                              args.inner, fake=mesh is not None)
                gpus, rank = (mesh[0] * mesh[1], args.rank) if mesh else (1, 0)
                cap = f"{args.cap_gib} GiB" if cuda else f"{args.cap_tokens} tokens per rank"
                built = [Row(mode, f"{mesh[0]}x{mesh[1]}" if mesh else "1", gpus, rank, checkpointing, w, cap)
                         for w in args.workloads]
                measure_configuration(rank_trainer(setup, mesh, rank), built, options, keep)
                if args.all_ranks and gpus > 1:
                    confirm_ranks([r for r in built if not r.error], lambda r: rank_trainer(setup, mesh, r), options)
                    keep(None)
    return runs, rows


def measure_configuration(trainer: contextlib.AbstractContextManager[Trainer], rows: list[Row], options: Options,
                          keep: Callable[[Row], None]) -> None:
    """Every workload's row on one trainer (freed on return); a failing row keeps its error."""
    done = 0  # rows measured, with or without an error
    try:
        with trainer as built:
            for row in rows:
                try:
                    measure_row(built, row, options)
                except Exception as error:  # noqa: BLE001 - an error is the row's result
                    row.error = f"{type(error).__name__}: {error}"
                    _drop_frames(error)
                    built.release()
                done += 1
                keep(row)
    except Exception as error:  # noqa: BLE001 - no trainer: every row left says why
        for row in rows[done:]:
            row.error = f"{type(error).__name__}: {error}"
            keep(row)


if __name__ == "__main__":
    main()
