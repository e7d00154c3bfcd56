"""The advisor's GPU-other part (issue 26): the bytes of a rank's non-attention work against the
bytes a real eager call moves (counted op by op), cuDNN's own passes against its code run on
CPU, the kernel classifier, the fit, the loader, the advisor with and without constants, and
the measuring command on CPU."""

import json
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hcp_compile as hc
from hcp_compile import InputError, advise, hierarchical, layout
from hcp_compile.advise import cu_seqlens_of, gpu_other_bytes, rank_sizes
from hcp_compile.advise.records import GpuOtherBytes
from hcp_compile.kernels import BlockSpec, cudnn, gpu_other_measured, host_measured
from hcp_compile.kernels.gpu_other_measured import GpuOtherConstants, GpuOtherRecord
from hcp_compile.placements import placement_rule
from hcp_compile.schemes import ring as ring_scheme
from hcp_compile.schemes.traffic import CallShape

from benchmarks import gpu_other

from test_host_part import fake_rank, short

HEAD_DIM = 8
# ops that write nothing (allocations; _unsafe_view, the view reshape takes of its copy), and
# factories that write without reading an input
UNWRITTEN = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "_unsafe_view"}
WRITE_ONLY = {"fill_", "zero_", "new_full", "new_zeros", "new_ones", "full", "zeros", "ones", "zeros_like",
              "ones_like", "full_like"}


def nbytes(t):
    return t.numel() * t.element_size()


class ByteCounter(TorchDispatchMode):
    """The bytes every op on floating-point tensors reads and writes (whole tensors): views and
    unwritten allocations none, fills their output, ``copy_`` its source and destination, any
    other op its tensor inputs and outputs. The attention ops (``hcp::``) and the collectives
    are not counted; integer tensors are the layout's tables (a few bytes per document). While
    ``paused``, nothing is counted (a fused pass counted by :meth:`fused` runs its CPU
    expression)."""

    def __init__(self):
        super().__init__()
        self.bytes, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        namespace = func.namespace
        if self.paused or namespace in ("hcp", "_c10d_functional") or func.is_view or name in UNWRITTEN:
            return result
        floats = lambda tree: [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)  # noqa: E731
                               and t.is_floating_point()]
        written = sum(nbytes(t) for t in floats(result))
        if name in WRITE_ONLY:
            read = 0
        elif name == "copy_":
            read = nbytes(args[1])
        else:
            read = sum(nbytes(t) for t in floats((args, kwargs)))
        self.bytes += read + written
        return result

    def fused(self, function, reads):
        """``function`` (a merge or a sum of merge.py) counted as its fused CUDA pass: it reads
        the tensors ``reads`` picks from its arguments and writes its results, except that with
        no running value (the first argument None) it returns the block as it is."""
        def counted(*args, **kwargs):
            self.paused = True
            try:
                result = function(*args, **kwargs)
                inputs = [t for t in reads(*args, **kwargs) if t is not None]
                first = result[0] if isinstance(result, tuple) else result
                fused = not (args[0] is None and any(first is t for t in inputs))
                if fused:  # merge.py's kernels write new contiguous tensors (the CPU expressions keep strides)
                    result = tuple(r.contiguous() for r in result) if isinstance(result, tuple) else result.contiguous()
            finally:
                self.paused = False
            if fused:
                self.bytes += sum(nbytes(t) for t in inputs) + sum(nbytes(t) for t in tree_leaves(result))
            return result
        return counted


def merge_reads(out, lse, block_out, block_lse, out_dtype=None):
    return [out, lse, block_out, block_lse]


def sum_reads(acc, x, out_dtype=None):
    return [acc, x]


def counted_call(monkeypatch, lengths, ulysses, ring, rank, dtype=torch.bfloat16, heads=(8, 4)):
    """The bytes of rank ``rank``'s eager forward and backward (the torch kernel, whose own
    passes run inside its op), the merges and sums counted as merge.py's fused passes."""
    phases = []
    counter = ByteCounter()
    monkeypatch.setattr(hierarchical, "merge_partials", counter.fused(hierarchical.merge_partials, merge_reads))
    monkeypatch.setattr(hierarchical, "accumulate", counter.fused(hierarchical.accumulate, sum_reads))
    monkeypatch.setattr(ring_scheme, "accumulate", counter.fused(ring_scheme.accumulate, sum_reads))
    cu = cu_seqlens_of(lengths)
    with fake_rank(rank, ulysses, ring) as mesh:
        plan = hc.shard_plan(cu, mesh)
        qkv = [torch.randn(sum(lengths), h, HEAD_DIM, dtype=dtype) for h in (heads[0], heads[1], heads[1])]
        local = [plan.shard(t).requires_grad_() for t in qkv]
        with hc.context_parallel(mesh, kernel="torch"):
            with counter:
                out = hc.varlen_attention(*local, cu, cu, max(lengths), max(lengths), causal=True)
            phases.append(counter.bytes)
            grad = torch.ones_like(out)
            counter.bytes = 0
            with counter:
                out.backward(grad)
            phases.append(counter.bytes)
    return GpuOtherBytes(*phases)


