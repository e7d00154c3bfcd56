"""Running a property case: one kernel on one device, or context parallelism on a served
world's ranks (every placement of the registry, eager and compiled), judged against the
float64 reference by ``bounds.judge``."""

from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

import hcp_compile
from hcp_compile.batch.placements import PLACEMENTS

from .bounds import Verdict, judge, ulp_scale
from .cases import PackedBatch, PropertyCase, Result, make_batch
from .profiles import PROFILES
from .scaled_reference import reference, sdpa_baseline
from .worlds import World

PAD_FILL = 7.0  # written into the pads of q, k, v and dout: a pad row must still give exactly 0
RECOMPILE_LIMIT = 64  # Dynamo: one compiled attention code object serves every configuration
CP_MODES = ("eager", "compiled")
BASELINE = "baseline sdpa"


def single_device(batch: PackedBatch, case: PropertyCase) -> Result:
    """The case's kernel through ``torch.ops.hcp.varlen_attention`` ("auto": the public
    ``hcp_compile.varlen_attention``), forward and backward."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v))
    cu, longest = batch.cu_seqlens, batch.max_seqlen
    if case.kernel == "auto":
        out = hcp_compile.varlen_attention(q, k, v, cu, cu, longest, longest, causal=case.causal,
                                           softmax_scale=case.scale, window_size=case.window)
    else:
        out, _ = torch.ops.hcp.varlen_attention(q, k, v, cu, cu, longest, longest, case.causal,
                                                case.softmax_scale, *case.window, case.kernel)
    out.backward(batch.dout)
    return Result(out.detach(), q.grad, k.grad, v.grad)


def judge_runs(batch: PackedBatch, case: PropertyCase, results: dict[str, Result], device: str,
               fault_ulps: float = 0.0) -> dict[str, Verdict]:
    """Each run's verdict against the float64 reference, and the SDPA baseline's own
    (``BASELINE``). ``fault_ulps``: added to one element of every run's dk first (how a test
    shows that a wrong result fails)."""
    chunk = PROFILES[device].chunk_elements
    expected = reference(batch, case, chunk)
    baseline = sdpa_baseline(batch, case, chunk)
    verdicts = {BASELINE: judge(baseline, expected, None, case.torch_dtype)}
    for label, result in results.items():
        if fault_ulps:
            dk = result.dk.clone()
            dk.view(-1)[0] += fault_ulps * ulp_scale(result.dk.float(), case.torch_dtype)
            result = Result(result.out, result.dq, dk, result.dv, result.pad_max)
        verdicts[label] = judge(result, expected, baseline, case.torch_dtype)
    return verdicts


class Attention(nn.Module):
    """The compiled model: only the library's attention call, its arguments as constants."""

    def __init__(self, case: PropertyCase):
        super().__init__()
        self.causal, self.scale, self.window = case.causal, case.scale, case.window

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int) -> Tensor:
        return hcp_compile.varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=self.causal,
                                            softmax_scale=self.scale, window_size=self.window)


class CompiledModules:
    """One compiled :class:`Attention` per mask, scale, kernel and placement; the batch's
    token count, ``cu_seqlens`` and ``max_seqlen`` are dynamic, so one graph serves every
    batch of a configuration (a one-document batch compiles once more: Dynamo specializes a
    2-entry ``cu_seqlens``)."""

    def __init__(self, mesh: object, inner: str):
        self.mesh, self.inner = mesh, inner
        self._modules: dict[tuple, nn.Module] = {}

    def get(self, case: PropertyCase, placement: str) -> nn.Module:
        key = (case.causal, case.scale, case.window, case.kernel, case.scheme, placement)
        if key not in self._modules:
            backend = hcp_compile.backend(mesh=self.mesh, inner=self.inner, kernel=case.kernel, placement=placement,
                                          scheme=case.scheme)
            self._modules[key] = torch.compile(Attention(case), backend=backend, fullgraph=True)
        return self._modules[key]


