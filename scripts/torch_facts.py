import torch, inspect
print(torch.__version__)
import torch.nn.attention.varlen as V
print(inspect.signature(V.varlen_attn))
print(torch.ops.torch_attn._varlen_attn.default._schema)
import torch._inductor.config as c
o = getattr(c, "aten_distributed_optimizations", None)
print("overlap", o, getattr(o, "enable_overlap_scheduling", "missing"))
print("timing", getattr(c, "pre_grad_pass_timing", "missing"))