def modelled(lengths, ulysses, ring, rank, dtype=torch.bfloat16, heads=(8, 4)):
    batch = layout.batch_layout(cu_seqlens_of(lengths), ulysses, ring, placement_rule("balanced"))
    sizes = rank_sizes(batch, rank // ulysses, rank % ulysses)
    return gpu_other_bytes(sizes, ring, CallShape(*heads, HEAD_DIM, dtype))


CASES = [  # (lengths, ulysses, ring, rank, heads)
    ((256,), 1, 2, 1, (8, 4)),  # one document: every step, no local region, no exchange
    ((256,), 2, 2, 0, (8, 4)),  # two head groups
    ((256,), 1, 4, 2, (8, 4)),  # four steps: sums in place between the first and the last
    (short(512, 8), 2, 4, 0, (8, 4)),  # short documents: the local region alone, nothing outside the op
    ((256,) + short(256, 8), 2, 4, 7, (8, 4)),  # a mix
    ((96, 40) + short(120, 8), 4, 2, 5, (8, 4)),  # a ring document, a straddling one; one head group
    ((192,), 4, 1, 1, (8, 2)),  # KV heads repeated for the exchange
]


@pytest.mark.parametrize("lengths, ulysses, ring, rank, heads", CASES)
def test_bytes_match_the_ops_of_a_real_eager_call(monkeypatch, lengths, ulysses, ring, rank, heads):
    seen = counted_call(monkeypatch, lengths, ulysses, ring, rank, heads=heads)
    every_row_local = lengths == short(512, 8)  # the local block's outputs are the rank's
    assert (seen.forward > 0 and seen.backward > 0) != every_row_local
    assert modelled(lengths, ulysses, ring, rank, heads=heads) == seen


class NoGraph:
    """Stands for a cuDNN graph: runs nothing (the outputs keep their fills)."""

    def get(self, *args, **kwargs):
        return self

    def run(self, device, feeds):
        pass


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("rows, keys, strided", [(24, 24, True), (24, 8, True), (16, 16, False)])
def test_cudnn_own_passes_match_its_code(monkeypatch, calls, rows, keys, strided):
    """The kernel's Python around its graphs, run on CPU with the graphs stubbed out."""
    counter = ByteCounter()
    monkeypatch.setattr(cudnn, "GRAPHS", NoGraph())
    monkeypatch.setattr(cudnn, "_calls", lambda spec, q, k: [(None, {})] * calls)
    monkeypatch.setattr(cudnn.Shape, "of", lambda *args: None)
    monkeypatch.setattr(cudnn, "merge_partials", counter.fused(cudnn.merge_partials, merge_reads))
    monkeypatch.setattr(cudnn, "accumulate", counter.fused(cudnn.accumulate, sum_reads))
    hq, hkv, dtype = 4, 2, torch.bfloat16
    q = torch.randn(rows, hq, HEAD_DIM, dtype=dtype)
    if strided:  # the ring's keys: halves of one KV tensor
        k, v = torch.randn(keys, 2 * hkv, HEAD_DIM, dtype=dtype).split(hkv, dim=1)
    else:
        k, v = (torch.randn(keys, hkv, HEAD_DIM, dtype=dtype) for _ in range(2))
    cu = torch.tensor([0, rows], dtype=torch.int32)
    spec = BlockSpec(cu, cu, rows, rows, True, 1.0)
    kernel = cudnn.CudnnKernel()
    with counter:
        out, lse = kernel.forward(q, k, v, spec)
    assert counter.bytes == advise.gpu_other.cudnn_forward_bytes(rows, keys, hq, hkv, HEAD_DIM, 2, 4, calls, strided)
    dout, counter.bytes = torch.randn_like(out), 0
    with counter:
        kernel.backward(dout, q, k, v, out, lse, spec)
    assert counter.bytes == advise.gpu_other.cudnn_backward_bytes(rows, keys, hq, hkv, HEAD_DIM, 2, 4, calls,
                                                                  strided)


def test_the_attention_ops_own_passes_are_counted_for_cudnn_alone():
    lengths, ulysses, ring, rank = (256,) + short(256, 8), 2, 4, 7
    sizes = rank_sizes(layout.batch_layout(cu_seqlens_of(lengths), ulysses, ring, placement_rule("balanced")),
                       rank // ulysses, rank % ulysses)
    call = CallShape(8, 4, HEAD_DIM, torch.bfloat16)
    own = advise.kernel_own_bytes(sizes, rank // ulysses, ring, call, "cudnn")
    # the local region's block and every step's in each of the two head groups
    local = advise.gpu_other.cudnn_forward_bytes(sizes.local, sizes.local, 8, 4, HEAD_DIM, 2, 4, 1, False)
    assert own.forward > local > 0 and own.backward > 0
    assert advise.kernel_own_bytes(sizes, rank // ulysses, ring, call, "flash") == GpuOtherBytes()
    with pytest.raises(InputError, match="returns_lse"):
        gpu_other_bytes(sizes, ring, replace(call, returns_lse=True))


@pytest.mark.parametrize("name, kind", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_128x128x128", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7", "attention"),
    ("sm90_flash_compute_dot_do_o_kernel", "attention"),
    ("cudnn::fusion::convert_dq_kernel", "attention"),
    ("flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
    ("hcp::block_forward", "attention"),
    ("ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)", "communication"),
    ("_merge_kernel", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>>", "other"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>", "other"),
    ("aten::copy_", "other"),
])
def test_the_classifier_tells_attention_from_communication_and_the_rest(name, kind):
    assert gpu_other.kernel_class(name) == kind


def test_the_fit_recovers_a_known_constant():
    moved = [1e9, 3e9, 5e8, 8e9]
    assert gpu_other.fit_per_byte(moved, [2e-13 * b for b in moved]) == pytest.approx(2e-13)
    noisy = [2e-13 * b * (1 + e) for b, e in zip(moved, (0.05, -0.05, 0.1, 0.0))]
    assert gpu_other.fit_per_byte(moved, noisy) == pytest.approx(2e-13, rel=0.05)
    assert gpu_other.fit_per_byte(moved, [-1.0] * 4) == 0.0  # never negative
    with pytest.raises(InputError, match="fit"):
        gpu_other.fit_per_byte([], [])


GOOD = {"forward": {"per_byte_s": 1e-13}, "backward": {"per_byte_s": 2e-13}}


@pytest.mark.parametrize("devices, message", [
    ({"H": {"date": "x"}}, r"devices\['H'\] has no 'modes'.*benchmarks.gpu_other"),
    ({"H": {"modes": {"hcp-eager": {"cudnn": {"forward": GOOD["forward"]}}}}}, "no 'backward' constants"),
    ({"H": {"modes": {"hcp-eager": {"cudnn": {**GOOD, "forward": {"per_byte_s": None}}}}}},
     r"forward\.per_byte_s: expected a finite number"),
])
def test_the_loader_names_what_is_missing(tmp_path, devices, message):
    path = tmp_path / "gpu_other.json"
    path.write_text(json.dumps({"devices": devices}))
    with pytest.raises(InputError, match=message):
        gpu_other_measured.recorded(path)
    path.write_text(json.dumps({"devices": {"H": {"modes": {"hcp-eager": {"cudnn": GOOD}}}}}))
    assert gpu_other_measured.recorded(path)["H"]["hcp-eager"]["cudnn"].backward.per_byte_s == 2e-13
    (tmp_path / "broken.json").write_text("[]")
    with pytest.raises(InputError, match="expected an object with 'devices'.*gpu_other --record"):
        gpu_other_measured.recorded(tmp_path / "broken.json")


def test_the_advisor_adds_the_gpu_other_time_where_measured(monkeypatch):
    batch = cu_seqlens_of((65536,))
    options = dict(world=4, gpus_per_node=8, heads_q=32, heads_kv=8, head_dim=128)
    monkeypatch.setattr(host_measured, "find", lambda *key: None)
    monkeypatch.setattr(gpu_other_measured, "find", lambda *key: None)
    without = advise.advise(batch, **options)
    assert not without.gpu_other_modelled and all(p.gpu_other_s == 0 for p in without.predictions)
    assert "GPU work besides attention not modelled" in advise.format_advice(without)
    record = GpuOtherRecord(GpuOtherConstants(1e-12), GpuOtherConstants(1e-12))
    monkeypatch.setattr(gpu_other_measured, "find", lambda *key: record)
    modelled_advice = advise.advise(batch, **options)
    assert modelled_advice.gpu_other_modelled
    assert "GPU work besides attention: measured" in advise.format_advice(modelled_advice)
    before = {p.option: p for p in without.predictions}
    for p in modelled_advice.predictions:
        assert p.gpu_other_s > 0
        assert p.step_s == pytest.approx(before[p.option].step_s + p.gpu_other_s)


def test_the_measuring_command_runs_on_cpu_and_its_record_reads_back(tmp_path):
    out = tmp_path / "gpu_other.json"
    gpu_other.main(["--device", "cpu", "--kernel", "torch", "--meshes", "1x2,2x1", "--workloads", "W2-128K",
                    "--shrink", "512", "--head-dim", "16", "--dtype", "float32", "--iters", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    points = result["points"]
    assert len(points) == 2 and all(p["forward_bytes"] > 0 and p["other_forward_ms"] > 0 for p in points)
    constants = result["devices"]["cpu"]["modes"]["hcp-eager"]["torch"]
    assert constants["forward"]["per_byte_s"] > 0
    into = tmp_path / "gpu_other_measured.json"
    into.write_text(json.dumps({"devices": {"NVIDIA H200": {"modes": {"hcp-eager": {"cudnn": GOOD}}}}}))
    gpu_other.main(["--record", str(out), "--into", str(into)])
    recorded = gpu_other_measured.recorded(into)
    assert set(recorded) == {"NVIDIA H200", "cpu"} and set(recorded["cpu"]["hcp-eager"]) == {"torch"}
    assert recorded["NVIDIA H200"]["hcp-eager"]["cudnn"].forward.per_byte_s == 1e-13  # kept


def test_the_advisor_check_shows_the_prediction_with_the_gpu_other_part(monkeypatch):
    from benchmarks import advisor_check

    lengths, ulysses, ring, rank = (65536,), 2, 4, 3
    args = (lengths, ulysses, ring, rank, "balanced", "cudnn", "gqa", 128, "NVIDIA H200")
    monkeypatch.setattr(host_measured, "find", lambda *key: None)
    monkeypatch.setattr(gpu_other_measured, "find", lambda *key: None)
    compute, with_host, with_other = advisor_check.predicted_ms(*args)
    assert with_host is None and with_other is None
    monkeypatch.setattr(gpu_other_measured, "find", lambda *key: GpuOtherRecord(GpuOtherConstants(1e-12),
                                                                                GpuOtherConstants(3e-12)))
    again, with_host, with_other = advisor_check.predicted_ms(*args)
    batch = layout.batch_layout(cu_seqlens_of(lengths), ulysses, ring, placement_rule("balanced"))
    moved = gpu_other_bytes(rank_sizes(batch, rank // ulysses, rank % ulysses), ring, CallShape(32, 8, 128,
                                                                                                 torch.bfloat16))
    assert again == compute and with_host is None
    assert with_other == pytest.approx(compute + (1e-12 * moved.forward + 3e-12 * moved.backward) * 1e3)
    row = advisor_check.Comparison("W1-64K", f"{ulysses}x{ring}", rank, "balanced", "cudnn", with_other * 1.1, compute,
                                   predicted_other_ms=with_other)
    text = advisor_check.table([row])
    assert "+ host + other GPU ms" in text and "-9.1 %" in text and "+ host: not modelled" in text
    assert "+ other GPU: not modelled" not in text
