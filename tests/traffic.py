"""Count what the collectives of a forward and backward actually send, per process group,
by watching the functional collective ops as they run (eager, or an ``aot_eager`` graph)."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default


class CollectiveTraffic(TorchDispatchMode):
    """Elements each all-to-all sends to other ranks, summed per group name."""

    def __init__(self):
        super().__init__()
        self.sent: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is ALL_TO_ALL:
            _, _output_splits, input_splits, group_name = args[:4]
            own = dist.get_rank(_group(group_name))
            self.sent[group_name] += sum(input_splits) - input_splits[own]
        return func(*args, **(kwargs or {}))


def _group(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)
