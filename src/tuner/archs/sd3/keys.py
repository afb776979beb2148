"""Key names of Stable Diffusion 3.5's MMDiT in diffusers' layout and in Stability AI's release layout.

The release (`sd3.5_medium.safetensors`, `sd3.5_large.safetensors`; ComfyUI adds `model.diffusion_model.`)
names the joint blocks `joint_blocks.{i}` with an image stream `x_block` and a text stream
`context_block`. Facts of that layout (checked against diffusers' single-file converter):

* each stream keeps q, k and v in one `attn.qkv` linear layer (rows q, k, v); Medium's extra image
  self-attention `x_block.attn2` does too. The q/k RMSNorms are `ln_q` / `ln_k`;
* the patch embedding is `x_embedder.proj` and its fixed position table the bare tensor `pos_embed`
  (diffusers: `pos_embed.proj`, `pos_embed.pos_embed`);
* modulations emit (shift, scale) where diffusers' continuous AdaLayerNorm emits (scale, shift): the
  row halves of `final_layer.adaLN_modulation.1` and of the **last** block's text-stream modulation are
  swapped. The last block's text stream only feeds the image stream's attention ("pre-only": no output
  projection, no MLP), and its modulation is 2·dim rows instead of 6·dim, which is how it is told apart
  at any model size.

`SD3_KEYS` is the adapter name map: renames plus the fused qkv layers, which the exporter fuses exactly.
Modulations are not in it (an adapter on a swapped one would need its up rows swapped): exporting one is
refused rather than written wrong. `SD3_LAYOUT` converts whole checkpoints both ways.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.fused import FusedLayer
from tuner.networks.layouts import CheckpointLayout

# (diffusers, original) for modules renamed one to one; `{i}` is a block index.
TRANSFORMER_RULES: tuple[tuple[str, str], ...] = (
    ("transformer_blocks.{i}.attn.to_out.0", "joint_blocks.{i}.x_block.attn.proj"),
    ("transformer_blocks.{i}.attn.to_add_out", "joint_blocks.{i}.context_block.attn.proj"),
    ("transformer_blocks.{i}.attn.norm_q", "joint_blocks.{i}.x_block.attn.ln_q"),
    ("transformer_blocks.{i}.attn.norm_k", "joint_blocks.{i}.x_block.attn.ln_k"),
    ("transformer_blocks.{i}.attn.norm_added_q", "joint_blocks.{i}.context_block.attn.ln_q"),
    ("transformer_blocks.{i}.attn.norm_added_k", "joint_blocks.{i}.context_block.attn.ln_k"),
    ("transformer_blocks.{i}.attn2.to_out.0", "joint_blocks.{i}.x_block.attn2.proj"),  # Medium only
    ("transformer_blocks.{i}.attn2.norm_q", "joint_blocks.{i}.x_block.attn2.ln_q"),
    ("transformer_blocks.{i}.attn2.norm_k", "joint_blocks.{i}.x_block.attn2.ln_k"),
    ("transformer_blocks.{i}.ff.net.0.proj", "joint_blocks.{i}.x_block.mlp.fc1"),
    ("transformer_blocks.{i}.ff.net.2", "joint_blocks.{i}.x_block.mlp.fc2"),
    ("transformer_blocks.{i}.ff_context.net.0.proj", "joint_blocks.{i}.context_block.mlp.fc1"),
    ("transformer_blocks.{i}.ff_context.net.2", "joint_blocks.{i}.context_block.mlp.fc2"),
    ("pos_embed.proj", "x_embedder.proj"),
    ("context_embedder", "context_embedder"),
    ("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
    ("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
    ("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"),
    ("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"),
    ("proj_out", "final_layer.linear"),
)


def _qkv(original: str, diffusers: str, names: tuple[str, str, str]) -> FusedLayer:
    return FusedLayer(original, tuple(f"{diffusers}.{n}" for n in names))


# Original layers that diffusers splits into q, k, v (top to bottom).
FUSED_LAYERS: tuple[FusedLayer, ...] = (
    _qkv("joint_blocks.{i}.x_block.attn.qkv", "transformer_blocks.{i}.attn", ("to_q", "to_k", "to_v")),
    _qkv("joint_blocks.{i}.context_block.attn.qkv", "transformer_blocks.{i}.attn",
         ("add_q_proj", "add_k_proj", "add_v_proj")),
    _qkv("joint_blocks.{i}.x_block.attn2.qkv", "transformer_blocks.{i}.attn2", ("to_q", "to_k", "to_v")),
)  # fmt: skip

# Whole tensors renamed outside the adapter map: the position table, and the modulations (adapters on
# them are refused; see the module docstring).
TENSOR_RULES: tuple[tuple[str, str], ...] = (
    ("pos_embed.pos_embed", "pos_embed"),
    ("transformer_blocks.{i}.norm1.linear.weight", "joint_blocks.{i}.x_block.adaLN_modulation.1.weight"),
    ("transformer_blocks.{i}.norm1.linear.bias", "joint_blocks.{i}.x_block.adaLN_modulation.1.bias"),
    ("transformer_blocks.{i}.norm1_context.linear.weight",
     "joint_blocks.{i}.context_block.adaLN_modulation.1.weight"),
    ("transformer_blocks.{i}.norm1_context.linear.bias", "joint_blocks.{i}.context_block.adaLN_modulation.1.bias"),
)  # fmt: skip

FINAL_MODULATION = ("norm_out.linear", "final_layer.adaLN_modulation.1")

# The text-stream modulation of a block, in each layout; `{i}` is the block index.
_CONTEXT_MODULATION = {
    "diffusers": re.compile(r"transformer_blocks\.(\d+)\.norm1_context\.linear\.(weight|bias)"),
    "original": re.compile(r"joint_blocks\.(\d+)\.context_block\.adaLN_modulation\.1\.(weight|bias)"),
}


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first])


def _is_pre_only(weight: torch.Tensor) -> bool:
    """A pre-only block's text modulation emits (shift, scale): 2·dim rows; the others 6·dim."""
    return weight.ndim == 2 and weight.shape[0] == 2 * weight.shape[1]


