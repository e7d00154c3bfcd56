"""Print the facts of the installed torch that hcp_compile's backend depends on."""

import inspect

import torch
import torch._inductor.config as inductor_config
import torch.nn.attention.varlen as varlen

print("torch", torch.__version__)
print("varlen_attn", inspect.signature(varlen.varlen_attn))
print("torch_attn::_varlen_attn", torch.ops.torch_attn._varlen_attn.default._schema)
overlap = getattr(inductor_config, "aten_distributed_optimizations", None)
if overlap is None:
    print("no aten_distributed_optimizations config")
else:
    names = [n for n in dir(overlap) if not n.startswith("_")]
    print("aten_distributed_optimizations:", {n: getattr(overlap, n) for n in names})
print("pre_grad_pass_timing:", getattr(inductor_config, "pre_grad_pass_timing", "absent"))
try:
    from torch._inductor.fx_passes import overlap_scheduling
except ImportError:
    print("no overlap_scheduling module")
else:
    for name in ("is_compute_node", "benchmark_node_with_cache_key", "benchmark_node"):
        function = getattr(overlap_scheduling, name, None)
        print(f"--- overlap_scheduling.{name}:")
        print(inspect.getsource(function) if function else "absent")