def context_parallel(batch: PackedBatch, case: PropertyCase, mode: str, placement: str, mesh: object,
                     compiled: CompiledModules) -> Result:
    """CP attention of this rank's shards (PAD_FILL in the pads of q, k, v and dout), eager or
    compiled, backward, and everything unsharded; ``pad_max``: the largest |value| of the local
    output and gradients on pad rows, over all ranks. Collective."""
    cu = batch.cu_seqlens.clone()  # a batch of its own: nothing cached for another run's plan
    plan = hcp_compile.shard_plan(cu, mesh, placement=placement,
                                  window=case.window if case.layout_window else (-1, -1))
    q, k, v = (plan.shard(t, PAD_FILL).requires_grad_() for t in (batch.q, batch.k, batch.v))
    if mode == "eager":
        with hcp_compile.context_parallel(mesh, kernel=case.kernel, placement=placement, scheme=case.scheme):
            out = Attention(case)(q, k, v, cu, batch.max_seqlen)
    else:
        for t in (q, k, v, cu):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        with torch.compiler.config.patch(dynamic_sources="L['max_seqlen']"):
            out = compiled.get(case, placement)(q, k, v, cu, batch.max_seqlen)
    out.backward(plan.shard(batch.dout, PAD_FILL))
    local = (out.detach(), q.grad, k.grad, v.grad)
    pad = ~plan.valid.to(q.device).reshape(-1, 1, 1)
    pad_max = torch.stack([torch.where(pad, t, 0).float().abs().amax() for t in local]).amax()
    pad_max = torch.nan_to_num(pad_max, nan=math.inf).reshape(1)
    dist.all_reduce(pad_max, op=dist.ReduceOp.MAX)
    return Result(*(plan.unshard(t) for t in local), pad_max=pad_max.item())


@dataclass(frozen=True)
class CPRequest:
    """What a served world's ranks run: batches of one configuration (the compiled module of
    the first serves the others), on ``device``."""

    cases: tuple[PropertyCase, ...]
    device: str
    fault_ulps: float = 0.0  # judge_runs' fault


def serve_cp_request(world: World, request: CPRequest) -> dict:
    """A served world's handler (``served.ServedWorld``): every case of the request under CP,
    each placement of ``PLACEMENTS`` eagerly and compiled; rank 0 returns ``{"<case index>
    <mode> <placement>": Verdict}`` and the baselines' verdicts, the other ranks nothing."""
    compiled = _rank_state(world.mesh, request.device)
    device = torch.device("cuda", 0) if request.device == "cuda" else torch.device("cpu")
    verdicts = {}
    for index, case in enumerate(request.cases):
        batch = make_batch(case, device)
        results = {f"{mode} {placement}": context_parallel(batch, case, mode, placement, world.mesh, compiled)
                   for placement in PLACEMENTS for mode in CP_MODES}
        if world.rank == 0:
            judged = judge_runs(batch, case, results, request.device, request.fault_ulps)
            verdicts.update({f"{index} {label}": verdict for label, verdict in judged.items()})
    return verdicts


_compiled: list[CompiledModules] = []  # a served rank's, kept across its requests (one mesh)


def _rank_state(mesh: object, device: str) -> CompiledModules:
    """A served rank's settings, once, and its compiled modules."""
    if _compiled:
        return _compiled[0]
    torch.set_float32_matmul_precision("highest")  # no TF32 in fp32 runs
    # Inductor cannot pickle the rewritten graphs' cache keys (torch 2.11): it says so, with a
    # traceback, per rank and graph, and compiles them uncached
    logging.getLogger("torch._inductor.codecache").setLevel(logging.ERROR)
    # flex runs uncompiled on CPU (so it says, once per process), compiled on CUDA
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._dynamo.config.accumulated_recompile_limit = 8 * RECOMPILE_LIMIT
    inner = PROFILES[device].inner
    if inner == "inductor":  # the ranks compile at once: share the cores
        torch._inductor.config.compile_threads = max(1, (os.cpu_count() or 1) // dist.get_world_size())
    _compiled.append(CompiledModules(mesh, inner))
    return _compiled[0]
