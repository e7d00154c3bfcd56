"""Collective schemes (docs/extending.md "A collective scheme"): one file per scheme, one line
in :data:`SCHEMES`. The ``scheme`` option of ``context_parallel`` and of the ``hcp`` backend, and
``scheme=`` of ``assemble_schedule``, name one of them."""

from __future__ import annotations

from hcp_compile.exchange.schemes.allgather import AllGatherKV
from hcp_compile.exchange.schemes.protocol import CollectiveScheme, GroupShape, GroupTraffic, HeadExchange, KVRing, Traffic
from hcp_compile.exchange.schemes.ring import ZigzagRing
from hcp_compile.exchange.schemes.ulysses import AllToAllHeads
from hcp_compile.validation import InputError

SCHEMES: dict[str, CollectiveScheme] = {
    "ring": CollectiveScheme("ring", AllToAllHeads(), ZigzagRing()),
    "allgather": CollectiveScheme("allgather", AllToAllHeads(), AllGatherKV()),
}
DEFAULT_SCHEME = "ring"


def check_scheme(name: str) -> str:
    """``name`` if it names a scheme of :data:`SCHEMES`, else :class:`InputError`."""
    if not isinstance(name, str) or name not in SCHEMES:
        raise InputError(f"scheme: expected one of {sorted(SCHEMES)}, got {name!r}")
    return name


def scheme_named(name: str) -> CollectiveScheme:
    return SCHEMES[check_scheme(name)]


__all__ = [
    "DEFAULT_SCHEME", "SCHEMES", "CollectiveScheme", "GroupShape", "GroupTraffic", "HeadExchange",
    "KVRing", "Traffic", "check_scheme", "scheme_named",
]
