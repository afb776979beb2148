"""Key names of Wan 2.1 in diffusers' layout and in the official release's layout.

diffusers renames every module of the official `WanModel` (`blocks.0.self_attn.q` becomes
`blocks.0.attn1.to_q`) and only converts original -> diffusers. tuner needs the other direction too:
LoRA files must use the original names to load in ComfyUI and the official code, and the test fixtures
write single files in the original layout. The transformer mapping is one table of rules, read in both
directions; the VAE mapping is index arithmetic (diffusers groups the decoder's flat list into blocks).

Official layout facts used here (from the Wan 2.1 release code): each block holds `norm1` (no weights),
`self_attn`, `norm3` (the affine cross-attention norm), `cross_attn`, `norm2` (no weights) and an
`ffn = Sequential(Linear, GELU, Linear)`; diffusers calls the cross-attention norm `norm2`. The VAE's
residual blocks are `Sequential(RMS_norm, SiLU, conv, RMS_norm, SiLU, Dropout, conv)`, so their norms and
convs sit at indices 0, 2, 3 and 6.

The Wan 2.2 VAE (`Wan2.2_VAE.pth`, ComfyUI's `wan2.2_vae.safetensors`; from the Wan 2.2 release's
`vae2_2.py` and diffusers' conversion script) nests one more level: each encoder level is
`encoder.downsamples.<i>.downsamples.<j>` (residual blocks, then the resample as the last entry) and
each decoder level `decoder.upsamples.<i>.upsamples.<j>` (`num_res_blocks + 1` residual blocks, then the
resample); the average/duplicate shortcuts between levels hold no weights. Middle, head and the
quant convs are named as in 2.1.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

# ---------------------------------------------------------------------------------------------------
# Transformer: (diffusers name, original name); `{i}` is a block index. A rule matches a whole dotted
# name or its leading part (so `blocks.0.attn1.to_q.weight` uses the `blocks.{i}.attn1.to_q` rule).
# ---------------------------------------------------------------------------------------------------
# The rules inside one block (`blocks.{i}.` + these), shared by the control branch's `vace_blocks`
_BLOCK_RULES: tuple[tuple[str, str], ...] = (
    ("attn1.to_q", "self_attn.q"),
    ("attn1.to_k", "self_attn.k"),
    ("attn1.to_v", "self_attn.v"),
    ("attn1.to_out.0", "self_attn.o"),
    ("attn2.to_q", "cross_attn.q"),
    ("attn2.to_k", "cross_attn.k"),
    ("attn2.to_v", "cross_attn.v"),
    ("attn2.to_out.0", "cross_attn.o"),
    ("attn2.add_k_proj", "cross_attn.k_img"),  # image-to-video only
    ("attn2.add_v_proj", "cross_attn.v_img"),  # image-to-video only
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("attn1.norm_q", "self_attn.norm_q"),
    ("attn1.norm_k", "self_attn.norm_k"),
    ("attn2.norm_q", "cross_attn.norm_q"),
    ("attn2.norm_k", "cross_attn.norm_k"),
    ("attn2.norm_added_k", "cross_attn.norm_k_img"),
    ("norm2", "norm3"),  # the affine cross-attention norm
    ("scale_shift_table", "modulation"),
)
# VACE blocks (diffusers' WanVACETransformerBlock; the release's VaceWanAttentionBlock, ComfyUI's
# comfy/ldm/wan/model.py VaceWanModel): a Wan block plus `before_proj` (block 0) and `after_proj`
_VACE_BLOCK_RULES = (*_BLOCK_RULES, ("proj_in", "before_proj"), ("proj_out", "after_proj"))

TRANSFORMER_RULES: tuple[tuple[str, str], ...] = (
    # nn.Linear modules (what LoRA targets)
    *((f"blocks.{{i}}.{d}", f"blocks.{{i}}.{o}") for d, o in _BLOCK_RULES),
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),  # image-to-video only
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),  # image-to-video only
    ("proj_out", "head.head"),
    # everything else in the state dict
    ("patch_embedding", "patch_embedding"),
    ("scale_shift_table", "head.modulation"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    ("condition_embedder.image_embedder.pos_embed", "img_emb.emb_pos"),  # first-last-frame only
    # Wan 2.1 VACE's control branch: `vace_blocks` are Wan blocks with an input projection (block 0 only)
    # and an output projection (the release's `before_proj` / `after_proj`), fed by `vace_patch_embedding`
    *((f"vace_blocks.{{i}}.{d}", f"vace_blocks.{{i}}.{o}") for d, o in _VACE_BLOCK_RULES),
    ("vace_patch_embedding", "vace_patch_embedding"),
)


# The rule engine is the one every architecture uses (`tuner.networks.architectures`).
WAN_KEYS = ArchitectureKeys("wan", TRANSFORMER_RULES)
# Whole checkpoints (`tuner.networks.layouts`): Wan's release only renames, so the table is all it needs.
WAN_LAYOUT = CheckpointLayout(WAN_KEYS)


def original_module_name(diffusers_name: str) -> str:
    """Official Wan 2.1 name of a diffusers WanTransformer3DModel module or tensor key.

    `blocks.0.attn1.to_q` -> `blocks.0.self_attn.q`; `proj_out.weight` -> `head.head.weight`.
    Raises KeyError for names outside the table (for example fused `to_qkv` projections).
    """
    return WAN_KEYS(diffusers_name)


def diffusers_module_name(original_name: str) -> str:
    """The inverse of `original_module_name`."""
    return WAN_KEYS.to_diffusers(original_name)


# A diffusers WanTransformer3DModel state dict with the official release's key names.
transformer_to_original = WAN_LAYOUT.to_original


# ---------------------------------------------------------------------------------------------------
# VAE: diffusers AutoencoderKLWan key -> original Wan 2.1 VAE key (Wan2.1_VAE.pth layout).
# ---------------------------------------------------------------------------------------------------
_RESNET_PARTS = {
    "norm1": "residual.0",
    "conv1": "residual.2",
    "norm2": "residual.3",
    "conv2": "residual.6",
    "conv_shortcut": "shortcut",
}
_VAE_FIXED = {
    "quant_conv": "conv1",
    "post_quant_conv": "conv2",
    "encoder.conv_in": "encoder.conv1",
    "decoder.conv_in": "decoder.conv1",
    "encoder.norm_out": "encoder.head.0",
    "encoder.conv_out": "encoder.head.2",
    "decoder.norm_out": "decoder.head.0",
    "decoder.conv_out": "decoder.head.2",
    "encoder.mid_block.attentions.0": "encoder.middle.1",
    "decoder.mid_block.attentions.0": "decoder.middle.1",
}
_MID_RESNET = re.compile(r"^(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(\w+)\.(\w+)$")
_DOWN = re.compile(r"^encoder\.down_blocks\.(\d+)\.(\w+)\.(.+)$")
_UP_RESNET = re.compile(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(\w+)$")
_UP_SAMPLER = re.compile(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)$")


def vae_key_to_original(key: str, num_res_blocks: int = 2) -> str:
    """Original Wan 2.1 VAE key of a diffusers AutoencoderKLWan (2.1, `attn_scales=[]`) key.

    The original decoder is one flat list: per level `num_res_blocks + 1` residual blocks, then one
    upsampler; diffusers nests them as `up_blocks.<level>.resnets.<j>` / `.upsamplers.0`.
    """
    for prefix, original in _VAE_FIXED.items():
        if key.startswith(prefix + "."):
            return original + key[len(prefix) :]
    per_level = num_res_blocks + 2
    if m := _MID_RESNET.match(key):
        side, j, part, param = m.groups()
        return f"{side}.middle.{2 * int(j)}.{_RESNET_PARTS[part]}.{param}"
    if m := _DOWN.match(key):  # the encoder is flat in both layouts; only residual parts are renamed
        n, part, rest = m.groups()
        return f"encoder.downsamples.{n}.{_RESNET_PARTS.get(part, part)}.{rest}"
    if m := _UP_RESNET.match(key):
        level, j, part, param = m.groups()
        return f"decoder.upsamples.{int(level) * per_level + int(j)}.{_RESNET_PARTS[part]}.{param}"
    if m := _UP_SAMPLER.match(key):
        level, rest = m.groups()
        return f"decoder.upsamples.{int(level) * per_level + num_res_blocks + 1}.{rest}"
    raise KeyError(f"no Wan VAE key rule maps {key!r} to the original layout")


def vae_to_original(
    state_dict: Mapping[str, torch.Tensor], num_res_blocks: int = 2
) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKLWan state dict with the original Wan 2.1 VAE key names."""
    return {vae_key_to_original(k, num_res_blocks): v for k, v in state_dict.items()}


