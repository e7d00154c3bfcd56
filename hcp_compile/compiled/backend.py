"""The ``hcp`` torch.compile backend: rewrite attention with ``cu_seqlens`` into hierarchical
CP (the pass in :mod:`hcp_compile.passes`), then compile with an inner compiler."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import fx
from torch._guards import TracingContext, tracing

from hcp_compile.batch.prepared import GraphKind, MeshShape
from hcp_compile.compiled.graph_variants import GraphVariants, cu_seqlens_inputs, graph_copy
from hcp_compile.exchange.mesh import CPGroups, MeshLike, make_mesh, resolve_groups
from hcp_compile.kernels.cost import estimate_block_runtime_ms
from hcp_compile.options import AttentionOptions
from hcp_compile.validation import InputError

if TYPE_CHECKING:
    from hcp_compile.passes.hierarchical_cp import GraphDump, HierarchicalCPPass
    from hcp_compile.passes.rewrite import RewriteConfig

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
# torch 2.11's overlap scheduler counts every compute node's FLOPs on real tensors made from
# its shapes, which fails for the sizes the rewritten graph reads from the batch; later
# versions estimate them (measured on 2.11 and 2.14, docs/design.md §5)
_OVERLAP_SCHEDULING_TAKES_BATCH_SIZES = torch.__version__ >= "2.12"
# torch 2.11's launcher of a 2-D tiled Triton kernel divides by its y grid, which is 0 when a
# batch-dependent size is 0 at run time (an empty exchange stream: every document LOCAL);
# one tile per kernel keeps those kernels 1-D (measured on 2.11; docs/design.md §5.5)
_TILED_KERNELS_TAKE_EMPTY_SIZES = torch.__version__ >= "2.12"
DUMP_ENV = "HCP_DUMP_DIR"


@dataclass(frozen=True)
class BackendOptions(AttentionOptions):
    """Options of the ``hcp`` backend: those of :class:`hcp_compile.options.AttentionOptions`
    (the layout check of each batch is what ``agree_across_ranks`` agrees on), and

    mesh: a ``("ring", "ulysses")`` DeviceMesh or a pair ``(ulysses_group, ring_group)``.
        Default: Ulysses over the ranks of one node (``LOCAL_WORLD_SIZE`` as set by torchrun,
        else the whole world), ring across nodes.
    inner: the compiler of the rewritten graph: ``"inductor"``, ``"aot_eager"`` or ``"eager"``.
    dump_dir: write every compiled graph's files under ``dump_dir/rank<R>/graph_<N>/``
        (default: the ``HCP_DUMP_DIR`` environment variable; caches are bypassed while dumping,
        so every graph is traced and written).
    """

    mesh: MeshLike | None = None
    inner: str = "inductor"
    dump_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.inner not in INNER_COMPILERS:
            raise InputError(f"inner: expected one of {INNER_COMPILERS}, got {self.inner!r}")


def rewrite_config(groups: CPGroups, options: BackendOptions) -> RewriteConfig:
    """What the rewrite pass takes of the options, for the mesh's ``groups``."""
    from hcp_compile.passes.rewrite import RewriteConfig  # see HcpBackend._compile

    return RewriteConfig(groups, options.kernel, options.agree_across_ranks, options.placement,
                         options.recompute_exchange, options.scheme,
                         agreement_timeout_s=options.agreement_timeout_s)


