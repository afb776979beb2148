"""Key names of FLUX.2 in diffusers' layout and in Black Forest Labs' original layout, both directions.

The original layout (BFL's `flux2/model.py`; the keys diffusers' single-file converter reads) differs
from diffusers' as follows, the same for dev and klein:

* a double block keeps q, k and v of each stream in one `qkv` linear layer (rows q, k, v), names the
  streams `img_*` / `txt_*`, and calls its q/k RMSNorm weights `scale`; its MLPs are `img_mlp.0` /
  `img_mlp.2` (diffusers: `ff.linear_in` / `ff.linear_out`, SwiGLU with the gate fused into the input);
* a single block's `linear1` / `linear2` are diffusers' `attn.to_qkv_mlp_proj` / `attn.to_out`: diffusers
  keeps them fused too, so they are renames, not fused layers;
* the modulations are shared by all blocks of a kind: `double_stream_modulation_img.lin`,
  `..._txt.lin`, `single_stream_modulation.lin` (diffusers: `.linear`);
* the final modulation `final_layer.adaLN_modulation.1` emits (shift, scale) where diffusers'
  `norm_out.linear` emits (scale, shift): the two row halves are swapped, as in FLUX.1.

`FLUX2_LAYOUT` is the adapter name map and the whole-checkpoint converter (see `tuner.networks.layouts`).
The VAE is FLUX.1's LDM autoencoder layout (`tuner.archs.flux.keys`) plus the quant convolutions, which
the original keeps inside the encoder and decoder, and the latent BatchNorm statistics (`bn.*`, alike).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tuner.archs.flux.keys import vae_key_to_original as _ldm_vae_key_to_original
from tuner.archs.flux.keys import vae_to_diffusers as _ldm_vae_to_diffusers
from tuner.archs.flux.keys import vae_to_original as _ldm_vae_to_original
from tuner.networks.architectures import COMFY_DIFFUSERS_FORMS, ArchitectureKeys
from tuner.networks.fused import FusedLayer
from tuner.networks.layouts import CheckpointLayout

# ---------------------------------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------------------------------

# (diffusers, original) for modules renamed one to one; `{i}` is a block index.
TRANSFORMER_RULES: tuple[tuple[str, str], ...] = (
    ("transformer_blocks.{i}.attn.to_out.0", "double_blocks.{i}.img_attn.proj"),
    ("transformer_blocks.{i}.attn.to_add_out", "double_blocks.{i}.txt_attn.proj"),
    ("transformer_blocks.{i}.ff.linear_in", "double_blocks.{i}.img_mlp.0"),
    ("transformer_blocks.{i}.ff.linear_out", "double_blocks.{i}.img_mlp.2"),
    ("transformer_blocks.{i}.ff_context.linear_in", "double_blocks.{i}.txt_mlp.0"),
    ("transformer_blocks.{i}.ff_context.linear_out", "double_blocks.{i}.txt_mlp.2"),
    ("single_transformer_blocks.{i}.attn.to_qkv_mlp_proj", "single_blocks.{i}.linear1"),
    ("single_transformer_blocks.{i}.attn.to_out", "single_blocks.{i}.linear2"),
    ("double_stream_modulation_img.linear", "double_stream_modulation_img.lin"),
    ("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin"),
    ("single_stream_modulation.linear", "single_stream_modulation.lin"),
    ("x_embedder", "img_in"),
    ("context_embedder", "txt_in"),
    ("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    ("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),  # dev only
    ("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    ("proj_out", "final_layer.linear"),
)

# Original layers that diffusers splits into row blocks (top to bottom).
FUSED_LAYERS: tuple[FusedLayer, ...] = (
    FusedLayer(
        "double_blocks.{i}.img_attn.qkv",
        (
            "transformer_blocks.{i}.attn.to_q",
            "transformer_blocks.{i}.attn.to_k",
            "transformer_blocks.{i}.attn.to_v",
        ),
    ),
    FusedLayer(
        "double_blocks.{i}.txt_attn.qkv",
        (
            "transformer_blocks.{i}.attn.add_q_proj",
            "transformer_blocks.{i}.attn.add_k_proj",
            "transformer_blocks.{i}.attn.add_v_proj",
        ),
    ),
)

# Tensors whose own name changes: the q/k RMSNorms' diffusers `weight` is the original `scale`.
NORM_RULES: tuple[tuple[str, str], ...] = (
    ("transformer_blocks.{i}.attn.norm_q.weight", "double_blocks.{i}.img_attn.norm.query_norm.scale"),
    ("transformer_blocks.{i}.attn.norm_k.weight", "double_blocks.{i}.img_attn.norm.key_norm.scale"),
    ("transformer_blocks.{i}.attn.norm_added_q.weight", "double_blocks.{i}.txt_attn.norm.query_norm.scale"),
    ("transformer_blocks.{i}.attn.norm_added_k.weight", "double_blocks.{i}.txt_attn.norm.key_norm.scale"),
    ("single_transformer_blocks.{i}.attn.norm_q.weight", "single_blocks.{i}.norm.query_norm.scale"),
    ("single_transformer_blocks.{i}.attn.norm_k.weight", "single_blocks.{i}.norm.key_norm.scale"),
)

# The final modulation: same matrix, row halves swapped (not an adapter target, see flux_keys).
FINAL_MODULATION = ("norm_out.linear", "final_layer.adaLN_modulation.1")

FLUX2_KEYS = ArchitectureKeys("flux2", TRANSFORMER_RULES, FUSED_LAYERS, comfy_forms=COMFY_DIFFUSERS_FORMS)
"""The adapter name map (diffusers module name -> original), carrying the fused layers."""

FLUX2_LAYOUT = CheckpointLayout(FLUX2_KEYS, NORM_RULES, (FINAL_MODULATION,))
"""The whole transformer checkpoint, both directions, at any size (dev and klein alike)."""

transformer_key_to_original = FLUX2_LAYOUT.key_to_original
transformer_to_original = FLUX2_LAYOUT.to_original
transformer_to_diffusers = FLUX2_LAYOUT.to_diffusers


# ---------------------------------------------------------------------------------------------------
# VAE: diffusers AutoencoderKLFlux2 <-> BFL's FLUX.2 `ae.safetensors`
# ---------------------------------------------------------------------------------------------------

# (diffusers, original) whole-key renames beyond FLUX.1's LDM layout
VAE_EXTRA_RULES: dict[str, str] = {
    "quant_conv.weight": "encoder.quant_conv.weight",
    "quant_conv.bias": "encoder.quant_conv.bias",
    "post_quant_conv.weight": "decoder.post_quant_conv.weight",
    "post_quant_conv.bias": "decoder.post_quant_conv.bias",
}
_VAE_EXTRA_INVERSE = {o: d for d, o in VAE_EXTRA_RULES.items()}


def vae_key_to_original(key: str, levels: int = 4) -> str:
    """Original key of a diffusers AutoencoderKLFlux2 key (`bn.*` keeps its name)."""
    return VAE_EXTRA_RULES.get(key) or _ldm_vae_key_to_original(key, levels)


def vae_to_original(state_dict: Mapping[str, torch.Tensor], levels: int = 4) -> dict[str, torch.Tensor]:
    extra = {VAE_EXTRA_RULES[k]: v for k, v in state_dict.items() if k in VAE_EXTRA_RULES}
    rest = {k: v for k, v in state_dict.items() if k not in VAE_EXTRA_RULES}
    return {**_ldm_vae_to_original(rest, levels), **extra}


def vae_to_diffusers(state_dict: Mapping[str, torch.Tensor], levels: int = 4) -> dict[str, torch.Tensor]:
    extra = {_VAE_EXTRA_INVERSE[k]: v for k, v in state_dict.items() if k in _VAE_EXTRA_INVERSE}
    rest = {k: v for k, v in state_dict.items() if k not in _VAE_EXTRA_INVERSE}
    return {**_ldm_vae_to_diffusers(rest, levels), **extra}
