"""Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` on packed, padding-free batches under
hierarchical context parallelism: ``class CPSFTTrainer(ContextParallelMixin, SFTTrainer)``.

Every rank of a context-parallel group (``mesh``'s ``ulysses x ring`` ranks) loads the same
batch (the data loader is sharded over the mesh's ``data`` dimension only), shifts its labels
on the whole packed row, and feeds the model its shard (``shard_plan``): the tokens, their
positions, the pre-shifted labels as ``shift_labels`` and the GLOBAL packed keywords. The
Trainer's own loss normalization then gives the single-process answer once it is told how many
ranks share a batch (``get_cp_size``): the loss is normalized by the whole batch's target count,
and DDP's average over all ranks of losses scaled by the Trainer's factor sums the CP ranks'
shares and averages the data replicas. Evaluation reports the whole batch's loss.

``import hcp_compile`` does not import this module (it imports transformers and accelerate).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader
from transformers import Trainer

from hcp_compile.batch.placements import DEFAULT_PLACEMENT
from hcp_compile.compiled.backend import BackendOptions
from hcp_compile.context import CPOptions, context_parallel
from hcp_compile.exchange.mesh import DATA_DIM_NAME, CPGroups, resolve_groups
from hcp_compile.hf import ATTN_IMPLEMENTATION, layout_window
from hcp_compile.plan import ShardPlan, shard_plan
from hcp_compile.validation import InputError

IGNORE_INDEX = -100  # transformers' and TRL's ignore index of the loss
PACKED_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# per-token keys the model does not need under hcp attention (TRL's padding-free collator adds
# seq_idx for linear-attention layers, whose convolutions would cross shards anyway)
DROPPED_KEYS = ("seq_idx",)
_COLLATOR_FIX = (
    "use a padding-free collator that returns one packed row with its document boundaries: "
    "DataCollatorWithFlattening(return_flash_attn_kwargs=True), or SFTTrainer with "
    "packing=True or padding_free=True"
)


class ContextParallelMixin:
    """Put before ``transformers.Trainer`` or a subclass of it (``trl.SFTTrainer``) in the bases
    of a trainer class; construct it with the trainer's own arguments and ``mesh``.

    Args:
        mesh: ``hcp_compile.make_mesh(ulysses=..., ring=..., data=...)`` over all ranks
            (``data`` data-parallel replicas of a ``ulysses x ring`` context-parallel group).
        hcp_options: options of ``context_parallel`` (eager), or of the ``hcp`` backend when
            the training arguments say ``torch_compile_backend="hcp"`` (then the trainer
            compiles the model itself, in place, with the mesh: accelerate knows only its own
            backends). ``placement`` also lays out the shards.

    The model must use ``attn_implementation="hcp"``. Evaluation computes the loss only
    (``compute_metrics`` would see one shard's logits).
    """

    def __init__(self, *args: Any, mesh: DeviceMesh, hcp_options: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        self.hcp_mesh = mesh
        self.hcp_options = dict(hcp_options or {})
        unknown = sorted(set(self.hcp_options) - _field_names(CPOptions) - _field_names(BackendOptions))
        if unknown:
            raise InputError(
                f"hcp_options: unknown {unknown}; expected options of context_parallel "
                f"{sorted(_field_names(CPOptions))} or of the hcp backend "
                f"{sorted(_field_names(BackendOptions) - {'mesh'})}"
            )
        self._cp_groups: CPGroups = resolve_groups(mesh)
        names = mesh.mesh_dim_names or ()
        self._data_size = mesh.size(names.index(DATA_DIM_NAME)) if DATA_DIM_NAME in names else 1
        self._data_rank = mesh.get_local_rank(DATA_DIM_NAME) if DATA_DIM_NAME in names else 0
        super().__init__(*args, **kwargs)
        self._check_setup()
        self._layout_window = layout_window(self.model.config)  # the shards' layout balances it
        if self._compiles_with_hcp:
            # in place: accelerate, DDP and save_pretrained keep seeing the model itself
            options = _options_of(BackendOptions, self.hcp_options)
            self.model.compile(backend="hcp", options={"mesh": mesh, **options}, dynamic=True)

    # ------------------------------------------------------------------ setup

    @property
    def cp_size(self) -> int:
        return self._cp_groups.ulysses_size * self._cp_groups.ring_size

    @property
    def _compiles_with_hcp(self) -> bool:
        return bool(self.args.torch_compile) and self.args.torch_compile_backend == ATTN_IMPLEMENTATION

    def create_accelerator_and_postprocess(self) -> None:
        if not self._compiles_with_hcp:
            super().create_accelerator_and_postprocess()
            return
        # accelerate's TorchDynamoPlugin takes only the backends it lists, and would compile the
        # DDP wrapper (whose graph splits the rewrite cannot see whole): accelerate compiles
        # nothing here, __init__ compiles the model with the mesh
        args = self.args
        saved = args.torch_compile, args.torch_compile_backend
        args.torch_compile, args.torch_compile_backend = False, "no"
        try:
            super().create_accelerator_and_postprocess()
        finally:
            args.torch_compile, args.torch_compile_backend = saved

    def _check_setup(self) -> None:
        args, world = self.args, self.args.world_size
        if self.cp_size * self._data_size != world:
            raise InputError(
                f"mesh: covers data {self._data_size} x {self.cp_size} context-parallel ranks but "
                f"the trainer runs on {world} processes; build it over every rank, "
                f"hcp_compile.make_mesh(ulysses=..., ring=..., data=...) with data * ulysses * "
                f"ring = {world}"
            )
        attn = getattr(self.model.config, "_attn_implementation", None)
        if attn != ATTN_IMPLEMENTATION:
            raise InputError(
                f"model: attn_implementation is {attn!r}, which attends within this rank's shard "
                "only; load the model with attn_implementation='hcp'"
            )
        if args.torch_compile and not self._compiles_with_hcp:
            raise InputError(
                f"torch_compile_backend: {args.torch_compile_backend!r} cannot run attention over "
                "the context-parallel shards; pass torch_compile_backend='hcp' (the trainer "
                "compiles the model with the mesh)"
            )
        if args.label_smoothing_factor > 0 or self.compute_loss_func is not None:
            raise InputError(
                "label_smoothing_factor, compute_loss_func: they shift the labels again inside "
                "this rank's shard; use neither under context parallelism (the model's loss takes "
                "the labels shifted before sharding)"
            )
        if args.include_num_input_tokens_seen not in ("no", False):
            raise InputError(
                f"include_num_input_tokens_seen: {args.include_num_input_tokens_seen!r} would count "
                "every batch once per context-parallel rank; pass 'no'"
            )
        config = getattr(self.accelerator, "parallelism_config", None)
        if config is not None and (config.cp_enabled or getattr(config, "sp_enabled", False)):
            raise InputError(
                "parallelism_config: accelerate's own context or sequence parallelism is on; "
                "leave cp_size and sp_size at 1 (the mesh gives hcp's)"
            )

    def get_cp_size(self) -> int:
        """Ranks sharing one batch: the Trainer divides its target count by it (the count is
        gathered from every rank) and sizes the data-parallel world by it."""
        return self.cp_size

    # ------------------------------------------------------------------ data

    def get_train_dataloader(self) -> DataLoader:
        return self._one_batch_per_cp_group(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        return self._one_batch_per_cp_group(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        return self._one_batch_per_cp_group(super().get_test_dataloader(test_dataset))

    def _one_batch_per_cp_group(self, loader: DataLoader) -> DataLoader:
        """accelerate shards the batches over every process; here over the data replicas only,
        as transformers itself narrows the shard of its rank-aware batch sampler. One replica
        takes a short last batch as one process does (accelerate completes it from the set's
        start for several replicas: their batches must be equal in number)."""
        if isinstance(loader, DataLoaderDispatcher):
            raise InputError(
                "accelerator_config.dispatch_batches: dispatching slices one batch over every "
                "process; pass accelerator_config={'dispatch_batches': False}"
            )
        for shard in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
            if isinstance(shard, BatchSamplerShard):
                shard.num_processes, shard.process_index = self._data_size, self._data_rank
                shard.even_batches = shard.even_batches and self._data_size > 1
                return loader
        if self.args.world_size > 1:
            raise InputError(
                f"dataset: accelerate did not shard the batches of its {type(loader.dataset).__name__} "
                "by index, so they cannot be given to the data replicas only; pass a map-style "
                "dataset (datasets.Dataset, or a torch Dataset with __len__)"
            )
        return loader

    # ------------------------------------------------------------------ loss

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Tensor | int | None = None) -> Any:
        """The parent's loss on this rank's shard. In training the Trainer passes the whole
        batch's target count (divided by ``get_cp_size``) and DDP combines the ranks' shares;
        in evaluation the group's loss is gathered from the shares here."""
        if num_items_in_batch is None and torch.is_grad_enabled() and model.training:
            raise InputError(
                "num_items_in_batch: the Trainer counted no target tokens for this batch (the "
                "model's forward takes no **kwargs); under context parallelism the loss must be "
                "normalized by the whole batch's count; use a model whose forward accepts "
                "num_items_in_batch"
            )
        plan, local = self._shard(inputs)
        tokens_before = getattr(self, "_total_train_tokens", None)
        result = super().compute_loss(model, local, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if tokens_before is not None and model.training:
            self._count_real_tokens(plan, tokens_before)
        if model.training and torch.is_grad_enabled():
            return result  # this rank's share: DDP's reduction combines the shares
        loss, outputs = result if return_outputs else (result, None)
        loss = self._group_loss(loss.detach(), local["shift_labels"], num_items_in_batch is not None)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        # the backward too: gradient checkpointing recomputes attention in it
        with self._attention_context():
            return super().training_step(*args, **kwargs)

    def _attention_context(self) -> contextlib.AbstractContextManager:
        # compiled too: the graphs carry their own rewrite, and what Dynamo leaves to run eagerly
        # (a recompute under gradient checkpointing) runs CP in the context
        return context_parallel(self.hcp_mesh, **_options_of(CPOptions, self.hcp_options))

    def _shard(self, inputs: dict[str, Any]) -> tuple[ShardPlan, dict[str, Any]]:
        """This rank's inputs: its tokens, their positions, the labels shifted on the whole row
        (a token's successor may sit on another rank) as ``shift_labels``, and the GLOBAL packed
        keywords. ``labels`` is the same shard, so that the model computes a loss at all; its
        loss function reads ``shift_labels`` and does not shift again."""
        missing = [name for name in ("input_ids", *PACKED_KEYWORDS) if inputs.get(name) is None]
        if missing:
            raise InputError(f"{', '.join(missing)}: missing from the batch; {_COLLATOR_FIX}")
        input_ids = inputs["input_ids"]
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InputError(
                f"input_ids: expected one packed row [1, tokens], got shape "
                f"{tuple(input_ids.shape)}; {_COLLATOR_FIX}"
            )
        if not torch.equal(inputs["cu_seq_lens_q"], inputs["cu_seq_lens_k"]):
            raise InputError("cu_seq_lens_k: must equal cu_seq_lens_q (self-attention over the packed row)")
        tokens = input_ids.shape[1]
        handled = {"input_ids", "labels", "shift_labels", "position_ids", *PACKED_KEYWORDS, *DROPPED_KEYS}
        per_token = [name for name, value in inputs.items() if name not in handled
                     and isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == tokens]
        if per_token:
            raise InputError(
                f"{', '.join(per_token)}: per-token inputs the context-parallel trainer does not "
                f"shard; leave them out of the batch ({_COLLATOR_FIX})"
            )
        plan = shard_plan(inputs["cu_seq_lens_q"], self.hcp_mesh,
                          placement=self.hcp_options.get("placement", DEFAULT_PLACEMENT), window=self._layout_window)
        targets = inputs.get("shift_labels")
        if targets is None:
            if inputs.get("labels") is None:
                raise InputError(f"labels: missing from the batch; {_COLLATOR_FIX}")
            row = inputs["labels"][0]  # what the model's loss shifts: the next token's label
            targets = torch.cat([row[1:], row.new_full((1,), IGNORE_INDEX)])[None]
        shift_labels = plan.shard(targets[0], pad_value=IGNORE_INDEX)[None]
        positions = inputs.get("position_ids")
        local = {name: value for name, value in inputs.items() if name not in handled}
        local.update({
            "input_ids": plan.shard(input_ids[0])[None],
            "position_ids": (plan.position_ids if positions is None else plan.shard(positions[0]))[None],
            "labels": shift_labels,
            "shift_labels": shift_labels,
            **{name: inputs[name] for name in PACKED_KEYWORDS},
        })
        return plan, local

    def _group_loss(self, loss: Tensor, shift_labels: Tensor, counted: bool) -> Tensor:
        """Evaluation: on every rank of the group, the value one data-parallel replica without
        CP would report for the batch. With the batch's count (``counted``) the shares sum to
        ``cp_size`` times it (the Trainer scaled them for DDP's average over all ranks); without
        it each rank averaged over its own targets, so the mean over the whole batch's targets
        is rebuilt from the ranks' sums (0 where a rank has no target)."""
        if counted:
            return (self._sum_over_group(loss.float()) / self.cp_size).to(loss.dtype)
        count = (shift_labels != IGNORE_INDEX).sum().to(loss.device, torch.float)
        total = torch.where(count > 0, loss.float() * count, torch.zeros_like(count))
        total, count = self._sum_over_group(torch.stack([total, count]))
        return (total / count.clamp(min=1)).to(loss.dtype)

    def _sum_over_group(self, tensor: Tensor) -> Tensor:
        tensor = tensor.clone()
        for group in (self._cp_groups.ulysses_group, self._cp_groups.ring_group):
            dist.all_reduce(tensor, group=group)
        return tensor

    def _count_real_tokens(self, plan: ShardPlan, tokens_before: int) -> None:
        """TRL's ``num_tokens`` counts each rank's row, pads of the shards included: count
        the real tokens of every shard (all ranks together hold each token once)."""
        real = self.accelerator.gather(plan.valid.sum()[None]).sum().item()
        self._total_train_tokens = tokens_before + real
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]

    # ------------------------------------------------------------------ evaluation

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        if not prediction_loss_only:
            raise InputError(
                "compute_metrics: under context parallelism each rank holds a shard of the "
                "logits, so evaluation computes the loss only; pass compute_metrics=None (or "
                "prediction_loss_only=True) and compute such metrics in one process"
            )
        with self._attention_context():
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        # every rank of a group returns the group's loss: keep one copy per group (the loop
        # sets gather_function back itself when it ends)
        self.gather_function = self._gather_one_copy_per_group
        return super().evaluation_loop(*args, **kwargs)

    def _gather_one_copy_per_group(self, tensor: Tensor) -> Tensor:
        """``accelerator.gather_for_metrics`` over the data replicas: the group leaders'
        values in rank order, the last batch's repeated samples dropped as it drops them."""
        leader = self._cp_groups.ulysses_rank == 0 and self._cp_groups.ring_rank == 0
        gathered = self.accelerator.gather(tensor)
        keep = self.accelerator.gather(torch.full(tensor.shape[:1], leader, device=tensor.device))
        values = gathered[keep]
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            values = values[: state.remainder]
        return values


class ContextParallelTrainer(ContextParallelMixin, Trainer):
    """``transformers.Trainer`` under hierarchical context parallelism (see the mixin)."""


def _field_names(options: type) -> set[str]:
    return {field.name for field in dataclasses.fields(options)}


def _options_of(options: type, given: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``given`` that ``options`` (CPOptions or BackendOptions) takes."""
    names = _field_names(options)
    return {name: value for name, value in given.items() if name in names}
