"""Placement rules: which documents of a batch stay whole on one rank, which are spread over a
Ulysses group and which go round the ring (docs/design.md §2). A rule is one function
``(lengths, ulysses, ring) -> layout.Assignment`` of tensor ops; a new rule is one new file
registered here."""

from __future__ import annotations

from hcp_compile.batch.layout import PlacementRule
from hcp_compile.batch.placements.balanced import balanced
from hcp_compile.batch.placements.zigzag import zigzag
from hcp_compile.validation import InputError

PLACEMENTS: dict[str, PlacementRule] = {"balanced": balanced, "zigzag": zigzag}
DEFAULT_PLACEMENT = "balanced"


def check_placement(name: str) -> str:
    if name not in PLACEMENTS:
        raise InputError(
            f"placement: expected one of {tuple(PLACEMENTS)}, got {name!r}"
        )
    return name


def placement_rule(name: str) -> PlacementRule:
    return PLACEMENTS[check_placement(name)]
