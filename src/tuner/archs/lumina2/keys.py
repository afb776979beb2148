"""Key names of Lumina Image 2.0 in diffusers' layout and in Alpha-VLLM's original layout, both directions.

The original release (`consolidated.00-of-01.pth`, ComfyUI's `lumina_2_model_bf16.safetensors`, and the
transformer part of ComfyUI's all-in-one `lumina_2.safetensors` under `model.diffusion_model.`) is the
NextDiT code's state dict. Facts of that layout (diffusers' single-file converter names them):

* every block (`noise_refiner.N`, `context_refiner.N`, `layers.N`) keeps q, k and v in one
  `attention.qkv` linear layer, rows q, k, v. Attention is grouped-query (24 query heads, 8 key/value
  heads of 96), so the rows split 3 : 1 : 1; tiny models keep that ratio;
* the output projection is `attention.out`, the q/k RMSNorms `attention.q_norm` / `k_norm`, the SwiGLU
  `feed_forward.w1 / w2 / w3` (diffusers' `linear_1 / 2 / 3`);
* the modulated blocks' `adaLN_modulation.1` is diffusers' `norm1.linear` (same row order: scale and
  gate of attention, scale and gate of the MLP), and their pre-attention norm `attention_norm1` is
  `norm1.norm`; the context refiner has no modulation, so its `attention_norm1` is `norm1` itself;
* embedders: `t_embedder.mlp.0 / 2` (timestep), `cap_embedder.0 / 1` (RMSNorm and linear over the
  Gemma features); the output layer `final_layer.adaLN_modulation.1` / `final_layer.linear` is
  diffusers' `norm_out.linear_1` / `linear_2`;
* the release also holds `norm_final.weight`, a norm the network never uses: reading drops it, and a
  whole checkpoint written in this layout holds it at its initial value (`Lumina2Layout`).

`LUMINA2_KEYS` is the adapter name map (renames plus the fused `qkv`); `LUMINA2_LAYOUT` converts whole
state dicts both ways (see `tuner.networks.layouts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.fused import FusedLayer
from tuner.networks.layouts import CheckpointLayout

MODULATED_BLOCKS = ("noise_refiner", "layers")
BLOCK_LISTS = ("noise_refiner", "context_refiner", "layers")

NORM_FINAL = "norm_final.weight"
UNUSED_ORIGINAL_KEYS = (NORM_FINAL,)
"""Tensors of the release that the network does not use (dropped when loading)."""

# (diffusers, original) inside every block; `{b}` is the block list, `{i}` a block index.
_BLOCK_RULES = (
    ("{b}.{i}.attn.to_out.0", "{b}.{i}.attention.out"),
    ("{b}.{i}.attn.norm_q", "{b}.{i}.attention.q_norm"),
    ("{b}.{i}.attn.norm_k", "{b}.{i}.attention.k_norm"),
    ("{b}.{i}.feed_forward.linear_1", "{b}.{i}.feed_forward.w1"),
    ("{b}.{i}.feed_forward.linear_2", "{b}.{i}.feed_forward.w2"),
    ("{b}.{i}.feed_forward.linear_3", "{b}.{i}.feed_forward.w3"),
    ("{b}.{i}.norm2", "{b}.{i}.attention_norm2"),
    ("{b}.{i}.ffn_norm1", "{b}.{i}.ffn_norm1"),
    ("{b}.{i}.ffn_norm2", "{b}.{i}.ffn_norm2"),
)
_MODULATED_RULES = (
    ("{b}.{i}.norm1.linear", "{b}.{i}.adaLN_modulation.1"),
    ("{b}.{i}.norm1.norm", "{b}.{i}.attention_norm1"),
)
_CONTEXT_RULES = (("context_refiner.{i}.norm1", "context_refiner.{i}.attention_norm1"),)

TRANSFORMER_RULES: tuple[tuple[str, str], ...] = (
    *(
        (d.replace("{b}", b), o.replace("{b}", b))
        for b in BLOCK_LISTS
        for d, o in _BLOCK_RULES + (_MODULATED_RULES if b in MODULATED_BLOCKS else ())
    ),
    *_CONTEXT_RULES,
    ("x_embedder", "x_embedder"),
    ("time_caption_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
    ("time_caption_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
    ("time_caption_embed.caption_embedder.0", "cap_embedder.0"),
    ("time_caption_embed.caption_embedder.1", "cap_embedder.1"),
    ("norm_out.linear_1", "final_layer.adaLN_modulation.1"),
    ("norm_out.linear_2", "final_layer.linear"),
)

QKV_PROPORTIONS = (3, 1, 1)  # 24 query heads, 8 key and 8 value heads
FUSED_LAYERS: tuple[FusedLayer, ...] = tuple(
    FusedLayer(
        f"{b}.{{i}}.attention.qkv",
        (f"{b}.{{i}}.attn.to_q", f"{b}.{{i}}.attn.to_k", f"{b}.{{i}}.attn.to_v"),
        proportions=QKV_PROPORTIONS,
    )
    for b in BLOCK_LISTS
)

LUMINA2_KEYS = ArchitectureKeys("lumina2", TRANSFORMER_RULES, FUSED_LAYERS)
"""The adapter name map (diffusers module name -> original), carrying the fused `qkv` layers."""


@dataclass(frozen=True)
class Lumina2Layout(CheckpointLayout):
    """The release's layout with its unused `norm_final.weight`: a whole checkpoint written in it gets
    that norm at its initial value (ones; the network never reads it), so the file has exactly the
    release's keys, and reading one drops it."""

    def to_original(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().to_original(state_dict)
        if (embedder := out.get("x_embedder.weight")) is not None:
            out[NORM_FINAL] = torch.ones(embedder.shape[0], dtype=embedder.dtype)
        return out

    def tensor_to_diffusers(self, key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        return {} if key in UNUSED_ORIGINAL_KEYS else super().tensor_to_diffusers(key, value)


LUMINA2_LAYOUT = Lumina2Layout(LUMINA2_KEYS)
"""The whole transformer checkpoint, both directions, at any size with the release's 3 : 1 : 1 heads."""

transformer_key_to_original = LUMINA2_LAYOUT.key_to_original
transformer_to_original = LUMINA2_LAYOUT.to_original
transformer_to_diffusers = LUMINA2_LAYOUT.to_diffusers
