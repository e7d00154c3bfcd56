"""A small packed-sequence transformer written for ONE device (no CP code in it), used by
``examples/compile_model.py`` and ``benchmarks/compile_model.py``.

Inputs are THD: ``x [T, dim]`` (documents back to back), ``positions [T]`` (each token's
position inside its document, for rotary embeddings), the documents' ``cu_seqlens`` and
``max_seqlen``. The attention module is marked for the ``hcp`` backend.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import hcp_compile


def rotate(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding of ``x [T, H, D]`` at ``positions [T]``."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


@hcp_compile.attention
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        sizes = [self.heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2]
        q, k, v = self.qkv(x).split(sizes, dim=-1)
        q = rotate(q.unflatten(-1, (self.heads, self.head_dim)), positions)
        k = rotate(k.unflatten(-1, (self.kv_heads, self.head_dim)), positions)
        v = v.unflatten(-1, (self.kv_heads, self.head_dim))
        attended = hcp_compile.varlen_attention(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True
        )
        return self.out(attended.flatten(1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(),
                                 nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        x = x + self.attention(self.attention_norm(x), positions, cu_seqlens, max_seqlen)
        return x + self.mlp(self.mlp_norm(x))


class PackedTransformer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)

    def forward(self, x: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        for layer in self.layers:
            x = layer(x, positions, cu_seqlens, max_seqlen)
        return self.norm(x)


def document_positions(cu_seqlens: Tensor) -> Tensor:
    """Position of every token of the packed batch inside its document."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts
