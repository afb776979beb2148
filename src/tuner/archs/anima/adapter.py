"""Anima's LLM adapter: Qwen3 hidden states in, the DiT's cross-attention context out.

Anima (CircleStone Labs) is Cosmos-Predict2-2B's DiT conditioned on a small Qwen3 (0.6B) instead of
T5-11B. The DiT still attends to 1024-wide "T5" rows: the adapter makes them. Its queries are learned
embeddings of the caption's **T5 token ids** (the T5-11B vocabulary, 32128 rows), refined by a few
transformer blocks that attend to the Qwen3 hidden states of the same caption:

    x = embed(t5_ids)                                    [B, T, D]
    per block:  x += self_attn(rms(x))                   RoPE on q, k at positions 0..T-1
                x += cross_attn(rms(x), qwen)            q at 0..T-1, k at the Qwen positions 0..S-1
                x += mlp(rms(x))                         Linear, exact GELU, Linear (4x)
    out = rms(out_proj(x))

Attention projections have no bias; q and k get a per-head RMSNorm before RoPE (θ = 10000, rotating
halves). The published network: D = 1024, 6 blocks, 16 heads of 64. Module names follow the ComfyUI
files' (`llm_adapter.blocks.0.self_attn.q_proj.weight`, `llm_adapter.blocks.0.mlp.0.weight`, ...), as
ComfyUI's `comfy/ldm/anima/model.py` (class `LLMAdapter`) and diffusion-pipe's `models/anima.py` read them.

ComfyUI runs the adapter on one caption at its true length, then zero-pads the output to 512 rows; a
batch here is padded, so the padded keys are masked and the padded output rows zeroed (`forward`'s
masks): every caption's rows are what it gets alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROPE_THETA = 10000.0
RMS_EPS = 1e-6


def rope_tables(length: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [length, head_dim] of rotary positions 0..length-1, both halves alike, in float32."""
    inv_freq = ROPE_THETA ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate [B, H, L, d] by the tables of `rope_tables(L, d)`: pairs (i, i + d/2) turn together."""
    cos, sin = (t.to(x.dtype) for t in rope)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    """Multi-head attention without biases, per-head RMSNorm on q and k, RoPE on both."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=RMS_EPS)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.k_norm = nn.RMSNorm(head_dim, eps=RMS_EPS)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, context, rope_q, rope_k, key_mask: torch.Tensor | None) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, L, D] -> [B, L, H, d]
            return t.unflatten(-1, (self.heads, -1))

        q = apply_rope(self.q_norm(heads(self.q_proj(x))).transpose(1, 2), rope_q)
        k = apply_rope(self.k_norm(heads(self.k_proj(context))).transpose(1, 2), rope_k)
        v = heads(self.v_proj(context)).transpose(1, 2)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class AdapterBlock(nn.Module):
    """Pre-norm self-attention, cross-attention to the Qwen3 states, and a GELU MLP, each residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm_self_attn = nn.RMSNorm(dim, eps=RMS_EPS)
        self.self_attn = Attention(dim, heads)
        self.norm_cross_attn = nn.RMSNorm(dim, eps=RMS_EPS)
        self.cross_attn = Attention(dim, heads)
        self.norm_mlp = nn.RMSNorm(dim, eps=RMS_EPS)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, qwen, rope_x, rope_qwen, x_mask, qwen_mask) -> torch.Tensor:
        normed = self.norm_self_attn(x)
        x = x + self.self_attn(normed, normed, rope_x, rope_x, x_mask)
        x = x + self.cross_attn(self.norm_cross_attn(x), qwen, rope_x, rope_qwen, qwen_mask)
        return x + self.mlp(self.norm_mlp(x))


class LLMAdapter(nn.Module):
    """Anima's adapter (see the module docstring): `vocab_size` T5 token embeddings of width `dim`,
    `layers` blocks of `heads` heads. The Qwen3 states must be `dim` wide too (1024 in the release)."""

    def __init__(self, vocab_size: int = 32128, dim: int = 1024, layers: int = 6, heads: int = 16):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(AdapterBlock(dim, heads) for _ in range(layers))
        self.out_proj = nn.Linear(dim, dim)
        self.norm = nn.RMSNorm(dim, eps=RMS_EPS)

    def forward(
        self,
        qwen: torch.Tensor,
        t5_ids: torch.Tensor,
        qwen_mask: torch.Tensor | None = None,
        t5_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, T, D] context rows from Qwen3 states [B, S, D] and T5 ids [B, T]; the boolean masks (True:
        a real token) mark the padding of a batch, whose output rows come back zero."""
        x = self.embed(t5_ids).to(qwen.dtype)
        head_dim = x.shape[-1] // self.heads
        rope_x = rope_tables(x.shape[1], head_dim, x.device)
        rope_qwen = rope_tables(qwen.shape[1], head_dim, x.device)
        for block in self.blocks:
            x = block(x, qwen, rope_x, rope_qwen, t5_mask, qwen_mask)
        out = self.norm(self.out_proj(x))
        return out if t5_mask is None else out * t5_mask[..., None].to(out.dtype)
