"""Input checks with errors that name the argument, what was expected and how to fix it.

All of them run before any collective (docs/design.md §9: no hangs)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary


class InputError(ValueError):
    """Bad input to hcp_compile: the message names the argument and the fix."""


def check_cu_seqlens(cu_seqlens: Tensor, name: str = "cu_seqlens") -> Tensor:
    """Validate a cumulative-lengths tensor; return its values as a CPU int64 tensor."""
    check_cu_seqlens_dtype(cu_seqlens, name)
    values = host_copy(cu_seqlens)
    if values[0] != 0:
        raise InputError(f"{name}: must start at 0, got {int(values[0])}; prepend a 0")
    decreasing = (values[1:] < values[:-1]).nonzero()
    if decreasing.numel():
        i = int(decreasing[0]) + 1
        raise InputError(
            f"{name}: must be non-decreasing (cumulative document lengths), but entry {i} "
            f"({int(values[i])}) < entry {i - 1} ({int(values[i - 1])})"
        )
    return values


def check_cu_seqlens_dtype(cu_seqlens: Tensor, name: str) -> None:
    """What can be checked of ``cu_seqlens`` without reading its values (also at compile
    time): a 1-D int32 tensor with at least two entries."""
    if not isinstance(cu_seqlens, Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise InputError(
            f"{name}: expected dtype torch.int32 (as varlen attention kernels take), got "
            f"{cu_seqlens.dtype}; convert with {name}.to(torch.int32)"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise InputError(
            f"{name}: expected a 1-D tensor [num_docs + 1] with at least 2 entries, got shape "
            f"{tuple(cu_seqlens.shape)}"
        )


_HOST_COPIES = WeakIdKeyDictionary()  # tensor -> (version, host copy)


def host_copy(cu_seqlens: Tensor) -> Tensor:
    """CPU int64 copy of ``cu_seqlens``, read from the device once per tensor version (every
    layer of a model passes the same tensor, so only the first one waits for the device)."""
    cached = _HOST_COPIES.get(cu_seqlens)
    if cached is not None and cached[0] == cu_seqlens._version:
        return cached[1]
    values = cu_seqlens.detach().to("cpu", torch.int64)
    _HOST_COPIES[cu_seqlens] = (cu_seqlens._version, values)
    return values


def check_token_count(cu_values: Tensor, num_tokens: int, name: str, tensor_name: str) -> None:
    if int(cu_values[-1]) != num_tokens:
        raise InputError(
            f"{name}: last entry is {int(cu_values[-1])} but {tensor_name} has {num_tokens} "
            "tokens; the last entry must equal the number of packed tokens"
        )


def max_length(cu_values: Tensor) -> int:
    return int((cu_values[1:] - cu_values[:-1]).max())


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise InputError(f"{name}: expected a tensor of shape [tokens, heads, head_dim], got {shape}")
    if k.shape != v.shape:
        raise InputError(f"k, v: expected equal shapes, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise InputError(f"q, k: head_dim differs ({q.shape[2]} vs {k.shape[2]})")
    if len({q.dtype, k.dtype, v.dtype}) != 1 or len({q.device, k.device, v.device}) != 1:
        raise InputError(
            f"q, k, v: expected one dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
            f"{q.device}/{k.device}/{v.device}"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise InputError(
            f"q, k: query heads ({q.shape[1]}) must be a multiple of key/value heads "
            f"({k.shape[1]}) for grouped-query attention"
        )


def check_window(window_size: tuple[int, int]) -> tuple[int, int]:
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and w >= -1 for w in window_size)
    ):
        raise InputError(
            f"window_size: expected (left, right) ints >= -1 (-1 = unlimited), got {window_size!r}"
        )
    return int(window_size[0]), int(window_size[1])


def check_max_seqlen(max_seqlen: int, cu_values: Tensor, name: str) -> None:
    longest = max_length(cu_values)
    if not isinstance(max_seqlen, int) or max_seqlen < longest:
        raise InputError(
            f"{name}: got {max_seqlen!r} but the longest document in cu_seqlens has {longest} "
            f"tokens; pass the longest document length (or larger)"
        )


def check_head_split(heads_q: int, heads_kv: int, ulysses: int) -> None:
    """The Ulysses exchange splits the query heads evenly and splits (or repeats) KV heads."""
    if heads_q % ulysses:
        raise InputError(
            f"q: {heads_q} query heads cannot be split over ulysses={ulysses} ranks; choose a "
            "mesh whose ulysses size divides the number of query heads"
        )
    if heads_kv % ulysses and ulysses % heads_kv:
        raise InputError(
            f"k: {heads_kv} key/value heads must divide or be divisible by ulysses={ulysses}; "
            "choose another ulysses size"
        )


def check_kernel_window(kernel: str, window: tuple[int, int], fix: str) -> None:
    """The flash kernel's masks are local to a block, so it cannot window a ring step."""
    if kernel == "flash" and window != (-1, -1):
        raise InputError(
            "window_size: the flash kernel cannot apply a sliding window under context "
            f"parallelism; {fix}"
        )


_FINGERPRINT_MODULUS = 2**31 - 1


def batch_fingerprint(cu_seqlens: Tensor, salt: int = 0) -> Tensor:
    """A 0-d int64 hash of ``cu_seqlens`` (and ``salt``), the same on any device and traceable:
    ranks compare it to find out whether they were given the same batch."""
    values = cu_seqlens.to(torch.int64) % _FINGERPRINT_MODULUS
    index = torch.arange(values.numel(), device=values.device)
    # small constants: a compiled graph may compute this in 32-bit kernel code
    weights = (index * 40503 + 97) % _FINGERPRINT_MODULUS
    digest = ((values * weights) % _FINGERPRINT_MODULUS).sum() % _FINGERPRINT_MODULUS
    return digest + (values.numel() * 8 + salt) * _FINGERPRINT_MODULUS
