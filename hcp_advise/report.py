"""The advice as a table, the options the model cannot tell from the best (a tie within its measured
error) and the reasons the best wins over the others."""

from __future__ import annotations

import textwrap

from tabulate import tabulate

from .host_measured import HOW_TO_ADD
from .records import Advice, Prediction, STORED_MEASUREMENTS


def tied(advice: Advice) -> tuple[Prediction, ...]:
    """The options after the best whose predicted step is within the model's measured error of
    the best's (``advice.model_error``): the model cannot rank them against it. A prefix of the
    predictions, which are sorted by their step."""
    limit = advice.best.step_s * (1 + advice.model_error)
    return tuple(p for p in advice.predictions[1:] if p.step_s < limit)


def _slower(p: Prediction, best: Prediction) -> str:
    return f"+{(p.step_s / best.step_s - 1) * 100 if best.step_s else 0:.1f} %"


# the width the default report keeps to: its table and every line of prose
WIDTH = 100


def format_table(advice: Advice, verbose: bool = False) -> str:
    """One row per option, fastest first: the split, the placement, the step and how it compares
    with the best's, and its exposed communication; ``verbose``: every part of the prediction
    (:data:`VERBOSE_LEGEND`)."""
    ties = tied(advice)

    def versus_best(p: Prediction) -> str:
        if p is advice.best:
            return "best"
        return _slower(p, advice.best) + (" tie" if any(p is q for q in ties) else "")

    def exposed_share(p: Prediction) -> str:
        return f"{p.exposed_s / p.step_s * 100:.0f} %" if p.step_s else "0 %"

    if not verbose:
        rows = [[f"{p.ulysses} x {p.ring}", p.placement, f"{p.step_s * 1e3:.2f}", versus_best(p),
                 f"{p.exposed_s * 1e3:.2f} ({exposed_share(p)})", f"{p.efficiency:.3f}", f"{p.balance:.3f}"]
                for p in advice.predictions]
        headers = ["split", "placement", "ms per call", "vs best", "exposed ms", "efficiency", "balance"]
        return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)
    rows = [[
        f"{p.ulysses} x {p.ring}", p.placement, p.kernel, p.head_groups, p.ring_link,
        f"{p.step_s * 1e3:.2f}", versus_best(p), f"{p.compute_s * 1e3:.2f}", f"{p.passes_s * 1e3:.2f}",
        f"{p.host_s * 1e3:.2f}" if advice.host_modelled else "-",
        f"{(p.compute_s / p.mean_compute_s - 1) * 100:.1f}" if p.mean_compute_s else "0.0",
        f"{p.exposed_all_to_all_s * 1e3:.2f}", f"{p.exposed_ring_s * 1e3:.2f}", exposed_share(p),
        f"{p.all_to_all_bytes / 2**20:.1f}", f"{p.ring_bytes / 2**20:.1f}", f"{p.efficiency:.3f}",
        f"{p.balance:.3f}",
    ] for p in advice.predictions]
    headers = ["split", "placement", "kernel", "head groups", "ring link", "ms per call", "vs best",
               "compute ms", "other GPU ms", "host ms", "compute vs mean %", "exposed all-to-all ms",
               "exposed ring ms", "exposed", "all-to-all MiB", "ring MiB", "efficiency", "balance"]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


EFFICIENCY_LEGEND = (
    "efficiency: one GPU's predicted time for the whole batch (one call, at the same kernel "
    "times) over N x ms per call; balance: a rank's tokens, pads included, over the mean real "
    "tokens per rank (its memory against an even share of the batch)"
)
DEFAULT_LEGEND = (
    "split: make_mesh(ulysses=, ring=); ms per call: the predicted forward and backward of one "
    "attention call on its slowest rank; exposed ms: the part of it spent waiting for the "
    "all-to-all or the ring, not hidden behind compute (its share of the call); "
    f"{EFFICIENCY_LEGEND} (--verbose: every part)"
)
VERBOSE_LEGEND = (
    "Per option, the slowest rank's: kernel (what kernel='auto' takes on the mesh); head groups "
    "(2 where two halves of its KV heads pipeline their exchanges); ring link (nvlink, network, - for no "
    "ring); compute ms (its attention kernels); other GPU ms (merges, fp32 sums and copies besides "
    "attention); host ms (the time its host takes to issue the call, - where not modelled); compute "
    "vs mean % (its compute against the mean rank's: above 0 it has more work than the mean, below 0 "
    "it is the slowest for its communication, not its work); exposed all-to-all and ring ms (what "
    "waits for each); exposed (both as a share of the step); all-to-all and ring MiB (the bytes it "
    f"sends per call, forward and backward together); {EFFICIENCY_LEGEND}"
)


def left_out_lines(advice: Advice) -> list[str]:
    """A line per split of the world that was not predicted, with why."""
    return [f"left out {a} x {r}: {why}" for a, r, why in advice.left_out]


