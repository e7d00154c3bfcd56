"""``@hcp_compile.attention``: mark the attention modules whose varlen attention the ``hcp``
backend rewrites.

A marked class carries its options as a class attribute; a marked instance gets a subclass of
its own class made for it (the way ``fully_shard`` marks modules), so the mark shows up in the
module types Dynamo records in each node's ``nn_module_stack``.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, fields
from typing import TypeVar, overload

from torch import nn

from hcp_compile.kernels import KERNEL_CHOICES
from hcp_compile.validation import InputError

_ATTRIBUTE = "_hcp_attention_mark"

ModuleT = TypeVar("ModuleT", bound=nn.Module)


@dataclass(frozen=True)
class AttentionMark:
    """Per-module options; ``None`` fields take the backend's option."""

    kernel: str | None = None

    def __post_init__(self) -> None:
        if self.kernel is not None and self.kernel not in KERNEL_CHOICES:
            raise InputError(
                f"hcp_compile.attention(kernel=...): expected one of {KERNEL_CHOICES} or None, "
                f"got {self.kernel!r}"
            )


# every class marked in this process, for the rewrite pass's cache key
_MARKED_CLASSES: "weakref.WeakKeyDictionary[type, AttentionMark]" = weakref.WeakKeyDictionary()


@overload
def attention(target: ModuleT, **options) -> ModuleT: ...
@overload
def attention(target: type[ModuleT], **options) -> type[ModuleT]: ...
@overload
def attention(target: None = None, **options): ...


def attention(target=None, **options):
    """Mark an attention module class or instance for the ``hcp`` backend.

    Usable as ``@hcp_compile.attention``, ``@hcp_compile.attention(kernel="torch")`` on a
    class, or ``hcp_compile.attention(module, kernel=...)`` on an instance (returned). Once
    any module is marked, the backend rewrites only the attention calls inside marked modules.
    Options: the fields of :class:`AttentionMark`.
    """
    mark = AttentionMark(**options)
    if target is None:
        return lambda t: _apply(t, mark)
    return _apply(target, mark)


def _apply(target, mark: AttentionMark):
    if isinstance(target, type) and issubclass(target, nn.Module):
        setattr(target, _ATTRIBUTE, mark)
        _MARKED_CLASSES[target] = mark
        return target
    if isinstance(target, nn.Module):
        cls = type(target)
        marked = type(cls.__name__, (cls,), {_ATTRIBUTE: mark, "__module__": cls.__module__})
        marked.__qualname__ = cls.__qualname__
        _MARKED_CLASSES[marked] = mark
        target.__class__ = marked
        return target
    raise TypeError(
        "hcp_compile.attention: expected an nn.Module subclass or instance, got "
        f"{type(target).__name__}"
    )


def mark_of(module_type: type) -> AttentionMark | None:
    return getattr(module_type, _ATTRIBUTE, None)


def marks_digest() -> str:
    """A digest of every mark made in this process (the rewrite depends on them)."""
    entries = sorted(
        f"{cls.__module__}.{cls.__qualname__}:"
        + ",".join(f"{f.name}={getattr(mark, f.name)!r}" for f in fields(mark))
        for cls, mark in list(_MARKED_CLASSES.items())
    )
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()
