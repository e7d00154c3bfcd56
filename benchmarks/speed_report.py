"""The output of benchmarks.speed: its tables, its JSON file (written, read, merged), its plot,
the run's metadata and the line each measured row prints."""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
from dataclasses import asdict, fields
from pathlib import Path

import torch
from tabulate import tabulate

from benchmarks.speed_rows import MODES, ONE_GPU_MODES, Row, relate, significant, work_key
from benchmarks.speed_setup import Setup
from benchmarks.speed_workloads import HEADS


def ordered(rows: list[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: (r.workload, list(HEADS).index(r.heads), r.stream_steps or 0,
                                       r.stream_layers or 0, MODES.index(r.mode), r.placement, r.mesh,
                                       r.recompute_exchange))


def table(rows: list[Row]) -> str:
    """The rows of one batch repeated, then the streams' rows, the mixed streams' figures per
    workload and the scale rows (a table each, where there are)."""
    rows = ordered(rows)
    repeated = [r for r in rows if not r.stream_steps and not r.scale]
    streams, scaled = [r for r in rows if r.stream_steps], [r for r in rows if r.scale]
    tables = []
    if repeated or not (streams or scaled):
        headers = ["workload", "heads", "mode", "placement", "recompute", "scheme", "kernel", "mesh", "ms",
                   "TF/s/GPU", "eff", "peak GiB", "peak/1GPU", "saved GiB", "saved/1GPU", "exposed ms", "exposed %",
                   "error"]
        body = [[r.workload, r.heads, r.mode, r.placement, "yes" if r.recompute_exchange else "",
                 _scheme(r).strip(), r.kernel, r.mesh, r.ms, r.tflops_per_gpu,
                 r.efficiency, r.peak_gib, r.peak_vs_one_gpu, r.saved_gib, r.saved_vs_one_gpu,
                 r.exposed_comm_ms, r.exposed_comm_pct,
                 (r.error or "")[:60]] for r in repeated]
        tables.append(tabulate(body, headers=headers, missingval="-"))
    if streams:
        headers = ["workload", "heads", "steps x layers", "mode", "placement", "recompute", "kernel", "mesh",
                   "total s", "TF/s/GPU", "steady TF/s/GPU", "eff", "steady eff", "one-time %", "first step s",
                   "prepare ms", "plan ahead", "traced step / busy / plan ms", "graphs", "peak GiB", "peak/1GPU",
                   "cumulative s by tenth of the steps", "error"]
        body = [[r.workload, r.heads, _steps_label(r), r.mode, r.placement,
                 "yes" if r.recompute_exchange else "", r.kernel, r.mesh, r.stream_s, r.tflops_per_gpu,
                 r.steady_tflops_per_gpu, r.efficiency, r.steady_efficiency, r.one_time_pct, r.first_step_s,
                 r.prepare_ms, "yes" if r.plan_ahead else "",
                 f"{r.traced_step_ms} / {r.traced_busy_ms} / {r.traced_plan_ms}" if r.traced_step_ms else None,
                 r.graphs, r.peak_gib, r.peak_vs_one_gpu,
                 " ".join(f"{c:.3g}" for c in r.cumulative_s) if r.cumulative_s else None,
                 (r.error or "")[:60]] for r in streams]
        tables.append(tabulate(body, headers=headers, missingval="-"))
    mixed = [r for r in streams if r.first_extra_s]
    if mixed:
        tables.append(mixed_table(mixed, streams))
    if scaled:
        tables.append(scale_table(scaled))
    return "\n\n".join(tables)


def _steps_label(row: Row) -> str:
    reset = f", reset every {row.mixed_reset}" if row.mixed_reset else ""
    return f"{row.stream_steps}x{row.stream_layers}{reset}"


def mixed_table(mixed: list[Row], streams: list[Row]) -> str:
    """The mixed streams' targets: overall over steady TF/s, the first step against flash's
    first in the same stream (of ``streams``), and per workload its first step after the
    stream's first beyond its median."""
    flash_first = {work_key(r): r.first_step_s for r in streams if r.mode == "one-gpu-flash" and r.first_step_s}
    names = list(dict.fromkeys(name for r in mixed for name in r.first_extra_s))
    headers = ["heads", "steps x layers", "mode", "kernel", "overall/steady", "first step s",
               "first - flash's first s", *names]
    body = [[r.heads, _steps_label(r), r.mode, r.kernel, round(r.tflops_per_gpu / r.steady_tflops_per_gpu, 3),
             r.first_step_s,
             significant(r.first_step_s - flash_first[work_key(r)]) if work_key(r) in flash_first else None,
             *(r.first_extra_s.get(name) for name in names)] for r in mixed]
    caption = "mixed streams; per workload: its first step after the stream's first minus its median step, s"
    return f"{caption}\n{tabulate(body, headers=headers, missingval='-')}"


def scale_table(scaled: list[Row]) -> str:
    """The scale rows by heads, mode and size: time, TF/s, the peak beyond q, k, v and dout split
    into the outputs and gradients and the rest, and the ratios to the smallest size."""
    scaled = sorted(scaled, key=lambda r: (list(HEADS).index(r.heads), MODES.index(r.mode), r.outputs_gib))
    headers = ["workload", "heads", "mode", "kernel", "ms", "TF/s", "ms per FLOP / smallest's", "peak GiB",
               "out+grads GiB", "extra GiB", "extra/inputs", "peak per token / smallest's", "error"]
    body = [[r.workload, r.heads, r.mode, r.kernel, r.ms, r.tflops_per_gpu, r.flop_time_vs_smallest, r.peak_gib,
             r.outputs_gib, r.extra_gib, r.extra_vs_inputs, r.token_peak_vs_smallest, (r.error or "")[:60]]
            for r in scaled]
    caption = "one call fwd+bwd, one GPU; peak beyond q, k, v and dout"
    return f"{caption}\n{tabulate(body, headers=headers, missingval='-')}"


def write_json(path: Path, runs: list[dict], rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"runs": runs, "rows": [asdict(r) for r in ordered(rows)]}
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")  # default: the Path options


def read_json(path: Path) -> tuple[list[dict], list[Row]]:
    data = json.loads(path.read_text())
    names = {f.name for f in fields(Row)}
    return data["runs"], [Row(**{k: v for k, v in r.items() if k in names}) for r in data["rows"]]


def merge(paths: list[Path]) -> tuple[list[dict], list[Row]]:
    """The runs and rows of several JSON files; a row measured again (same workload, heads,
    mode, placement and mesh) is taken from the later file."""
    runs, by_key = [], {}
    for path in paths:
        file_runs, rows = read_json(path)
        runs += file_runs
        by_key.update({r.key(): r for r in rows})
    rows = list(by_key.values())
    relate(rows)
    return runs, rows


def plot(rows: list[Row], path: Path) -> None:
    """The rows of one batch repeated: efficiency against the best one GPU, one group of bars
    per (workload, heads), one bar per mode (with placement and mesh). Below, for every stream
    (workload, heads, steps x layers): each mode's cumulative time against the step, labelled
    with its steady TF/s per GPU and one-time share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ordered(rows)
    repeated = [r for r in rows if not r.stream_steps and not r.scale]  # the scale table has no plot
    streams = list(dict.fromkeys(work_key(r) for r in rows if r.stream_steps))
    groups = list(dict.fromkeys((r.workload, r.heads) for r in repeated))
    series = list(dict.fromkeys(_label(r) for r in repeated))
    wide = max(8.0, 0.25 * len(groups) * len(series))
    fig, axes = plt.subplots(bool(repeated) + len(streams), 1, squeeze=False,
                             figsize=(wide, 4.5 * bool(repeated) + 4.0 * len(streams)))
    fig.subplots_adjust(hspace=0.45)
    axes = list(axes[:, 0])
    if repeated:
        _efficiency_bars(axes.pop(0), repeated, groups, series)
    colors = {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys(_label(r) for r in rows if r.stream_steps))}
    for ax, group in zip(axes, streams):
        workload, heads, steps, layers, reset, _ = group
        for row in rows:
            if work_key(row) == group and row.step_ms:
                cumulative = list(itertools.accumulate((ms / 1e3 for ms in row.step_ms), initial=0.0))
                ax.plot(range(len(cumulative)), cumulative, color=colors[_label(row)],
                        label=f"{_label(row)}: steady {row.steady_tflops_per_gpu} TF/s/GPU, "
                              f"one-time {row.one_time_pct} %")
        reset = f", Dynamo reset every {reset} steps" if reset else ""
        ax.set_title(f"{workload} {heads}: a stream of {steps} batches x {layers} layers{reset}", fontsize="medium")
        ax.set_xlabel("steps done")
        ax.set_ylabel("cumulative s")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")


def _efficiency_bars(ax, rows: list[Row], groups: list[tuple[str, str]], series: list[str]) -> None:
    efficiency = {(r.workload, r.heads, _label(r)): r.efficiency for r in rows}
    width = 0.8 / len(series)
    for i, label in enumerate(series):
        values = [efficiency.get((*g, label)) or 0.0 for g in groups]  # failed or not run: no bar
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width,
               label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{w}\n{h}" for w, h in groups])
    ax.set_ylabel("efficiency vs best one GPU")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _label(row: Row) -> str:
    if row.mode in ONE_GPU_MODES:
        return row.mode
    placement = "" if row.mode == "torch-native-cp" else f" {row.placement}"
    return f"{row.mode}{placement} {row.mesh}" + " recompute" * row.recompute_exchange + _scheme(row)


def metadata(setup: Setup) -> dict:
    """The run's entry of the JSON file's ``runs``: when, on what, with which options."""
    cuda = setup.device.type == "cuda"
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "devices": setup.world,
        "fake_rank": setup.rank if setup.fake else None,
        "options": {k: v for k, v in vars(setup.args).items() if k != "merge"},
    }


def report(rows: list[Row], runs: list[dict], args: argparse.Namespace) -> None:
    """The table on stdout, the JSON file at ``--out`` and the plot at ``--plot``."""
    print(table(rows), flush=True)
    write_json(args.out, runs, rows)
    print(f"wrote {args.out}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


def progress(row: Row) -> str:
    """The line printed as ``row`` is measured: its error, or the figures of its kind (one batch
    repeated, a stream, a scale row)."""
    if row.error:
        result = row.error[:200]
    elif row.scale:
        result = (f"{row.ms} ms, {row.tflops_per_gpu} TF/s, peak {row.peak_gib} GiB beyond q, k, v, dout: "
                  f"out+grads {row.outputs_gib}, extra {row.extra_gib} ({row.extra_vs_inputs} x the inputs)")
    elif row.stream_steps:
        result = (f"{row.stream_s} s, {row.tflops_per_gpu} TF/s per GPU, steady {row.steady_tflops_per_gpu}, "
                  f"efficiency {row.efficiency} (steady {row.steady_efficiency}), one-time {row.one_time_pct} %, "
                  f"first step {row.first_step_s} s, prepare {row.prepare_ms} ms per step, {row.graphs} graphs, "
                  f"peak {row.peak_gib} GiB"
                  + (f", first step after the stream's first beyond its median, s: {row.first_extra_s}"
                     if row.first_extra_s else ""))
    else:
        result = (f"{row.ms} ms, {row.tflops_per_gpu} TF/s per GPU, efficiency {row.efficiency}, "
                  f"peak {row.peak_gib} GiB, saved {row.saved_gib} GiB, exposed comm {row.exposed_comm_ms} ms"
                  + (f", first call {row.first_call_s} s" if row.first_call_s is not None else ""))
    return f"  {row.mode} {row.placement}{' recompute' * row.recompute_exchange}{_scheme(row)} ({row.kernel}): {result}"


def _scheme(row: Row) -> str:
    return "" if row.scheme == "ring" else f" {row.scheme}"
