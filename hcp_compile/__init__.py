"""hcp_compile: hierarchical context parallelism (Ulysses all-to-all over heads, then a zigzag
ring across groups) for packed variable-length (THD) attention."""

from .backend import BackendOptions, backend
from .context import CPOptions, context_parallel
from .explain import Explanation, explain
from .marking import AttentionMark, attention
from .mesh import AgreementTimeout, make_mesh
from .ops import varlen_attention
from .packing import cu_seqlens_from_position_ids
from .plan import ShardPlan, shard_plan
from .prepared import PreparedBatch, prepare_batch
from .validation import InputError
from .hf import register_when_imported as _register_with_transformers

_register_with_transformers()  # attn_implementation="hcp", without importing transformers

__all__ = [
    "AgreementTimeout",
    "AttentionMark",
    "BackendOptions",
    "Explanation",
    "attention",
    "backend",
    "explain",
    "CPOptions",
    "InputError",
    "PreparedBatch",
    "ShardPlan",
    "context_parallel",
    "cu_seqlens_from_position_ids",
    "make_mesh",
    "prepare_batch",
    "shard_plan",
    "varlen_attention",
]
