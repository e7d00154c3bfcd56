"""A process that lives for days: every kernel through ``torch._dynamo.reset()`` between calls,
models compiled around the single-device op (another backend) and with ``backend="hcp"``,
several compiled models alive at once, and a stream that meets every batch composition in
random order with resets between some steps. Each result is checked against the float64
reference. CPU: the kernels that run there (flex traced by ``aot_eager`` as on CUDA); CUDA
(``-m gpu``): every kernel in bf16 with Inductor. Also: a compiled run's log holds no
traceback and none of the warnings a user would read as failures."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import hcp_compile as hc
from hcp_compile.testing.reference import reference_with_grads
from checks import assert_matches
from cp_cases import cu_seqlens, kernels_that_run, seeded
from hcp_compile.kernels import KERNELS, BlockRequest

HEADS_Q, HEADS_KV, HEAD_DIM = 4, 2, 64
# bf16 tolerance with GQA (docs/design.md §6); fp32 on CPU
TOLERANCE = {torch.bfloat16: 3.5e-2, torch.float32: 1e-4}


def compositions(scale: int) -> dict[str, tuple[tuple[int, ...], tuple[int, int]]]:
    """Document lengths and window of each batch composition a trainer meets, ``scale`` tokens
    per unit: one document, log-uniform lengths, short documents, log-uniform under a window,
    and twice the size of each."""
    rng = random.Random(scale)
    log_uniform = tuple(int(2 ** rng.uniform(3, 7) * scale / 16) or 1 for _ in range(9))
    short = tuple(rng.randint(2, 12) * scale // 16 or 1 for _ in range(20))
    base = {"one-document": ((16 * scale,), (-1, -1)), "log-uniform": (log_uniform, (-1, -1)),
            "short": (short, (-1, -1)), "window": (log_uniform, (scale, 0))}
    doubled = {f"{name}-2x": (lengths * 2, window) for name, (lengths, window) in base.items()}
    return {**base, **doubled}


def batch(name: str, lengths: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> dict:
    tokens = sum(lengths)
    shapes = {"q": HEADS_Q, "k": HEADS_KV, "v": HEADS_KV, "dout": HEADS_Q}
    values = {n: seeded(f"long-lived/{name}/{n}", tokens, heads, HEAD_DIM).to(dtype) for n, heads in shapes.items()}
    cu = cu_seqlens(lengths)
    return {"host": values, "cu": cu, "device": {n: t.to(device) for n, t in values.items()},
            "cu_device": cu.to(device), "longest": max(lengths)}


def check(got: dict[str, torch.Tensor], data: dict, window: tuple[int, int], what: str) -> None:
    expected = reference_with_grads(*(data["host"][n] for n in ("q", "k", "v", "dout")), data["cu"].tolist(),
                                    data["cu"].tolist(), causal=True, window=window)
    tol = TOLERANCE[data["host"]["q"].dtype]
    for name in ("out", "dq", "dk", "dv"):
        assert_matches(got[name].float().cpu(), expected[name], f"{what} {name}", atol=tol, rtol=tol)


def attend_op(kernel: str, window: tuple[int, int]):
    """The single-device op with a named kernel, as a model would call it."""
    def attend(q, k, v, cu, longest):
        return torch.ops.hcp.varlen_attention(q, k, v, cu, cu, longest, longest, True, HEAD_DIM ** -0.5, *window,
                                              kernel)[0]
    return attend


def run(fn, data: dict) -> dict[str, torch.Tensor]:
    leaves = [data["device"][n].clone().requires_grad_() for n in ("q", "k", "v")]
    out = fn(*leaves, data["cu_device"], data["longest"])
    out.backward(data["device"]["dout"])
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}


def runs_on(kernel: str, device: torch.device, dtype: torch.dtype, window: tuple[int, int]) -> bool:
    if kernel == "auto":
        return True
    q = torch.empty(1, HEADS_Q, HEAD_DIM, dtype=dtype, device="meta")
    k = torch.empty(1, HEADS_KV, HEAD_DIM, dtype=dtype, device="meta")
    return KERNELS[kernel].supports(dataclasses.replace(BlockRequest.of(q, k, window), device=device)) is None


def survives_resets_and_compiled_models(kernel: str, device: torch.device, dtype: torch.dtype, compiler: str,
                                        hcp_mesh=None, hcp_inner: str = "aot_eager") -> None:
    """Eager, then compiled around the op, then ``torch._dynamo.reset()``, then compiled again
    while the first compiled model lives, then (with ``hcp_mesh``) through ``backend="hcp"``
    before and after a reset: a new batch each time, each against the reference."""
    window = (-1, -1)
    plan = compositions(16 if device.type == "cpu" else 128)
    names = ["log-uniform", "short", "one-document", "log-uniform-2x", "short-2x", "one-document-2x"]
    data = [batch(name, plan[name][0], device, dtype) for name in names]
    attend = attend_op(kernel, window)
    check(run(attend, data[0]), data[0], window, f"{kernel} eager")
    first = torch.compile(attend, backend=compiler)
    check(run(first, data[1]), data[1], window, f"{kernel} compiled")
    torch._dynamo.reset()
    second = torch.compile(lambda *args: attend(*args) * 1.0, backend=compiler)
    check(run(second, data[2]), data[2], window, f"{kernel} compiled after a reset")
    check(run(first, data[3]), data[3], window, f"{kernel} first model again")
    if hcp_mesh is None:
        return

    def model(q, k, v, cu, longest):
        return hc.varlen_attention(q, k, v, cu, cu, longest, longest, causal=True)

    for step, data_step in enumerate(data[4:]):
        compiled = torch.compile(model, backend="hcp", options={"mesh": hcp_mesh, "inner": hcp_inner,
                                                                "kernel": kernel})
        check(run(compiled, data_step), data_step, window, f"{kernel} backend=hcp, round {step}")
        torch._dynamo.reset()


@pytest.mark.parametrize("kernel", [*kernels_that_run(heads=(HEADS_Q, HEADS_KV), head_dim=HEAD_DIM), "auto"])
def test_cpu_kernels_survive_resets_and_models_compiled_around_them(kernel, traced_flex, one_rank_mesh):
    torch._dynamo.reset()
    survives_resets_and_compiled_models(kernel, torch.device("cpu"), torch.float32, "aot_eager", one_rank_mesh)


def mixed_stream(device: torch.device, dtype: torch.dtype, kernel: str, steps: int, reset_every: int,
                 compiler: str, scale: int) -> list[str]:
    """``steps`` batches in a seeded random order over :func:`compositions`, eager and compiled
    around the op in turn, ``torch._dynamo.reset()`` every ``reset_every`` steps; returns the
    order met."""
    plan = compositions(scale)
    rng = random.Random(7)
    order = list(plan) + [rng.choice(list(plan)) for _ in range(steps - len(plan))]
    rng.shuffle(order)
    for step, name in enumerate(order):
        if step and step % reset_every == 0:
            torch._dynamo.reset()
        lengths, window = plan[name]
        window = window if runs_on(kernel, device, dtype, window) else (-1, -1)
        attend = attend_op(kernel, window)
        fn = torch.compile(attend, backend=compiler) if step % 2 else attend
        data = batch(f"{name}-{step}", lengths, device, dtype)
        check(run(fn, data), data, window, f"step {step} ({name}, {'compiled' if step % 2 else 'eager'})")
    return order


def test_cpu_mixed_stream_meets_every_composition_with_resets(traced_flex):
    torch._dynamo.reset()
    order = mixed_stream(torch.device("cpu"), torch.float32, "auto", steps=10, reset_every=3, compiler="aot_eager",
                         scale=8)
    assert set(order) == set(compositions(8))


def test_a_compiled_run_prints_no_traceback_or_warning(tmp_path):
    """Inductor around the single-device op and ``backend="hcp"`` with Inductor inside, each
    fwd+bwd with flex (traced by Dynamo, as on CUDA) and a reset after it, in a fresh process: no traceback, no warning from Inductor's FX graph cache
    ("Failed to pickle cache key") or Dynamo ("functools.lru_cache") and none of the project's.
    torch's notice that a CUDA build found no CUDA runtime on a CPU machine is the platform's,
    not a failure, and is let through."""
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        import hcp_compile as hc
        from hcp_compile.kernels import flex
        flex.COMPILE_BACKENDS["cpu"] = "aot_eager"
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        mesh = hc.make_mesh(1, 1, "cpu")
        cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
        def attend(q, k, v, cu, m):
            return hc.varlen_attention(q, k, v, cu, cu, m, m, causal=True, window_size=(4, 0))
        def attend_flex(q, k, v, cu, m):
            return torch.ops.hcp.varlen_attention(q, k, v, cu, cu, m, m, True, 0.25, 4, 0, "flex")[0]
        plan = hc.shard_plan(cu, mesh)
        for compiled in (torch.compile(attend_flex),
                         torch.compile(attend, backend="hcp", options={"mesh": mesh, "kernel": "flex"})):
            q, k, v = (plan.shard(torch.randn(16, 4, 16)).requires_grad_() for _ in range(3))
            compiled(q, k, v, cu, 8).sum().backward()
            torch._dynamo.reset()
        dist.destroy_process_group()
        print("done")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            cwd=tmp_path)
    log = result.stdout + result.stderr
    assert result.returncode == 0 and "done" in result.stdout, log
    noise = [line for line in log.splitlines()
             if any(word in line for word in ("Traceback", "Warning", "warning", "Failed to pickle", "lru_cache"))
             and "No CUDA runtime is found" not in line]
    assert not noise, "\n".join(noise)


# --------------------------------------------------------------------------------------------
# CUDA: every kernel in bf16, Inductor
# --------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [*KERNELS, "auto"])  # those that cannot run here skip
def test_gpu_kernels_survive_resets_and_models_compiled_around_them(kernel):
    device = torch.device("cuda")
    if not runs_on(kernel, device, torch.bfloat16, (-1, -1)):
        pytest.skip(f"{kernel} cannot run here")
    torch._dynamo.reset()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = hc.make_mesh(1, 1, "cuda")
        survives_resets_and_compiled_models(kernel, device, torch.bfloat16, "inductor", mesh, hcp_inner="inductor")
    finally:
        dist.destroy_process_group()


@needs_cuda
@pytest.mark.gpu
def test_gpu_mixed_stream_meets_every_composition_with_resets():
    """The default kernel ("auto": cudnn where it passes its check, flex under a window)."""
    torch._dynamo.reset()
    order = mixed_stream(torch.device("cuda"), torch.bfloat16, "auto", steps=12, reset_every=5, compiler="inductor",
                         scale=128)
    assert set(order) == set(compositions(128))
