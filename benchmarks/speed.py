"""Speed of hierarchical CP against the best one-GPU kernel and PyTorch's native context
parallelism, on packed workloads: one table, one JSON file, optionally one plot.

Launch from the repository root, one process per GPU (ulysses A x ring R = the world size):
    torchrun --nproc-per-node 2 -m benchmarks.speed --ulysses 2 --ring 1
    torchrun --nproc-per-node 2 -m benchmarks.speed --ulysses 1 --ring 2 --workloads W2,W3 --heads gqa
    torchrun --nproc-per-node 1 -m benchmarks.speed --modes one-gpu-flex,one-gpu-flash
Per-rank memory of 2 ranks on a machine of one GPU (both on cuda:0, over gloo; no speeds):
    torchrun --nproc-per-node 2 -m benchmarks.speed --share-gpu --ulysses 2 --ring 1
One rank's work without its communication, on a machine of one GPU (rank 1 of ulysses 1 x ring 2):
    python -m benchmarks.speed --fake-rank 1 --ulysses 1 --ring 2 --heads gqa
Merge the JSON files of split runs into one table (efficiencies are recomputed over all rows):
    python -m benchmarks.speed --merge a.json b.json --out all.json --plot all.png
A stream (below): 60 steps of new W2 batches, 4 attention calls each, on one GPU; one rank of
ulysses 1 x ring 2 alone; the per-rank memory of ulysses 2 x ring 1 on one GPU:
    python -m benchmarks.speed --stream 60 --layers 4 --workloads W2-128K \
        --modes one-gpu-hcp,one-gpu-flash,one-gpu-flex --plot stream.png
    python -m benchmarks.speed --stream 60 --layers 4 --workloads W2-128K --heads gqa \
        --fake-rank 1 --ulysses 1 --ring 2 --modes one-gpu-hcp,hcp-eager,hcp-compiled
    torchrun --nproc-per-node 2 -m benchmarks.speed --stream 60 --layers 4 --workloads W2-128K \
        --share-gpu --ulysses 2 --ring 1 --modes hcp-eager,hcp-compiled
Every batch composition in one process (``--mixed``, below), one mode per process, then one table:
    for m in one-gpu-flash one-gpu-hcp one-gpu-flex; do python -m benchmarks.speed --mixed 200 --layers 4 \\
        --heads gqa --modes $m --out mixed_$m.json; done
    python -m benchmarks.speed --merge mixed_one-gpu-*.json --out mixed.json
Time and memory of one call as the tokens grow (``--scale``, below):
    python -m benchmarks.speed --scale 128K,256K,512K,1M --heads gqa
(one process needs no torchrun: plain python runs a world of one.)
CPU smoke test of the plumbing (gloo, 512-token batches, the torch kernel; under 2 minutes on
2 cores). Of the one-GPU modes only hcp's and dense SDPA run there (flash needs CUDA; torch's
flex has no CPU backward, its row records that error), so the efficiencies are against those:
    torchrun --nproc-per-node 2 -m benchmarks.speed --device cpu --ulysses 2 --ring 1 \\
        --shrink 256 --head-dim 16 --dtype float32 --heads mha --workloads W1-128K,W4-128K \\
        --out /tmp/speed_smoke.json

Every step is causal attention, forward + backward, head_dim 128, bf16, 32 query heads over 8
KV heads (``gqa``) or 32 (``mha``), on these packed batches (lengths seeded, the same on every
rank and in every run):
- W1-128K, W1-256K: one document of 128K / 256K tokens;
- W2-128K, W2-256K: document lengths log-uniform in 256..32K, 128K / 256K tokens in all;
- W3-128K, W3-256K: lengths log-uniform in 128..2K, 128K / 256K tokens;
- W4-128K, W4-256K: the W2 batches under a sliding window (left 4096, right 0);
- W2-512K, W2-1M, W4-1M: W2's lengths, 512K / 1M tokens, W4-1M under W4's window (1M: 131K per
  rank of 8, the ring-8 ceilings; only when named, and W2's in ``--scale``).

Modes (``--modes``; default all that apply):
- ``one-gpu-flex``: torch's ``flex_attention``, compiled, on the whole batch with a document +
  causal (+ window) block mask from ``create_block_mask``; ``enable_gqa`` for GQA.
- ``one-gpu-sdpa``: dense causal ``F.scaled_dot_product_attention`` on ``[1, H, T, D]``
  (torch's backend choice), on one-document workloads only (W1), where it is exact.
- ``one-gpu-hcp``: hcp's single-device ``varlen_attention`` (no context parallelism) on the
  whole batch, kernel as ``--kernel`` resolves it.
- ``one-gpu-flash``: ``aten._flash_attention_forward`` (torch's varlen flash, what hcp's flash
  kernel wraps) on the whole batch, KV heads unrepeated (flash handles GQA), autograd backward.
- ``hcp-eager``, ``hcp-compiled``: hcp_compile on this rank's shard for each placement
  (``--placements``), eagerly in ``context_parallel`` and with ``torch.compile(backend="hcp")``
  (Inductor on CUDA); the compiled modules are reused across workloads (dynamic shapes). The
  kernel column is the one ``--kernel`` (default auto) resolves to, as hcp resolves it (under a
  window, flash cannot run a ring step, so auto takes another kernel). ``--recompute-exchange
  on|both`` runs them with hcp's ``recompute_exchange`` option (too, with ``both``).
- ``torch-native-cp``: ``torch.distributed.tensor.experimental.context_parallel`` (SDPA ring,
  head-tail load balancing) over all ranks, on W1 with MHA only (it knows no documents and no GQA).
The one-GPU modes run on rank 0 while the other ranks wait at a barrier, so that they are
measured in the same run as the CP modes. The fastest of them is "best one GPU".

Columns: ms = median fwd+bwd of ``--iters`` after ``--warmup`` (for compiled modes the first
call, the compile, is the first warm-up; its seconds are first_call_s in the JSON); TF/s per GPU counts only visible pairs (causal,
inside the window), 7 products of 2·D FLOPs per pair and query head; eff = best one-GPU ms /
(GPUs x ms); peak GiB = what one more fwd+bwd call allocates at its peak beyond what was
allocated before it (``one_call_peak``: after the timed steps, with none of their outputs,
gradients or graphs alive, so the figure repeats from run to run). Not counted: the inputs q,
k, v and the output gradient (and flex's block mask, and what a kernel keeps from earlier
calls). Counted: the output, dq, dk, dv, what the forward saves and the kernel's workspace.
peak/1GPU = its ratio to the best one-GPU
mode's; saved GiB = the largest memory a rank's forward allocates and still holds when it returns
(the output and what the backward needs: what a model holds per layer until its backward), and
its ratio; exposed comm = in one profiled step of rank 0, the time some NCCL kernel runs while no
other kernel does, in ms and in % of the traced step (first kernel start to last kernel end). A
failing mode (compile error, OOM, unsupported) is a row with its error; the run goes on. The JSON
file is rewritten after every row, so a run cut short keeps what it measured. ``--trace DIR`` also
traces the host in the profiled step (of every mode, the one-GPU ones included), keeps each
rank's trace in DIR and prints the step's span, busy time and top kernels. ``--memory-peak``
records the CUDA allocator's history over that one call and prints, on
rank 0, the places holding most of its peak (``common.live_at_peak``). ``--share-gpu``
puts every rank on cuda:0 and runs the collectives over gloo (staged through the host): the
CP rows then keep their peak memory, which is the same allocations as on one GPU per rank,
and leave out their times (mesh ``AxR shared``); the one-GPU rows run alone and keep theirs.
``--fake-rank R`` runs one process alone as rank R of the ulysses x ring world over torch's fake
process group, whose collectives return at once and move no data: the CP rows (mesh ``AxR
rank R alone``) then time exactly that rank's kernels, layout copies and merges with no
communication and no waiting for the other ranks, so their efficiency is an upper bound on
what a real run of that mesh reaches (their outputs are not the attention: what the
collectives would have delivered is whatever memory the allocator hands out). Before each CP
mode the GPU's free memory is filled with normal samples, so that those buffers hold values
like real activations: zeros (fresh memory from the driver) would run the tensor cores
faster than real data does. The one-GPU rows run as usual.

Stream mode (``--stream N --layers L``): training is no batch repeated but a stream,
every step a batch of new document lengths through every layer. Step s draws its lengths from
the workload's distribution (W2, W4: log-uniform 256..32K; W3: 128..2K; as many tokens as the
workload) seeded (workload seed, s), the same on every rank and in every run (step 0 is the
batch above; W1's one document is the same batch every step). A step: ``cu_seqlens`` to the
device, then what a trainer builds per batch (hcp's CP modes: ``shard_plan``; one-gpu-flex: its
block mask, ``create_block_mask`` compiled), then L attention calls on it (the layers, each on
its own q, k and v), forward, then backward, then a synchronize; its time is the host clock
over all of it (the ranks of a CP mode start each step together; a step's time is its slowest
rank's). The layers' inputs are random buffers made before the stream and sliced per step (a
CP rank's are born sharded: it pays the plan, not a shard of every layer). Every mode's stream
starts from a clean slate: Dynamo's graphs and hcp's caches of earlier batches dropped (the
one-gpu-flex and hcp-compiled streams compile in their first steps, one module for the stream,
dynamic shapes; Inductor's caches on disk stay). Modes: the one-GPU ones (flex, flash, hcp, sdpa
on W1), hcp-eager and hcp-compiled, with ``--fake-rank`` (one rank's time) and ``--share-gpu``
(its memory, no times) as above; no torch-native-cp, no profile. The stream rows' columns (a
table of their own; fields of the JSON rows): total s = the stream's time; TF/s/GPU = all its
visible-pair FLOPs over that (``tflops_per_gpu``); steady TF/s/GPU = the same over the last half
of the steps, from step N // 2 on (``steady_tflops_per_gpu``); eff, steady eff = against the
best one-GPU stream (``efficiency``: by time, ``steady_efficiency``: by steady TF/s); one-time %
= the share of the time beyond what all steps would take at the steady rate, 1 - overall /
steady (``one_time_pct``): the compiles, graph builds and other first-time work, which have no
clock of their own, as the excess over steady (negative where noise makes the first half
faster); first step s (``first_step_s``: the compiles show here); prepare ms = the median per
step of ``cu_seqlens`` to the device plus the plan or mask, part of the step times
(``prepare_ms``); graphs = Dynamo graphs compiled during the stream, recompiles included
(``graphs``); peak GiB = over the stream beyond the layers' inputs and the one output gradient
(made before it): a step's outputs, saved tensors and gradients of every layer, and the kernel's
workspace; cumulative s by tenth of the steps = the time at the end of step ceil(N i / 10),
i = 1..10 (``cumulative_s``, the last the total). The JSON keeps every step's ms (``step_ms``)
and ``stream_steps``, ``stream_layers``; the plot draws each stream's cumulative time against the
step.
``--plan-ahead``: the CP modes take each step's prepared batch (``hcp_compile.prepare_batch``
for this rank) from one DataLoader worker process that runs two steps ahead, as a trainer's
loader can; taking it is part of the step (a worker that falls behind shows), ``shard_plan``
then adopts it (plan ahead = yes). ``--trace DIR``: after the stream, two more steps of new
batches, the second traced (host and GPU) into ``DIR/<workload>_<heads>_<mode>_<placement>
_u<A>r<R>_stream_rank<r>.json.gz``: traced step / busy / plan ms = its host-clock time, the
time some kernel runs in it, and the plan's part (``traced_step_ms``, ``traced_busy_ms``,
``traced_plan_ms``); step minus busy is the time the GPU waited for the host (no
communication in a one-GPU or fake-rank stream).

Mixed stream (``--mixed N``): one process through every batch composition. A stream
as above (``--layers``, the modes, ``--kernel``, ``--fake-rank``) of N steps whose batches come
from the ``--workloads`` (default the eight of W1..W4 at 128K and 256K) in rounds that hold each
workload once, every round in a random order (seeded: the same in every run), step s a new batch
of its workload (lengths seeded (workload seed, s)); ``torch._dynamo.reset()`` before every K-th
step (``--mixed-reset K``, default 25; 0: never), outside the steps' times, as a notebook, an
evaluation loop or another compiled model would: the next steps compile again. One row per mode,
workload ``mixed``, in the streams' table (its steady TF/s over the last half, resets included;
``step_workloads`` and ``mixed_reset`` in the JSON), and a table of its own: overall over steady
TF/s; the first step and its excess over one-gpu-flash's first in the same run; per workload
(``first_extra_s``), its first step after the stream's first minus its median step after the
stream's first. A mode's stream starts reset, but in the process that ran the modes before it:
for a first step that is the process's, run one mode per process and ``--merge`` the files. A
failing step ends the row with an error that names the step and its workload.

Scale table (``--scale SIZES``, such as 128K,256K,512K,1M; one process, one GPU): at each size W2's
lengths (log-uniform 256..32K, seed 0), and per mode (one-gpu-hcp with ``--kernel``,
one-gpu-flex, one-gpu-flash; ``--modes`` picks among them) one call fwd+bwd: after ``--warmup``
calls (at least one), peak GiB = the ``max_memory_allocated`` of one call beyond what is allocated
before it: q, k, v and dout (and what the kernel keeps from earlier calls); then ms = the median
of ``--iters`` calls; TF/s as above; out+grads GiB = out, dq, dk and dv from their shapes
(``outputs_gib``: as many bytes as q, k, v and dout); extra GiB = peak minus out+grads (saved
tensors, workspaces, temporaries: ``extra_gib``), extra/inputs = that over the bytes of q, k, v
and dout (``extra_vs_inputs``); ms per FLOP / smallest's = the row's ms per causal FLOP over that
of the smallest size of its heads and mode (``flop_time_vs_smallest``: 1 where time grows as the
causal FLOPs), peak per token / smallest's likewise (``token_peak_vs_smallest``: 1 where memory
grows as the tokens). An out-of-memory error is the row's error; the cache is emptied and the run
goes on.

The code, in the modules beside this one (this one: the command line): ``speed_workloads`` the
batches' lengths; ``speed_setup`` the options, device, ranks, a batch's tensors and the fake process
group; ``speed_modes`` each mode's call on one batch; ``speed_measure`` its timing, memory and
profiled step, and its row; ``speed_streams`` the streams; ``speed_run`` the loops over heads,
workloads and modes, and the scale table; ``speed_rows`` the rows and the figures that relate
them; ``speed_report`` the tables, the JSON file, ``--merge`` and ``--plot``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.speed_report import merge, metadata, progress, report, write_json
from benchmarks.speed_rows import MODES, ONE_GPU_MODES, Row, relate
from benchmarks.speed_run import run_benchmark
from benchmarks.speed_setup import Setup, init_fake
from benchmarks.speed_workloads import HEADS, ONLY_WHEN_NAMED, parse_size, workloads
from hcp_compile.exchange.schemes import DEFAULT_SCHEME, SCHEMES
from hcp_compile.kernels import KERNEL_CHOICES

SCALE_MODES = ("one-gpu-hcp", "one-gpu-flex", "one-gpu-flash")  # --scale: hcp against torch's two kernels
PLACEMENTS = ("balanced", "zigzag")


def parse_list(text: str, allowed: Sequence[str], option: str, parser: argparse.ArgumentParser) -> list[str]:
    """A comma-separated selection; a workload may be named by its family ("W2": both sizes)."""
    picked: list[str] = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        matches = [a for a in allowed if a == word or a.startswith(f"{word}-")]
        if not matches:
            parser.error(f"{option}: unknown {word!r}; expected some of {', '.join(allowed)}")
        picked += [m for m in matches if m not in picked]
    return picked


def build_parser() -> argparse.ArgumentParser:
    """The options as ``--help`` lists them; :func:`parse_args` checks their combinations."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--ulysses", type=int, help="default: the world size over --ring")
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--workloads", default=",".join(n for n in workloads() if n not in ONLY_WHEN_NAMED),
                        help="comma-separated names or families (W2)")
    parser.add_argument("--heads", default="gqa,mha", help="comma-separated: gqa (32/8), mha (32/32)")
    parser.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default: all that "
                                         "apply; one GPU: the one-GPU modes)")
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--kernel", default="auto", choices=KERNEL_CHOICES, help="hcp's attention kernel")
    parser.add_argument("--recompute-exchange", default="off", choices=("off", "on", "both"),
                        help="the hcp modes' recompute_exchange option; both: a row with each")
    parser.add_argument("--scheme", default=DEFAULT_SCHEME, choices=sorted(SCHEMES),
                        help="the hcp modes' collective scheme")
    parser.add_argument("--inner", help="the hcp backend's inner compiler (default: inductor on CUDA, "
                                        "aot_eager on CPU)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--stream", type=int, metavar="N",
                        help="instead of one batch repeated, a stream of N steps, every step a new batch of "
                             "the workload's distribution through --layers attention calls, fwd+bwd "
                             "(no --warmup, --iters, profile)")
    parser.add_argument("--layers", type=int, metavar="L",
                        help="with --stream: the attention calls (layers) per step, sharing its batch (default 1)")
    parser.add_argument("--mixed", type=int, metavar="N",
                        help="a stream of N steps in one process through the --workloads (default: W1..W4 at "
                             "128K and 256K) in a random order (seeded), each step a new batch, with --layers; "
                             "one row 'mixed' per mode")
    parser.add_argument("--mixed-reset", type=int, default=25, metavar="K",
                        help="with --mixed: torch._dynamo.reset() before every K-th step (0: never; default 25)")
    parser.add_argument("--scale", metavar="SIZES",
                        help="instead: one fwd+bwd call of each one-GPU mode (hcp, flex, flash) on W2 lengths at "
                             "each of these token counts (e.g. 128K,256K,512K,1M): time and peak memory beyond "
                             "q, k, v and dout (one process)")
    parser.add_argument("--plan-ahead", action="store_true",
                        help="with --stream: the CP modes take each step's prepared batch from a DataLoader "
                             "worker (hcp_compile.prepare_batch), as a trainer can, instead of planning it "
                             "on the step")
    parser.add_argument("--layout-window", choices=("on", "off"), default="off",
                        help="on: hcp's layout balances the work of the workload's sliding window "
                             "(shard_plan's window, what a trainer that knows its window passes); off: "
                             "plain causal work, the layout of the results in docs/benchmarks.md")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step (exposed comm)")
    parser.add_argument("--share-gpu", action="store_true",
                        help="every rank on cuda:0, collectives over gloo: the CP modes' per-rank peak "
                             "memory on a machine of one GPU, without their times (implies --no-profile)")
    parser.add_argument("--fake-rank", type=int, metavar="R",
                        help="run alone as rank R of the --ulysses x --ring world over torch's fake process "
                             "group (collectives move no data): the CP modes' work on that rank without "
                             "communication, an upper bound on their efficiency (one process, no torchrun)")
    parser.add_argument("--memory-peak", action="store_true",
                        help="record the CUDA allocator's history over each mode's peak-memory call and print "
                             "where its peak's memory lies")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="also trace the host in the profiled step, keep every rank's trace in DIR and "
                             "print where rank 0's step went")
    parser.add_argument("--shrink", type=int, default=1,
                        help="divide token counts, document lengths and the window by this (CPU smoke tests)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/speed_u{A}r{R}.json)")
    parser.add_argument("--plot", type=Path,
                        help="also plot the efficiencies (and the streams' cumulative times) into this PNG "
                             "(needs matplotlib)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="merge these results into --out (and --plot) instead of measuring")
    return parser


def parse_args() -> argparse.Namespace:
    """The options, checked against each other (a wrong combination ends the run with its
    reason) and completed: selections as lists, defaults that depend on other options."""
    parser = build_parser()
    args = parser.parse_args()
    if args.merge and args.out is None:
        parser.error("--merge needs --out")
    args.workloads = parse_list(args.workloads, list(workloads()), "--workloads", parser)
    args.heads = parse_list(args.heads, list(HEADS), "--heads", parser)
    args.placements = parse_list(args.placements, PLACEMENTS, "--placements", parser)
    if args.modes is not None:
        args.modes = parse_list(args.modes, MODES, "--modes", parser)
    if args.scale is not None:
        check_scale(args, parser)
    if args.mixed is not None:
        check_mixed(args, parser)
    check_stream(args, parser)
    args.inner = args.inner or ("inductor" if args.device == "cuda" else "aot_eager")
    args.recompute_exchange = {"off": [False], "on": [True], "both": [False, True]}[args.recompute_exchange]
    if args.memory_peak:
        if args.device != "cuda":
            parser.error("--memory-peak records the CUDA allocator: it needs --device cuda")
        if args.stream is not None or args.scale is not None:
            parser.error("--memory-peak records a mode's call on one batch: it takes no --stream, --mixed "
                         "or --scale")
    if args.share_gpu:
        if args.device != "cuda":
            parser.error("--share-gpu shares a GPU: it needs --device cuda")
        args.no_profile = True  # the exposed communication of ranks taking turns means nothing
    if args.fake_rank is not None:
        check_fake_rank(args, parser)
    return args


def check_scale(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--scale``: its sizes in K tokens, smallest first, into ``args.scale``; its modes (the
    one-GPU hcp, flex and flash); one process, no stream, no plot."""
    try:
        args.scale = sorted({parse_size(word.strip()) for word in args.scale.split(",") if word.strip()})
    except ValueError as error:
        parser.error(f"--scale: {error}")
    if not args.scale:
        parser.error("--scale: expected some token counts, such as 128K,256K,512K,1M")
    if args.stream is not None or args.mixed is not None:
        parser.error("--scale measures one call per size: it takes no --stream or --mixed")
    if args.fake_rank is not None or args.share_gpu or int(os.environ.get("WORLD_SIZE", 1)) > 1:
        parser.error("--scale runs on one GPU: launch one process, without --fake-rank or --share-gpu")
    if args.plot is not None:
        parser.error("--scale: its table has no plot; leave out --plot")
    wrong = [m for m in args.modes or () if m not in SCALE_MODES]
    if wrong:
        parser.error(f"--scale: {', '.join(wrong)} cannot run; expected some of {', '.join(SCALE_MODES)}")
    args.modes = args.modes or list(SCALE_MODES)
    args.no_profile = True


def check_mixed(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--mixed N``: enough steps for every workload twice; then a stream of N steps, which
    takes the stream's options and checks."""
    if args.stream is not None:
        parser.error("--mixed N is a stream of N steps: it takes no --stream")
    if args.mixed < 2 * len(args.workloads):
        parser.error(f"--mixed {args.mixed}: expected at least 2 steps per workload (the first and a later "
                     f"one of each), {2 * len(args.workloads)} for {len(args.workloads)} workloads")
    if args.mixed_reset < 0:
        parser.error(f"--mixed-reset {args.mixed_reset}: expected 0 (never) or more")
    args.stream = args.mixed


def check_stream(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The options only a stream takes (``--layers``, ``--plan-ahead``), and a stream's: at
    least 2 steps, ``--layers`` 1 by default, no torch-native-cp, no profiled step."""
    if args.stream is None and args.layers is not None:
        parser.error("--layers counts the attention calls of a stream's step: it needs --stream")
    if args.stream is None and args.plan_ahead:
        parser.error("--plan-ahead prepares a stream's batches: it needs --stream")
    if args.stream is None:
        return
    if args.stream < 2:
        parser.error(f"--stream {args.stream}: expected at least 2 steps (the last half is the steady part)")
    args.layers = 1 if args.layers is None else args.layers
    if args.layers < 1:
        parser.error(f"--layers {args.layers}: expected at least 1")
    if args.modes is not None and "torch-native-cp" in args.modes:
        parser.error("--stream: torch-native-cp has no stream (its one document is the same batch every "
                     "step); leave it out")
    args.no_profile = True


def check_fake_rank(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--fake-rank R``: one process alone, a rank of the ``--ulysses`` x ``--ring`` mesh, no
    torch-native-cp; the profiled step only for ``--trace`` (no communication to find)."""
    if args.share_gpu:
        parser.error("--fake-rank runs one process: it takes no --share-gpu")
    if args.ulysses is None:
        parser.error("--fake-rank needs --ulysses (and --ring): there is no world to divide")
    if not 0 <= args.fake_rank < args.ulysses * args.ring:
        parser.error(f"--fake-rank {args.fake_rank}: expected a rank of the {args.ulysses} x {args.ring} "
                     f"mesh, 0..{args.ulysses * args.ring - 1}")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        parser.error("--fake-rank runs one process alone: launch it with python (or torchrun "
                     "--nproc-per-node 1), not several processes")
    if args.modes is not None and "torch-native-cp" in args.modes:
        parser.error("--fake-rank: torch-native-cp cannot run over a fake process group; leave it out")
    args.no_profile = args.no_profile or args.trace is None  # no communication to find exposed


def main() -> None:
    """Measure (or ``--merge``), then print the table and write the JSON file (and the plot)."""
    args = parse_args()
    if args.merge:
        runs, rows = merge(args.merge)
        report(rows, runs, args)
        return
    cuda = args.device == "cuda"
    local_rank = 0 if args.share_gpu else int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    fake = args.fake_rank is not None
    if fake:
        init_fake(args.fake_rank, args.ulysses * args.ring)
    else:
        # plain NCCL: with a mixed cpu/cuda group Inductor cannot tell the collectives' device and
        # estimates them as free, which leaves its overlap scheduling nothing to hide (NCCL refuses
        # two ranks on one GPU: --share-gpu takes gloo)
        backend = "nccl" if cuda and not args.share_gpu else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:  # plain python: a world of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    args.ulysses = args.ulysses or world // args.ring
    if args.ulysses * args.ring != world:
        raise SystemExit(f"--ulysses {args.ulysses} x --ring {args.ring} must equal the world size {world}")
    if args.modes is None:
        args.modes = [m for m in (ONE_GPU_MODES if world == 1 else MODES)
                      if not ((fake or args.stream) and m == "torch-native-cp")]
    run = "_scale" if args.scale else f"_mixed{args.stream}x{args.layers}" if args.mixed else (
        f"_stream{args.stream}x{args.layers}" if args.stream else "")
    suffix = run + (f"_rank{args.fake_rank}_alone" if fake else "")
    args.out = args.out or Path(f"benchmarks/results/speed_u{args.ulysses}r{args.ring}{suffix}.json")
    setup = Setup(args, device, getattr(torch, args.dtype), dist.get_rank(), world, fake)
    runs = [metadata(setup)]
    rows: list[Row] = []
    by_name = workloads(args.shrink)

    def on_row(row: Row) -> None:
        if not setup.leads:
            return
        rows.append(row)
        relate(rows)
        write_json(args.out, runs, rows)  # after every row: a run cut short keeps its rows
        setup.say(progress(row))

    alone = f"rank {setup.rank} of " if fake else ""
    setup.say(f"{alone}{world} x {runs[0]['device']}, torch {torch.__version__}, mesh ulysses "
              f"{args.ulysses} x ring {args.ring}, modes {args.modes}")
    run_benchmark(setup, [by_name[n] for n in args.workloads], on_row)
    if setup.leads:
        report(rows, runs, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