# ---------------------------------------------------------------------------------------------------
# Wan 2.2 VAE (`is_residual`): diffusers AutoencoderKLWan key -> original Wan2.2_VAE.pth key.
# ---------------------------------------------------------------------------------------------------
_LEVEL22 = re.compile(
    r"^(encoder\.down|decoder\.up)_blocks\.(\d+)\.(resnets\.(\d+)\.(\w+)|downsampler|upsampler)\.(.+)$"
)


def vae22_key_to_original(key: str, num_res_blocks: int = 2) -> str:
    """Original Wan 2.2 VAE key of a diffusers AutoencoderKLWan (`is_residual=True`) key.

    `encoder.down_blocks.1.resnets.0.norm1.gamma` -> `encoder.downsamples.1.downsamples.0.residual.0.gamma`;
    `decoder.up_blocks.0.upsampler.time_conv.weight` -> `decoder.upsamples.0.upsamples.3.time_conv.weight`.
    """
    m = _LEVEL22.match(key)
    if m is None:  # middle, head and quant convs are named as in Wan 2.1
        if key.startswith(("encoder.down_blocks.", "decoder.up_blocks.")):
            raise KeyError(f"no Wan 2.2 VAE key rule maps {key!r} to the original layout")
        return vae_key_to_original(key, num_res_blocks)
    side, level, inner, j, part, rest = m.groups()
    name = "downsamples" if side == "encoder.down" else "upsamples"
    if j is not None:
        index, rest = j, f"{_RESNET_PARTS[part]}.{rest}"
    else:  # the resample follows the level's residual blocks (one more of them in the decoder)
        index = num_res_blocks if name == "downsamples" else num_res_blocks + 1
    return f"{side.split('.')[0]}.{name}.{level}.{name}.{index}.{rest}"


def vae22_to_original(
    state_dict: Mapping[str, torch.Tensor], num_res_blocks: int = 2
) -> dict[str, torch.Tensor]:
    """A diffusers Wan 2.2 AutoencoderKLWan state dict with the original Wan 2.2 VAE key names."""
    return {vae22_key_to_original(k, num_res_blocks): v for k, v in state_dict.items()}
