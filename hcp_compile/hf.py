"""Hugging Face transformers: ``attn_implementation="hcp"``.

Models whose attention goes through transformers' attention registry (Llama, Qwen2/3, Mistral,
...) run ``hcp_compile.varlen_attention`` over the packed documents that transformers' packed
keywords describe (``cu_seq_lens_q/k``, ``max_length_q/k``, as
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` returns them): single-device,
inside ``context_parallel(mesh)`` on this rank's shard, or rewritten by the ``hcp`` backend.

Under context parallelism a causal LM's own loss would shift the labels inside this rank's
shard, where a token's next label may sit on another rank: transformers' causal-LM losses are
wrapped so that, under CP (inside ``context_parallel``, or traced for the ``hcp`` backend over
more than one rank), labels without ``shift_labels`` raise :class:`InputError`; with
``shift_labels`` (shifted on the whole packed row, then sharded) the loss is the right one.

Importing transformers takes seconds, so hcp_compile never imports it: the attention function,
the mask function and the loss guard are registered when transformers' registries are imported
(right away if they already are).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any, Callable

import torch
from torch import Tensor, nn

from hcp_compile.context import active_context
from hcp_compile.ops import varlen_attention
from hcp_compile.validation import InputError

ATTN_IMPLEMENTATION = "hcp"
_PACKED_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_PACKING_FIX = (
    "pack the batch into one row and pass its document boundaries as cu_seq_lens_q, "
    "cu_seq_lens_k, max_length_q, max_length_k (DataCollatorWithFlattening("
    "return_flash_attn_kwargs=True) returns them; under context_parallel pass the global ones "
    "and position_ids=plan.position_ids[None])"
)


def attention_forward(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
    attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    sliding_window: int | None = None, softcap: float | None = None,
    is_causal: bool | None = None, s_aux: Tensor | None = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: ``query [1, Hq, T, D]``, ``key``/``value``
    ``[1, Hkv, T, D]`` -> ``(attn_output [1, T, Hq, D], None)``, the documents given by
    ``kwargs``' packed keywords. Anything it cannot compute exactly raises ``InputError``."""
    _refuse_unsupported(module, attention_mask, dropout, softcap, s_aux, kwargs)
    q, k, v = _autocast_dtype(
        *(_to_thd(t, name) for t, name in ((query, "query"), (key, "key"), (value, "value")))
    )
    if k.shape[0] != q.shape[0]:
        raise InputError(
            f"key: has {k.shape[0]} tokens but query has {q.shape[0]}; attn_implementation="
            "'hcp' attends within the packed batch only (no KV cache): pass use_cache=False"
        )
    cu_q, cu_k, max_q, max_k = _packed_boundaries(kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = varlen_attention(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=scaling,
        window_size=_window_size(sliding_window, causal, max_k),
    )
    return out.unsqueeze(0), None


def mask_function(*args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """transformers' mask-function contract: no dense mask is built (the documents come from
    ``cu_seq_lens``). A given padding mask is handed on, for ``attention_forward`` to refuse:
    without a registered mask function transformers would drop it silently."""
    return attention_mask


def _refuse_unsupported(
    module: nn.Module, attention_mask: Tensor | None, dropout: float, softcap: float | None,
    s_aux: Tensor | None, kwargs: dict[str, Any],
) -> None:
    if attention_mask is not None:
        raise InputError(
            "attention_mask: attn_implementation='hcp' takes the documents from cu_seq_lens_q/k "
            "and applies no mask (padding or custom); pass attention_mask=None and "
            + _PACKING_FIX
        )
    if dropout > 0 and module.training:
        raise InputError(
            f"dropout: attn_implementation='hcp' has no attention dropout, got {dropout}; set "
            "the model's config.attention_dropout = 0.0"
        )
    if softcap is not None:
        raise InputError(
            f"softcap: attn_implementation='hcp' has no logit soft-capping, got {softcap}; use "
            "a model without attention soft-capping or another attn_implementation"
        )
    if s_aux is not None:
        raise InputError(
            "s_aux: attn_implementation='hcp' has no attention sinks; use a model without "
            "them or another attn_implementation"
        )
    if kwargs.get("output_attentions"):
        raise InputError(
            "output_attentions: attn_implementation='hcp' computes no attention weights; pass "
            "output_attentions=False (or use attn_implementation='eager' to inspect them)"
        )


def _to_thd(x: Tensor, name: str) -> Tensor:
    """transformers' ``[batch=1, heads, tokens, head_dim]`` -> THD ``[tokens, heads, head_dim]``."""
    if x.dim() != 4 or x.shape[0] != 1:
        raise InputError(
            f"{name}: expected [batch=1, heads, tokens, head_dim] (one packed row), got shape "
            f"{tuple(x.shape)}; " + _PACKING_FIX
        )
    return x[0].transpose(0, 1)


def _autocast_dtype(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Under autocast, q, k and v in its dtype, as autocast gives them to SDPA: rotary
    embeddings computed in float32 leave q and k in float32 and v in the autocast dtype."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)


def _packed_boundaries(kwargs: dict[str, Any]) -> tuple[Tensor, Tensor, int, int]:
    missing = [name for name in _PACKED_KEYWORDS if kwargs.get(name) is None]
    if missing:
        raise InputError(
            f"{', '.join(missing)}: attn_implementation='hcp' needs the packed documents' "
            f"boundaries, got none; {_PACKING_FIX}"
        )
    for name in ("max_length_q", "max_length_k"):
        if not isinstance(kwargs[name], (int, torch.SymInt)):
            raise InputError(
                f"{name}: expected a Python int (the longest document's length), got "
                f"{type(kwargs[name]).__name__}; pass int({name})"
            )
    return tuple(kwargs[name] for name in _PACKED_KEYWORDS)


def layout_window(config: Any) -> tuple[int, int]:
    """The window a batch's layout balances the work for (``shard_plan(..., window=...)``): the
    model's sliding window where every attention layer applies it (``config.sliding_window``,
    and every entry of ``config.layer_types`` ``"sliding_attention"`` where the config lists
    them), as :func:`_window_size` passes it; none where a layer attends to every earlier key,
    whose work a layout for the window would balance worse. Only the balance depends on it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not isinstance(window, int) or window < 1:
        return (-1, -1)
    if layer_types is not None and any(kind != "sliding_attention" for kind in layer_types):
        return (-1, -1)
    return (window - 1, 0)


def _window_size(sliding_window: int | None, causal: bool, max_length_k: int) -> tuple[int, int]:
    """transformers' ``sliding_window`` w counts the query itself: a query sees the w keys up
    to and including it, ``window_size=(w - 1, 0)`` (``(w - 1, w - 1)`` when not causal), as
    its masks and flash attention apply it."""
    # no document is longer than the window, so it masks nothing; leaving it off keeps the
    # flash kernel usable under context parallelism (it cannot apply a window there)
    if sliding_window is None or max_length_k <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


# --------------------------------------------------------------------------------------------
# the causal-LM loss under context parallelism
# --------------------------------------------------------------------------------------------

_LABELS_FIX = (
    "labels: under context parallelism the model's loss would shift the labels inside this "
    "rank's shard, where a token's next label may sit on another rank; shift them on the whole "
    "packed row first and pass shift_labels=plan.shard(shifted, pad_value=-100)[None] with "
    "labels (hcp_compile.trainer does), or compute the loss outside the model from its logits"
)


def guard_causal_lm_loss(loss: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``loss`` (transformers' ``ForCausalLMLoss``, which shifts ``labels`` unless given
    ``shift_labels``), refusing under CP the labels it would shift itself."""
    # ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels,
    # **kwargs): shift_labels read by position or name, plainly, for Dynamo to trace
    @functools.wraps(loss)
    def causal_lm_loss(logits: Tensor, labels: Tensor | None = None, *args: Any, **kwargs: Any) -> Tensor:
        shift_labels = args[3] if len(args) > 3 else kwargs.get("shift_labels")
        if labels is not None and shift_labels is None:
            _refuse_under_context_parallelism()
        return loss(logits, labels, *args, **kwargs)

    causal_lm_loss.hcp_guarded = loss
    return causal_lm_loss


def _refuse_under_context_parallelism() -> None:
    if torch.compiler.is_compiling():
        _refuse_if_traced_for_context_parallelism()  # runs while Dynamo traces, see below
    elif active_context() is not None:
        raise InputError(_LABELS_FIX)


def _refuse_if_traced_for_context_parallelism() -> bool:
    """Called while Dynamo traces (``assume_constant_result``, set at registration): refuses
    when the frame is compiled by the ``hcp`` backend over more than one rank. The error
    leaves Dynamo as the backend's own do (``_carrier_of``); what this torch does not let it
    read counts as CP."""
    from hcp_compile.compiled.backend import _carrier_of

    cp = _compiled_for_context_parallelism()
    if cp is not False:
        detail = "" if cp else " (this torch does not tell which backend compiles the frame)"
        raise _carrier_of(InputError(_LABELS_FIX + detail))
    return True


def _compiled_for_context_parallelism() -> bool | None:
    """Whether the frame Dynamo traces is compiled by the ``hcp`` backend on a mesh of more
    than one rank; None when the backend cannot be read."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    from hcp_compile.compiled.backend import HcpBackend, default_mesh, hcp
    from hcp_compile.exchange.mesh import resolve_groups

    try:
        compiler = InstructionTranslator.current_tx().output.compiler_fn
    except AttributeError:
        return None
    options: dict[str, Any] = {}
    seen = []
    while compiler is not None and all(compiler is not s for s in seen):
        seen.append(compiler)  # WrapBackendDebug -> the backend (torch.compile's options on the way)
        if isinstance(compiler, HcpBackend) or compiler is hcp:
            mesh = compiler.options.mesh if isinstance(compiler, HcpBackend) else options.get("mesh")
            groups = resolve_groups(mesh if mesh is not None else default_mesh())
            return groups.ulysses_size * groups.ring_size > 1
        options = (getattr(compiler, "kwargs", None) or {}).get("options") or options
        compiler = getattr(compiler, "compiler_fn", None)
    return False


# --------------------------------------------------------------------------------------------
# registration with transformers, once its registries are imported
# --------------------------------------------------------------------------------------------

def _register_attention(modeling_utils: types.ModuleType) -> None:
    modeling_utils.AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)


def _register_mask(masking_utils: types.ModuleType) -> None:
    masking_utils.AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask_function)


def _register_loss_guard(loss_utils: types.ModuleType) -> None:
    # the registry maps each causal-LM model family to the one shifting loss; models look it
    # up on every call (PreTrainedModel.loss_function)
    import torch._dynamo  # loaded by transformers already

    torch._dynamo.assume_constant_result(_refuse_if_traced_for_context_parallelism)
    mapping = loss_utils.LOSS_MAPPING
    guarded = guard_causal_lm_loss(loss_utils.ForCausalLMLoss)
    for name, loss in list(mapping.items()):
        if loss is loss_utils.ForCausalLMLoss:
            mapping[name] = guarded


_REGISTRATIONS: dict[str, Callable[[types.ModuleType], None]] = {
    "transformers.modeling_utils": _register_attention,
    "transformers.masking_utils": _register_mask,
    "transformers.loss.loss_utils": _register_loss_guard,
}


def register_when_imported() -> None:
    """Register ``attn_implementation="hcp"`` with transformers: now for the registries already
    imported, the others right after their first import (an import hook that then removes
    itself). Never imports transformers."""
    pending = {}
    for module_name, register in _REGISTRATIONS.items():
        module = sys.modules.get(module_name)
        if module is not None:
            _register_safely(register, module)
        else:
            pending[module_name] = register
    if pending:
        sys.meta_path.insert(0, _RegisterOnImport(pending))


def _register_safely(
    register: Callable[[types.ModuleType], None], module: types.ModuleType
) -> None:
    # a transformers version without these registries must still import; say why "hcp" is absent
    try:
        register(module)
    except AttributeError as exc:
        warnings.warn(
            f"hcp_compile: attn_implementation='hcp' is not available with this transformers "
            f"version ({module.__name__}: {exc}); install a transformers version with "
            "AttentionInterface and AttentionMaskInterface",
            stacklevel=2,
        )


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the pending modules it takes the spec the other finders give
    and wraps its loader so that the registration runs right after the module executes."""

    def __init__(self, pending: dict[str, Callable[[types.ModuleType], None]]):
        self._pending = pending

    def find_spec(self, fullname: str, path, target=None) -> importlib.machinery.ModuleSpec | None:
        register = self._pending.get(fullname)
        if register is None:
            return None
        spec = self._spec_from_other_finders(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RegisteringLoader(spec.loader, lambda module: self._loaded(fullname, module))
        return spec

    def _spec_from_other_finders(self, fullname: str, path, target):
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def _loaded(self, fullname: str, module: types.ModuleType) -> None:
        register = self._pending.pop(fullname, None)
        if register is not None:
            _register_safely(register, module)
        if not self._pending and self in sys.meta_path:
            sys.meta_path.remove(self)


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, on_loaded: Callable[[types.ModuleType], None]):
        self._loader = loader
        self._on_loaded = on_loaded

    def create_module(self, spec: importlib.machinery.ModuleSpec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: types.ModuleType) -> None:
        # the module sees its real loader (source lookups, resources): this one only wraps exec
        module.__loader__ = module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._on_loaded(module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)
