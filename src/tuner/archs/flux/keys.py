"""Key names of FLUX.1 in diffusers' layout and in Black Forest Labs' original layout, both directions.

diffusers' own converter goes original -> diffusers only and hard-codes the hidden size of the 12B
model (3072), so it fails on any other size; tuner needs both directions at any size (adapters are
exported under the original names ComfyUI loads; the test fixtures write the original layout). Facts of
the original layout (BFL's `flux/model.py`, matched against diffusers' converter):

* a double block keeps q, k and v of each stream in one `qkv` linear layer (rows q, k, v) and names the
  streams `img_*` / `txt_*`; its RMSNorm weights are called `scale`;
* a single block computes q, k, v and the MLP input with one `linear1` (rows q, k, v, mlp; the MLP is
  4× wide) and its output with `linear2` (diffusers: `proj_out`);
* the final modulation `final_layer.adaLN_modulation.1` emits (shift, scale) where diffusers'
  `norm_out.linear` emits (scale, shift): the two row halves are swapped.

The transformer tables are data, read in both directions. `FLUX_KEYS` is the adapter name map
(`tuner.networks.architectures.ArchitectureKeys`): one-to-one renames plus the fused layers, whose
adapters the exporter fuses exactly (see `tuner.networks.fused`). `FLUX_LAYOUT` adds the tensors only a
whole checkpoint has (norm scales, the final modulation) and converts whole state dicts both ways (see
`tuner.networks.layouts`): loading BFL's single file, saving a full fine-tune in it. The VAE is the LDM autoencoder layout
(`ae.safetensors`), mapped by index arithmetic: the original decoder lists its levels bottom-up.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

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
    ("transformer_blocks.{i}.ff.net.0.proj", "double_blocks.{i}.img_mlp.0"),
    ("transformer_blocks.{i}.ff.net.2", "double_blocks.{i}.img_mlp.2"),
    ("transformer_blocks.{i}.ff_context.net.0.proj", "double_blocks.{i}.txt_mlp.0"),
    ("transformer_blocks.{i}.ff_context.net.2", "double_blocks.{i}.txt_mlp.2"),
    ("transformer_blocks.{i}.norm1.linear", "double_blocks.{i}.img_mod.lin"),
    ("transformer_blocks.{i}.norm1_context.linear", "double_blocks.{i}.txt_mod.lin"),
    ("single_transformer_blocks.{i}.proj_out", "single_blocks.{i}.linear2"),
    ("single_transformer_blocks.{i}.norm.linear", "single_blocks.{i}.modulation.lin"),
    ("x_embedder", "img_in"),
    ("context_embedder", "txt_in"),
    ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
    ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
    ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),  # dev / Kontext only
    ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
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
    FusedLayer(
        "single_blocks.{i}.linear1",
        (
            "single_transformer_blocks.{i}.attn.to_q",
            "single_transformer_blocks.{i}.attn.to_k",
            "single_transformer_blocks.{i}.attn.to_v",
            "single_transformer_blocks.{i}.proj_mlp",
        ),
        proportions=(1, 1, 1, 4),  # the single blocks' MLP is 4× the hidden size
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

# The final modulation: same matrix, row halves swapped. Not in FLUX_KEYS: an adapter on it would need
# its up rows swapped too, so exporting one is refused (KeyError) rather than written wrong.
FINAL_MODULATION = ("norm_out.linear", "final_layer.adaLN_modulation.1")

FLUX_KEYS = ArchitectureKeys("flux", TRANSFORMER_RULES, FUSED_LAYERS, comfy_forms=COMFY_DIFFUSERS_FORMS)
"""The adapter name map (diffusers module name -> original), carrying the fused layers."""

FLUX_LAYOUT = CheckpointLayout(FLUX_KEYS, NORM_RULES, (FINAL_MODULATION,))
"""The whole transformer checkpoint, both directions, at any hidden size; also usable as the adapter
name map (it is FLUX_KEYS'), and `FLUX_LAYOUT.inverse` as the loaders' original -> diffusers map."""

# diffusers key -> BFL key; diffusers state dict -> BFL's; BFL's -> diffusers'
transformer_key_to_original = FLUX_LAYOUT.key_to_original
transformer_to_original = FLUX_LAYOUT.to_original
transformer_to_diffusers = FLUX_LAYOUT.to_diffusers


# ---------------------------------------------------------------------------------------------------
# VAE: diffusers AutoencoderKL <-> the LDM autoencoder of `ae.safetensors`
# ---------------------------------------------------------------------------------------------------

# (diffusers, original); {side} is encoder/decoder, {level} a resolution level, {j} a block index.
# `{up}` is diffusers' decoder index of original level {level}: levels - 1 - level.
VAE_RULES: tuple[tuple[str, str], ...] = (
    ("{side}.conv_norm_out", "{side}.norm_out"),
    ("{side}.mid_block.attentions.0.group_norm", "{side}.mid.attn_1.norm"),
    ("{side}.mid_block.attentions.0.to_q", "{side}.mid.attn_1.q"),
    ("{side}.mid_block.attentions.0.to_k", "{side}.mid.attn_1.k"),
    ("{side}.mid_block.attentions.0.to_v", "{side}.mid.attn_1.v"),
    ("{side}.mid_block.attentions.0.to_out.0", "{side}.mid.attn_1.proj_out"),
    ("{side}.mid_block.resnets.0", "{side}.mid.block_1"),
    ("{side}.mid_block.resnets.1", "{side}.mid.block_2"),
    ("encoder.down_blocks.{level}.resnets.{j}.conv_shortcut", "encoder.down.{level}.block.{j}.nin_shortcut"),
    ("encoder.down_blocks.{level}.resnets.{j}", "encoder.down.{level}.block.{j}"),
    ("encoder.down_blocks.{level}.downsamplers.0", "encoder.down.{level}.downsample"),
    ("decoder.up_blocks.{up}.resnets.{j}.conv_shortcut", "decoder.up.{level}.block.{j}.nin_shortcut"),
    ("decoder.up_blocks.{up}.resnets.{j}", "decoder.up.{level}.block.{j}"),
    ("decoder.up_blocks.{up}.upsamplers.0", "decoder.up.{level}.upsample"),
)
_GROUPS = {"side": r"(?P<side>encoder|decoder)", "level": r"(?P<level>\d+)", "up": r"(?P<up>\d+)",
           "j": r"(?P<j>\d+)"}  # fmt: skip
# The original attention projections are 1×1 convolutions; diffusers' are linear layers.
_ATTENTION_1X1 = re.compile(r"(encoder|decoder)\.mid\.attn_1\.(q|k|v|proj_out)\.weight")


def _vae_pattern(template: str) -> re.Pattern[str]:
    body = re.escape(template)
    for name, group in _GROUPS.items():
        body = body.replace(re.escape("{" + name + "}"), group)
    return re.compile(body + r"(?P<rest>\..+)")


_VAE_TO_ORIGINAL = [(_vae_pattern(d), o) for d, o in VAE_RULES]
_VAE_TO_DIFFUSERS = [(_vae_pattern(o), d) for d, o in VAE_RULES]


def _vae_rename(key: str, rules: list[tuple[re.Pattern[str], str]], levels: int) -> str:
    for pattern, target in rules:
        if m := pattern.fullmatch(key):
            groups = m.groupdict()
            if groups.get("up") is not None:
                groups["level"] = str(levels - 1 - int(groups["up"]))
            elif groups.get("level") is not None:
                groups["up"] = str(levels - 1 - int(groups["level"]))
            return target.format(**groups) + groups["rest"]
    return key  # conv_in, conv_out and (post_)quant_conv are named alike in both layouts


def vae_key_to_original(key: str, levels: int = 4) -> str:
    """Original (`ae.safetensors`) key of a diffusers AutoencoderKL key; `levels` = len(block_out_channels)."""
    return _vae_rename(key, _VAE_TO_ORIGINAL, levels)


def vae_to_original(state_dict: Mapping[str, torch.Tensor], levels: int = 4) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL state dict in the original layout (attention weights as 1×1 convs)."""
    out = {}
    for key, value in state_dict.items():
        name = vae_key_to_original(key, levels)
        out[name] = value[..., None, None] if _ATTENTION_1X1.fullmatch(name) else value
    return out


def vae_to_diffusers(state_dict: Mapping[str, torch.Tensor], levels: int = 4) -> dict[str, torch.Tensor]:
    """The inverse of `vae_to_original`."""
    out = {}
    for key, value in state_dict.items():
        if _ATTENTION_1X1.fullmatch(key) and value.ndim == 4:
            value = value[:, :, 0, 0]
        out[_vae_rename(key, _VAE_TO_DIFFUSERS, levels)] = value
    return out
