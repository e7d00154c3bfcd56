"""The advice as a table and the reasons the best option wins."""

from __future__ import annotations

from tabulate import tabulate

from .host_measured import HOW_TO_ADD
from .records import Advice, Prediction, TIE


def format_table(advice: Advice) -> str:
    rows = [[
        f"{p.ulysses} x {p.ring}", p.placement, p.head_groups, p.ring_link,
        f"{p.step_s * 1e3:.2f}", f"{p.compute_s * 1e3:.2f}",
        f"{p.host_s * 1e3:.2f}" if advice.host_modelled else "-",
        f"{(p.compute_s / p.mean_compute_s - 1) * 100:.1f}" if p.mean_compute_s else "0.0",
        f"{p.exposed_all_to_all_s * 1e3:.2f}", f"{p.exposed_ring_s * 1e3:.2f}",
        f"{p.exposed_s / p.step_s * 100:.1f}" if p.step_s else "0.0",
        f"{p.all_to_all_bytes / 2**20:.1f}", f"{p.ring_bytes / 2**20:.1f}",
    ] for p in advice.predictions]
    headers = ["ulysses x ring", "placement", "head groups", "ring link", "step ms",
               "compute ms", "host ms", "over mean %", "exposed a2a ms", "exposed ring ms", "exposed %",
               "a2a MiB", "ring MiB"]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def reasons(advice: Advice) -> list[str]:
    """Why the best option wins: against the runner-up, and against the best option of every
    other mesh, the part (compute of the slowest rank, exposed all-to-all, exposed ring) that
    makes most of the difference."""
    best = advice.best
    lines = [f"best: ulysses {best.ulysses} x ring {best.ring}, placement {best.placement!r}: "
             f"{best.step_s * 1e3:.2f} ms per call per rank, {best.exposed_s * 1e3:.2f} ms of it "
             f"exposed communication"]
    rivals: list[Prediction] = []
    for p in advice.predictions[1:]:
        if p is advice.predictions[1] or all((p.ulysses, p.ring) != (q.ulysses, q.ring) for q in rivals + [best]):
            rivals.append(p)
    close = [p for p in advice.predictions[1:] if p.step_s <= best.step_s * (1 + TIE)]
    if close:
        names = ", ".join(f"{p.ulysses} x {p.ring} {p.placement!r}" for p in close)
        lines.append(f"within {TIE:.0%} of the best (a tie at the model's accuracy): {names}")
    for p in rivals:
        parts = {
            "compute of its slowest rank": p.compute_s - best.compute_s,
            "exposed all-to-all": p.exposed_all_to_all_s - best.exposed_all_to_all_s,
            "exposed ring": p.exposed_ring_s - best.exposed_ring_s,
            "waiting for its host": p.host_wait_s - best.host_wait_s,
        }
        part = max(parts, key=parts.__getitem__)
        lines.append(
            f"vs ulysses {p.ulysses} x ring {p.ring} {p.placement!r}: {p.step_s * 1e3:.2f} ms "
            f"(+{(p.step_s / best.step_s - 1) * 100 if best.step_s else 0:.1f} %), mostly "
            f"{part} (+{parts[part] * 1e3:.2f} ms)"
        )
    return lines


def host_note(advice: Advice) -> str:
    """Whether the steps include the host part, and where its constants come from."""
    if advice.host_modelled:
        return (f"host part: {advice.mode} host times measured on {advice.device_kind} "
                "(hcp_advise/host_measured.json); a phase lasts the longer of its host and GPU time")
    return (f"host part not modelled: no {advice.mode} host times for kernel {advice.kernel!r} on "
            f"{advice.device_kind} in hcp_advise/host_measured.json ({HOW_TO_ADD}); ranks whose compute "
            "is a few ms per call are host-bound, so read their steps as floors")


def format_advice(advice: Advice) -> str:
    return "\n".join([
        format_table(advice), "",
        *reasons(advice), host_note(advice), "",
        f"kernel {advice.kernel!r} at its {advice.device_kind} measurements, {advice.batches} "
        f"batch(es), advised in {advice.seconds:.2f} s; use make_mesh(ulysses="
        f"{advice.best.ulysses}, ring={advice.best.ring}) and placement={advice.best.placement!r}",
    ])
