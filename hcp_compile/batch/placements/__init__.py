"""Placement rules: which documents of a batch stay whole on one rank, which are spread over a
Ulysses group and which go round the ring (docs/design.md §2). A rule is one function
``(lengths, ulysses, ring, *, window) -> layout.Assignment`` of tensor ops (``window``: the keys
back of the sliding window whose work the layout balances, -1 for none; see
``layout.PlacementRule``); a new rule is one new file registered here."""

from __future__ import annotations

from hcp_compile.batch.layout import PlacementRule
from hcp_compile.batch.placements.balanced import balanced
from hcp_compile.batch.placements.zigzag import zigzag
from hcp_compile.validation import InputError

PLACEMENTS: dict[str, PlacementRule] = {"balanced": balanced, "zigzag": zigzag}
DEFAULT_PLACEMENT = "balanced"
NO_WINDOW = (-1, -1)  # a layout for plain causal attention


def check_placement(name: str) -> str:
    if name not in PLACEMENTS:
        raise InputError(
            f"placement: expected one of {tuple(PLACEMENTS)}, got {name!r}"
        )
    return name


def placement_rule(name: str) -> PlacementRule:
    return PLACEMENTS[check_placement(name)]


def check_layout_window(window: tuple[int, int], argument: str = "window") -> tuple[int, int]:
    """The window a layout balances for, as it names the layout: ``(left, 0)``, or ``(-1, -1)``
    for none. The layout weighs causal attention, where a row sees at most ``left`` keys back
    and none ahead (``causal`` caps ``right`` at 0), so ``right`` changes nothing and is
    dropped: windows that lay a batch out alike are one layout."""
    if (
        not isinstance(window, (tuple, list)) or len(window) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
    ):
        raise InputError(
            f"{argument}: expected (left, right) ints >= -1 as varlen_attention's window_size "
            f"(-1 = unlimited; (-1, -1): no window), got {window!r}"
        )
    return NO_WINDOW if window[0] < 0 else (int(window[0]), 0)