def _swap_pre_only(state_dict: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """`state_dict` with the text modulation of every pre-only block (weight and bias) swapped by halves;
    the blocks are found from their weights' shapes."""
    pattern = _CONTEXT_MODULATION[layout]
    blocks = {
        m.group(1)
        for key, value in state_dict.items()
        if (m := pattern.fullmatch(key)) and m.group(2) == "weight" and _is_pre_only(value)
    }
    return {
        key: _swap_halves(value) if (m := pattern.fullmatch(key)) and m.group(1) in blocks else value
        for key, value in state_dict.items()
    }


@dataclass(frozen=True)
class MMDiTLayout(CheckpointLayout):
    """SD3's layout: a `CheckpointLayout` that also swaps the last block's text modulation, a tensor whose
    block can only be told from the weight's shape (a bias alone cannot say), so whole checkpoints
    convert through `to_original` / `to_diffusers`, and a lone weight (ComfyUI fp8 layers) through
    `tensor_to_diffusers`."""

    def to_original(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _swap_pre_only(super().to_original(state_dict), "original")

    def to_diffusers(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        renamed = {
            k: v
            for key, value in state_dict.items()
            for k, v in CheckpointLayout.tensor_to_diffusers(self, key, value).items()
        }
        return _swap_pre_only(renamed, "diffusers")

    def tensor_to_diffusers(self, key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        out = CheckpointLayout.tensor_to_diffusers(self, key, value)
        if _CONTEXT_MODULATION["original"].fullmatch(key):
            if value.ndim == 1:
                raise KeyError(f"{key}: a modulation bias converts only with its weight (whole checkpoints)")
            if _is_pre_only(value):
                return {name: _swap_halves(tensor) for name, tensor in out.items()}
        return out


SD3_KEYS = ArchitectureKeys(
    "sd3",
    TRANSFORMER_RULES,
    FUSED_LAYERS,
    # ComfyUI's `SD3` maps `mmdit_to_diffusers`' names (diffusers', the fused qkv's rows too)
    comfy_forms=("transformer.{d}", "base_model.model.{d}", "lora_transformer_{d_}"),
)
"""The adapter name map (diffusers module name -> release's), carrying the fused qkv layers."""

SD3_LAYOUT = MMDiTLayout(SD3_KEYS, TENSOR_RULES, (FINAL_MODULATION,))
"""The whole transformer checkpoint, both directions, at any size (Medium's attn2 included)."""

transformer_key_to_original = SD3_LAYOUT.key_to_original
transformer_to_original = SD3_LAYOUT.to_original
transformer_to_diffusers = SD3_LAYOUT.to_diffusers
