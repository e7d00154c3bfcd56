"""The two exchanges of hierarchical CP, written with functional collectives so the same code
runs eagerly and under tracing (each collective appears in the graph with its wait).

The ``_c10d_functional`` ops are called directly rather than through
``torch.distributed._functional_collectives``, whose wrappers wait right after issuing when
traced: here every wait sits where its result is first needed, in the eager run and in the
graph alike. The Ulysses exchanges return an :class:`Issued` handle, so the caller decides
what runs between issue and wait (the head-group pipeline, docs/design.md §3.6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor


Result = TypeVar("Result")


@dataclass(frozen=True)
class Issued(Generic[Result]):
    """An exchange issued and not yet waited for. ``wait()`` waits and returns the result: the
    code run between the issue and the wait is what the transfer overlaps, eagerly (the
    collective runs on the backend's stream or thread) and in a traced graph (the collective
    and its ``wait_tensor`` are two nodes, in this order). Without a collective (a Ulysses
    group of one) the result is ready at once."""

    pending: Tensor
    finish: Callable[[Tensor], Result]
    collective: bool = True

    def wait(self) -> Result:
        return self.finish(_wait(self.pending) if self.collective else self.pending)


def scatter_heads(
    tensors: list[Tensor], group: dist.ProcessGroup, size: int, counts: tuple[int, ...],
    part: int = 0, parts: int = 1, after: Tensor | None = None,
) -> Issued[Tensor]:
    """Issue the Ulysses exchange of head group ``part`` of ``parts`` in one all-to-all:
    ``[T_i, H_i, D]`` with all heads, ``T_i`` this rank's entry of ``counts`` (the token count
    of every rank of the group) -> ``[sum(counts), sum(H_i) / (size * parts), D]``, this rank's
    heads of the group (of every tensor, in order) over the tokens of every rank of the group
    in rank order, one contiguous tensor. Rank ``j`` handles heads ``j * H_i / size`` onwards
    of each tensor, and group ``part`` the ``part``-th ``1/parts`` of those (docs/design.md
    §3.6). The send buffer is packed with one strided copy per tensor; ``after`` (one element)
    is written into the buffer's storage first, just past the part that is sent: the copies
    then depend on it (which a compiler's partitioner sees, docs/design.md §4.1)."""
    tokens, dim = tensors[0].shape[0], tensors[0].shape[2]
    widths = [t.shape[1] // (size * parts) for t in tensors]
    width = sum(widths)
    if size == 1 and parts == 1 and len(tensors) == 1:
        return Issued(tensors[0], _same, collective=False)
    # block j of dim 0 holds the heads of this group that go to Ulysses rank j
    send = _pack([
        t.reshape(tokens, size, parts, w, dim)[:, :, part].transpose(0, 1)
        for t, w in zip(tensors, widths)
    ], after)
    stream = (sum(counts), width, dim)
    if size == 1:
        return Issued(send.view(stream), _same, collective=False)
    splits = ([c * width * dim for c in counts], [tokens * width * dim] * size)
    received = _all_to_all(send.view(-1), splits, group)
    # the blocks from Ulysses ranks 0..size-1, concatenated, are the exchange stream
    return Issued(received, lambda done: done.view(stream))


def gather_heads(
    x: Tensor, group: dist.ProcessGroup, size: int, counts: tuple[int, ...], rank: int,
) -> Issued[Tensor]:
    """Issue the inverse of :func:`scatter_heads` for ``x`` ``[sum(counts), w, D]``, a head
    group of this rank over the exchange stream: the result is ``[counts[rank], size, w, D]``,
    every Ulysses rank's slice of that group for this rank's tokens (a view of the received
    buffer, rank ``j``'s slice at index ``j``; :func:`join_heads` puts the groups in order). A
    contiguous ``x`` travels as it is, with no packing copy."""
    width, dim = x.shape[1], x.shape[2]
    tokens = counts[rank]
    if size == 1:
        return Issued(x.unsqueeze(1), _same, collective=False)
    splits = ([tokens * width * dim] * size, [c * width * dim for c in counts])
    received = _all_to_all(x.contiguous().view(-1), splits, group)
    return Issued(received, lambda done: done.view(size, tokens, width, dim).transpose(0, 1))


def join_heads(gathered: list[Tensor], repeat: int = 1) -> Tensor:
    """The head groups ``gathered`` (each ``[T, size, w, D]``, from :func:`gather_heads`, in
    group order) as one ``[T, size * len(gathered) * w / repeat, D]`` tensor in the heads'
    order, one copy. With ``repeat`` > 1 the exchange carried every head ``repeat`` times
    (one head per rank, a single group): the copies are summed (the gradient of the repeat)."""
    tokens, size, width, dim = gathered[0].shape
    if repeat > 1:
        if len(gathered) != 1 or width != 1:
            raise ValueError("repeated heads are exchanged one per rank, in a single group")
        return gathered[0].squeeze(2).unflatten(1, (-1, repeat)).sum(2)
    heads = size * len(gathered) * width
    if len(gathered) == 1:
        return gathered[0].reshape(tokens, heads, dim)
    # reshape, not view: Inductor's decompositions may give the stack other strides, and a view
    # of a tensor with the layout's unbacked sizes then fails to trace
    return torch.stack(gathered, dim=2).reshape(tokens, heads, dim)


def _same(x: Tensor) -> Tensor:
    return x


def _pack(blocks: list[Tensor], after: Tensor | None = None) -> Tensor:
    """Concatenate ``[size, tokens, w_i, D]`` views along dim 2 into one new contiguous
    buffer, one strided copy each (faster than ``torch.cat`` of strided inputs on GPU)."""
    size, tokens, _, dim = blocks[0].shape
    shape = (size, tokens, sum(b.shape[2] for b in blocks), dim)
    if after is None:
        buffer = blocks[0].new_empty(shape)
    else:
        # ``after`` goes one element past the buffer's end, where its slice is 1 long whatever
        # the sizes: a slice of the buffer itself is as long as a data-dependent size allows,
        # and torch 2.11 cannot compile the copy into it (it guards on that size being 1)
        numel = size * tokens * shape[2] * dim
        flat = blocks[0].new_empty(numel + 1)
        flat[numel:].copy_(after)
        buffer = flat[:numel].view(shape)
    offset = 0
    for block in blocks:
        buffer[:, :, offset : offset + block.shape[2]].copy_(block)
        offset += block.shape[2]
    return buffer


def _staged_on_host(x: Tensor, group: dist.ProcessGroup) -> bool:
    """Whether an all-gather of ``x`` over ``group`` goes through the host: gloo's all-gather
    of CUDA tensors crashes the process (torch 2.11, ranks sharing one GPU), while its
    all-to-all and all-reduce stage them fine."""
    return x.device.type == "cuda" and dist.get_backend(group) == "gloo"


def gather_tokens(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-gather along dim 0 in group-rank order (waited); over gloo a CUDA tensor goes
    through the host (:func:`_staged_on_host`)."""
    staged = _staged_on_host(x, group)
    gathered = funcol.wait_tensor(_all_gather((x.cpu() if staged else x).contiguous(), 0, group))
    return gathered.to(x.device) if staged else gathered


# all_gather_tensor is deprecated from torch 2.12 on; 2.11 has only that name
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def ring_shift(x: Tensor, group: dist.ProcessGroup, rank: int, size: int, by: int = 1) -> Tensor:
    """Send ``x`` to ring rank ``rank + by`` and receive the same shape from ``rank - by``
    (every rank shifts by the same ``by``, not a multiple of ``size``).

    Returns the flat received tensor, not yet waited for: read it through :func:`arrived`.
    An all-to-all with one non-zero split is the point-to-point transfer that both torch 2.11
    and later support as a functional collective; it is correct only for 1-D tensors.
    """
    flat = x.reshape(-1)
    splits = [0] * size
    splits[(rank + by) % size] = flat.numel()
    received = [0] * size
    received[(rank - by) % size] = flat.numel()
    return _all_to_all(flat, (received, splits), group)


def gather_sections(flat: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """Issue an all-gather of a 1-D tensor over the ring group: the result, ``[size *
    flat.numel()]`` in ring-rank order, is not yet waited for (read it through
    :func:`arrived`). Over gloo a CUDA tensor goes through the host (:func:`_staged_on_host`):
    the result is then on the CPU, for the caller to move back."""
    staged = flat.cpu() if _staged_on_host(flat, group) else flat
    return torch.ops._c10d_functional.all_gather_into_tensor(staged, size, group.group_name)


def send_pieces(flat: Tensor, piece: int | torch.SymInt, group: dist.ProcessGroup, rank: int,
                size: int) -> Tensor:
    """Issue an all-to-all of equal pieces: ``flat`` holds one piece of ``piece`` elements for
    every other rank of the group, in rank order (none for this rank); the result, not yet
    waited for (read it through :func:`arrived`), holds every other rank's piece for this one,
    in rank order."""
    splits = [0 if j == rank else piece for j in range(size)]
    return _all_to_all(flat, (splits, list(splits)), group)


def arrived(x: Tensor, shape: torch.Size) -> Tensor:
    """Wait for a transfer issued here (:func:`ring_shift`, :func:`gather_sections`,
    :func:`send_pieces`) and view it as ``shape``."""
    return _wait(x).view(shape)


def _all_to_all(flat: Tensor, splits: tuple[list[int], list[int]], group: dist.ProcessGroup) -> Tensor:
    """Issue an all-to-all of a 1-D tensor (``splits``: output and input split sizes); the
    result must go through :func:`_wait` before it is read."""
    return torch.ops._c10d_functional.all_to_all_single(flat, *splits, group.group_name)


def _wait(x: Tensor) -> Tensor:
    return torch.ops._c10d_functional.wait_tensor(x)
