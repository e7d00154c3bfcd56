"""hcp_compile: hierarchical context parallelism (Ulysses all-to-all over heads, then a zigzag
ring across groups) for packed variable-length (THD) attention."""

from hcp_compile.batch.cache import clear_batch_cache
from hcp_compile.batch.packing import cu_seqlens_from_position_ids
from hcp_compile.batch.prepared import PreparedBatch, prepare_batch
from hcp_compile.compiled.backend import BackendOptions, backend
from hcp_compile.context import CPOptions, context_parallel
from hcp_compile.exchange.agreement import AgreementTimeout
from hcp_compile.exchange.mesh import make_mesh
from hcp_compile.explain import Explanation, explain
from hcp_compile.hf import register_when_imported as _register_with_transformers
from hcp_compile.marking import AttentionMark, attention
from hcp_compile.ops import varlen_attention
from hcp_compile.plan import ShardPlan, shard_plan
from hcp_compile.validation import InputError

_register_with_transformers()  # attn_implementation="hcp", without importing transformers

__all__ = [
    "AgreementTimeout",
    "AttentionMark",
    "BackendOptions",
    "Explanation",
    "attention",
    "backend",
    "clear_batch_cache",
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
