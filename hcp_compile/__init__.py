"""hcp_compile: hierarchical context parallelism (Ulysses all-to-all over heads, then a zigzag
ring across groups) for packed variable-length (THD) attention."""

from .backend import BackendOptions, backend
from .context import CPOptions, context_parallel
from .explain import Explanation, explain
from .marking import AttentionMark, attention
from .mesh import make_mesh
from .ops import varlen_attention
from .plan import ShardPlan, shard_plan
from .validation import InputError

__all__ = [
    "AttentionMark",
    "BackendOptions",
    "Explanation",
    "attention",
    "backend",
    "explain",
    "CPOptions",
    "InputError",
    "ShardPlan",
    "context_parallel",
    "make_mesh",
    "shard_plan",
    "varlen_attention",
]
