"""Count what the collectives of a forward and backward actually send, per process group,
by watching the functional collective ops as they run (eager, or an ``aot_eager`` graph)."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


class CollectiveTraffic(TorchDispatchMode):
    """Per group name: ``sent``, the elements each all-to-all or all-gather sends to other
    ranks; ``bytes``, the same in bytes; ``calls``, how many such collectives were issued."""

    def __init__(self):
        super().__init__()
        self.sent: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is ALL_TO_ALL:
            flat, _output_splits, input_splits, group_name = args[:4]
            own = dist.get_rank(_group(group_name))
            self._count(group_name, flat, sum(input_splits) - input_splits[own])
        elif func is ALL_GATHER:
            flat, size, group_name = args[:3]
            self._count(group_name, flat, flat.numel() * (size - 1))  # to every other rank
        return func(*args, **(kwargs or {}))

    def _count(self, group_name: str, flat: torch.Tensor, elements: int) -> None:
        self.sent[group_name] += elements
        self.bytes[group_name] += elements * flat.element_size()
        self.calls[group_name] += 1


def _group(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)
