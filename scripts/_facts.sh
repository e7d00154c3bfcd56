python - <<'PY'
import torch, inspect
print(torch.__version__)
import torch.nn.attention.varlen as V
print(inspect.signature(V.varlen_attn))
print(torch.ops.torch_attn._varlen_attn.default._schema)
src = inspect.getsource(V.varlen_attn); print(src[-1500:])
import torch._inductor.config as c
print("adopt", hasattr(c, "aten_distributed_optimizations"))
if hasattr(c, "aten_distributed_optimizations"):
    print({k: getattr(c.aten_distributed_optimizations, k) for k in dir(c.aten_distributed_optimizations) if not k.startswith("_")})
print("pre_grad_pass_timing", getattr(c, "pre_grad_pass_timing", None))
import torch._inductor.compile_fx as cf
s = inspect.getsource(cf)
i = s.find("_recursive_pre_grad_passes(model_")
print(s[i-1500:i+200])
import torch._inductor.custom_graph_pass as cgp
print(dir(cgp))
PY