def reasons(advice: Advice) -> list[str]:
    """Which options tie with the best (:func:`tied`), and why the best wins over the others:
    against the first option beyond the tie, and against the best option of every other mesh,
    the part (compute of the slowest rank, its passes besides attention, exposed all-to-all,
    exposed ring, waiting for the host) that makes most of the difference."""
    best = advice.best
    lines = [f"best: ulysses {best.ulysses} x ring {best.ring}, placement {best.placement!r}: "
             f"{best.step_s * 1e3:.2f} ms per call per rank, {best.exposed_s * 1e3:.2f} ms of it "
             f"exposed communication"]
    ties = tied(advice)
    if ties:
        names = ", ".join(f"{p.ulysses} x {p.ring} {p.placement!r} ({_slower(p, best)})" for p in ties)
        lines.append(f"tie within the model's ±{advice.model_error * 100:.1f} % error (the median error of its check "
                     f"against ranks measured alone on an NVIDIA H200, docs/benchmarks.md \"Advisor check\"): "
                     f"{names}; the model cannot rank these, measure them where the choice matters")
    rivals: list[Prediction] = []
    for p in advice.predictions[1 + len(ties):]:
        if not rivals or all((p.ulysses, p.ring) != (q.ulysses, q.ring) for q in [best, *ties, *rivals]):
            rivals.append(p)
    for p in rivals:
        parts = {
            "compute of its slowest rank": p.compute_s - best.compute_s,
            "its GPU's passes besides attention (merges, copies)": p.passes_s - best.passes_s,
            "exposed all-to-all": p.exposed_all_to_all_s - best.exposed_all_to_all_s,
            "exposed ring": p.exposed_ring_s - best.exposed_ring_s,
            "waiting for its host": p.host_wait_s - best.host_wait_s,
        }
        part = max(parts, key=parts.__getitem__)
        lines.append(
            f"vs ulysses {p.ulysses} x ring {p.ring} {p.placement!r}: {p.step_s * 1e3:.2f} ms "
            f"({_slower(p, best)}), mostly {part} (+{parts[part] * 1e3:.2f} ms)"
        )
    return lines


def host_note(advice: Advice) -> str:
    """Whether the steps include the host part, and where its constants come from."""
    if advice.host_modelled:
        return (f"host part: {advice.mode} host times measured on {advice.device_kind} "
                "(hcp_advise/host_measured.json); the GPU waits for the host to issue each phase's "
                "first kernel, and a phase ends no sooner than its host has issued its last")
    kernels = "/".join(sorted({p.kernel for p in advice.predictions}))
    return (f"host part not modelled: no {advice.mode} host times for kernel {kernels!r} on "
            f"{advice.device_kind} in hcp_advise/host_measured.json ({HOW_TO_ADD}); ranks whose compute "
            "is a few ms per call are host-bound, so read their steps as floors")


def one_gpu_note(advice: Advice) -> list[str]:
    """A line where one GPU's call of a batch lies outside the call sizes measured for its kernel
    and composition: the model prices it at the nearest measured call's rate, which no GPU ran,
    so the efficiencies rest on that."""
    outside = [c for c in advice.one_gpu if not c.within_measured]
    if not outside:
        return []
    largest = max(outside, key=lambda c: c.flops)
    measured = ("no call sizes recorded" if largest.measured_flops is None else
                "{:.3g} to {:.3g} TFLOP".format(*(f / 1e12 for f in largest.measured_flops)))
    return [f"efficiency: one GPU's call of the whole batch ({len(outside)} of {len(advice.one_gpu)} "
            f"batch(es); {largest.flops / 1e12:,.1f} TFLOP of {largest.composition} with {largest.kernel}) "
            f"lies outside the calls measured for it ({measured}): priced at the nearest measured "
            "call's rate, an extrapolation"]


def format_advice(advice: Advice, verbose: bool = False) -> str:
    """The report: the table (``verbose``: with every part of the prediction), what it leaves out,
    why the best wins, and the mesh to make; its prose wrapped to :data:`WIDTH` characters."""
    best = advice.best
    use = (f"use make_mesh(ulysses={best.ulysses}, ring={best.ring}) and placement={best.placement!r}"
           + (" (or an option tied with it)" if tied(advice) else ""))
    if advice.measurements != STORED_MEASUREMENTS:  # the runtime's "auto" does not read them
        use += (f", with kernel={advice.kernel!r}: the runtime's kernel='auto' chooses by "
                f"{STORED_MEASUREMENTS}, not by these measurements")
    prose = [
        VERBOSE_LEGEND if verbose else DEFAULT_LEGEND, *left_out_lines(advice), "",
        *reasons(advice), host_note(advice), *one_gpu_note(advice), "",
        f"kernels at their {advice.device_kind} measurements ({advice.measurements}), "
        f"{advice.batches} batch(es), advised in {advice.seconds:.2f} s; {use}",
    ]
    return "\n".join([format_table(advice, verbose), *map(wrapped, prose)])


def wrapped(line: str) -> str:
    """``line`` in lines of at most :data:`WIDTH` characters, the later ones indented."""
    return textwrap.fill(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)
