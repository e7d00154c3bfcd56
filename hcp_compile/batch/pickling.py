"""Pickling an object whose tensors travel as one buffer.

A :class:`prepared.PreparedBatch` holds a few dozen CPU tensors (the layout, a rank's tokens and
schedule tables). A DataLoader moves each tensor of what a worker returns through its own
shared-memory segment, and opening dozens of them costs the training process milliseconds on
the step (docs/design.md §2.4).
Here the tensors are copied into one byte buffer and the rest pickled with references to it, so a
batch crosses as one tensor and a few KiB of bytes, and its tensors come back as views.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch import Tensor

# every tensor starts at a multiple of this, so that a view of the buffer can take its dtype
_ALIGNMENT = 16


class _Packer(pickle.Pickler):
    """Pickles everything but tensors, which it collects (pickle's persistent ids)."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Tensor] = []
        self._index: dict[int, int] = {}  # id -> place: a tensor held twice comes back as one

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, Tensor):
            return None
        if id(obj) not in self._index:
            self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return self._index[id(obj)]


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[Tensor]):
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: int) -> Tensor:
        return self.tensors[pid]


def pack(obj: Any) -> tuple[Tensor, bytes]:
    """``obj`` as ``(buffer, data)``: its CPU tensors' bytes in one uint8 ``buffer``, and the
    pickle of the rest with where each tensor lies in it. :func:`unpack` reverses it."""
    file = io.BytesIO()
    packer = _Packer(file)
    packer.dump(obj)
    pieces, places, offset = [], [], 0
    for tensor in packer.tensors:
        if tensor.device.type != "cpu":
            raise ValueError(f"pack: only CPU tensors travel in the buffer, got one on {tensor.device}")
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        padding = -offset % _ALIGNMENT
        if padding:
            pieces.append(torch.zeros(padding, dtype=torch.uint8))
            offset += padding
        places.append((offset, raw.numel(), tensor.dtype, tuple(tensor.shape)))
        pieces.append(raw)
        offset += raw.numel()
    buffer = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    return buffer, pickle.dumps((places, file.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)


def unpack(buffer: Tensor, data: bytes) -> Any:
    """The object :func:`pack` turned into ``(buffer, data)``; its tensors are views of ``buffer``."""
    places, payload = pickle.loads(data)
    tensors = [buffer[offset:offset + size].view(dtype).view(shape) for offset, size, dtype, shape in places]
    return _Unpacker(io.BytesIO(payload), tensors).load()