def parse_options(options: dict[str, Any] | None) -> BackendOptions:
    options = dict(options or {})
    known = {f.name for f in fields(BackendOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InputError(
            f"options: unknown {unknown} for the hcp backend; expected some of {sorted(known)}"
        )
    return BackendOptions(**options)


def _input_errors_reach_the_user(compile_fn: Callable) -> Callable:
    """Make an :class:`InputError` raised while compiling reach the caller of the compiled
    model as that very error, so ``except hcp_compile.InputError`` catches it.

    Dynamo (``OutputGraph._call_user_compiler``, torch 2.11 to 2.14) wraps what a backend
    raises in ``BackendCompilerFailed``, a RuntimeError raised ``from None``, except
    ``ShortenTraceback`` and its subclasses, which pass every layer as they are; its outermost
    frame then raises their ``remove_dynamo_frames()``. So the error leaves the backend in a
    :class:`_Carrier`, which is both, and whose ``remove_dynamo_frames()`` is the original.
    Called without Dynamo, the carrier is itself an instance of the original's class."""

    @functools.wraps(compile_fn)
    def compile_passing_input_errors(*args, **kwargs):
        try:
            return compile_fn(*args, **kwargs)
        except InputError as error:
            if isinstance(error, _Carrier):  # from a decorated call inside (hcp -> HcpBackend)
                raise
            raise _carrier_of(error) from error

    return compile_passing_input_errors


class _Carrier:
    """Mixed into a copy of an InputError together with Dynamo's ``ShortenTraceback``."""

    original: InputError
    first_useful_frame = None  # read by ShortenTraceback

    def remove_dynamo_frames(self) -> InputError:
        return self.original


def _carrier_of(error: InputError) -> InputError:
    cls = _carrier_class(type(error))
    carrier = cls.__new__(cls, *error.args)  # no __init__: a subclass may define its own
    carrier.__dict__.update(error.__dict__)
    carrier.original = error
    return carrier.with_traceback(error.__traceback__)


@functools.cache
def _carrier_class(cls: type[InputError]) -> type[InputError]:
    from torch._dynamo.exc import ShortenTraceback  # loaded by now: Dynamo is compiling

    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    return type(cls.__name__, (cls, _Carrier, ShortenTraceback), names)


class HcpBackend:
    """A torch.compile backend; ``hcp_compile.backend(**options)`` returns one."""

    def __init__(self, options: BackendOptions):
        self.options = options

    @_input_errors_reach_the_user
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        options = self.options
        groups = resolve_groups(options.mesh if options.mesh is not None else default_mesh())
        config = rewrite_config(groups, options)
        example_inputs = list(example_inputs)
        from hcp_compile.passes.match import find_attention  # see _compile

        matches = find_attention(gm.graph)
        inputs = cu_seqlens_inputs(gm.graph, matches)
        if inputs is None:
            return self._compile(gm, example_inputs, config, groups)
        # compiling rewrites the graph in place: a copy for each narrower graph
        pristine = graph_copy(gm)
        full = self._compile(gm, example_inputs, config, groups)
        context = TracingContext.try_get()
        later_inputs = _backend_fakes(example_inputs, context)

        def compile_for(kind: GraphKind) -> Callable:
            with tracing(context) if context is not None else contextlib.nullcontext():
                return self._compile(graph_copy(pristine), later_inputs, replace(config, graph_for=kind), groups)

        shape_env = context.fake_mode.shape_env if context is not None and context.fake_mode is not None else None
        return GraphVariants(
            full, compile_for, inputs, MeshShape(groups.ulysses_size, groups.ring_size, options.placement),
            guards=(lambda: shape_env.guards) if shape_env is not None else None,
            windows=tuple(sorted({m.call.window[0] for m in matches if m.call.causal and m.call.window[0] >= 0})),
        )

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any], config: RewriteConfig,
                 groups: CPGroups) -> Callable:
        # imported on first compile: the pass is an Inductor CustomGraphPass, and importing
        # torch._inductor would add about a second to every `import hcp_compile`
        from hcp_compile.passes.hierarchical_cp import HierarchicalCPPass

        options = self.options
        dump = _graph_dump(options.dump_dir or os.environ.get(DUMP_ENV))
        rewrite = HierarchicalCPPass(config, dump)
        with _data_dependent_sizes(example_inputs):
            if options.inner == "inductor":
                return _inductor(gm, example_inputs, rewrite, groups, dump)
            rewrite(gm.graph)
            if options.inner == "eager":
                if dump is not None:
                    dump.write("aot_forward.py", "# inner='eager': no AOT graphs\n")
                return gm.forward
            return _aot_eager(dump)(gm, example_inputs)


def _backend_fakes(example_inputs: list[Any], context: TracingContext | None) -> list[Any]:
    """``example_inputs`` as fake tensors of the tracing context's current fake mode, for a
    compile after Dynamo's call has returned. Dynamo passes its own fake tensors and a fresh
    mode for the backend, into which AOTAutograd re-fakes them with the symbols Dynamo
    recorded (``TracingContext.tensor_to_context``); that record is gone once the call returns,
    and a later re-fake would give every size a new symbol, so a narrower graph would add
    guards relating them. Faked here, while the record is there, they keep Dynamo's symbols."""
    if context is None or context.fake_mode is None:
        return example_inputs
    fakes = []
    for value in example_inputs:
        symbolic = context.tensor_to_context.get(value) if isinstance(value, torch.Tensor) else None
        if symbolic is not None:
            value = context.fake_mode.from_tensor(value, symbolic_context=symbolic, source=symbolic.tensor_source)
        fakes.append(value)
    return fakes


@contextlib.contextmanager
def _data_dependent_sizes(example_inputs: Sequence[Any]) -> Iterator[None]:
    """The rewritten graph reads its layout sizes from the batch (docs/design.md §5): let
    AOTAutograd trace those reads as data-dependent sizes, as Dynamo itself does with
    ``capture_scalar_outputs``."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(example_inputs)
    saved = mode.allow_scalar_outputs if mode is not None else None
    if mode is not None:
        mode.allow_scalar_outputs = True
    try:
        yield
    finally:
        if mode is not None:
            mode.allow_scalar_outputs = saved


def backend(**options) -> HcpBackend:
    """The ``hcp`` backend as a callable: ``torch.compile(model, backend=backend(mesh=...))``
    is ``torch.compile(model, backend="hcp", options={"mesh": ...})``."""
    return HcpBackend(parse_options(options))


@_input_errors_reach_the_user
def hcp(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None):
    """Entry point of ``backend="hcp"`` (``torch_dynamo_backends``); Dynamo passes
    ``torch.compile(..., options=...)`` as ``options``."""
    return HcpBackend(parse_options(options))(gm, example_inputs)


@functools.cache
def _default_mesh(world: int, local: int, device_type: str):
    return make_mesh(ulysses=local, ring=world // local, device_type=device_type)


def default_mesh():
    """Ulysses over the ranks of one node, ring across nodes (created once per process:
    building a mesh is itself a collective)."""
    if not dist.is_initialized():
        raise InputError(
            "mesh: no mesh was given and torch.distributed is not initialized; call "
            "init_process_group (or launch with torchrun) or pass options={'mesh': mesh}"
        )
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local < 1 or world % local:
        raise InputError(
            f"mesh: LOCAL_WORLD_SIZE={local} does not divide the world size {world}; pass "
            "options={'mesh': hcp_compile.make_mesh(ulysses=..., ring=...)}"
        )
    return _default_mesh(world, local, "cuda" if "nccl" in str(dist.get_backend()) else "cpu")


def _graph_dump(folder: str | None) -> GraphDump | None:
    """The next free ``graph_<N>`` folder of this rank under ``folder``."""
    from hcp_compile.passes.hierarchical_cp import GraphDump

    if not folder:
        return None
    root = Path(folder) / f"rank{dist.get_rank() if dist.is_initialized() else 0}"
    index = len(list(root.glob("graph_*"))) if root.exists() else 0
    return GraphDump(root / f"graph_{index}")


def _dumping(compiler: Callable, dump: GraphDump, name_for: Callable[[dict], str]) -> Callable:
    def compile_and_dump(gm: fx.GraphModule, example_inputs, *args, **kwargs):
        dump.write(name_for(kwargs), gm.print_readable(print_output=False))
        return compiler(gm, example_inputs, *args, **kwargs)

    return compile_and_dump


def _aot_eager(dump: GraphDump | None) -> Callable:
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    forward = backward = boxed_nop
    if dump is not None:
        forward = _dumping(boxed_nop, dump, lambda _: "aot_forward.py")
        backward = _dumping(boxed_nop, dump, lambda _: "aot_backward.py")
    return aot_autograd(
        fw_compiler=forward, bw_compiler=backward,
        partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True,
    )


def _inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], rewrite: HierarchicalCPPass,
    groups: CPGroups, dump: GraphDump | None,
) -> Callable:
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    patches: dict[str, Any] = {"pre_grad_custom_pass": rewrite}
    if groups.device_type == "cuda" and not _TILED_KERNELS_TAKE_EMPTY_SIZES:
        patches["triton.max_tiles"] = 1
    overlap = getattr(inductor_config, "aten_distributed_optimizations", None)
    if groups.device_type == "cuda" and hasattr(overlap, "enable_overlap_scheduling") and (
        _OVERLAP_SCHEDULING_TAKES_BATCH_SIZES
    ):
        patches["aten_distributed_optimizations.enable_overlap_scheduling"] = True
        if hasattr(overlap, "custom_runtime_estimation"):
            patches["aten_distributed_optimizations.custom_runtime_estimation"] = (
                estimate_block_runtime_ms
            )
        if hasattr(overlap, "enable_fusion_regions"):
            # torch 2.11's fusion-region estimate fails on these graphs ("last_output_node is
            # None"); it only refines the cost estimate, the overlap scheduling stays on
            patches["aten_distributed_optimizations.enable_fusion_regions"] = False
    if dump is None:
        return compile_fx(gm, example_inputs, config_patches=patches)
    patches["force_disable_caches"] = True

    def name_for(kwargs: dict) -> str:
        if kwargs.get("is_backward"):
            return "aot_backward.py"
        return "aot_inference.py" if kwargs.get("is_inference") else "aot_forward.py"

    inner = _dumping(compile_fx_inner, dump, name_for)
    return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)
