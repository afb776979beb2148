"""Key names of FramePack's transformer: diffusers' layout and the HunyuanVideo (Tencent) names its adapters use.

FramePack (lllyasviel's `FramePackI2V_HY`) is HunyuanVideo's network plus three modules: the history
embedder `clean_x_embedder` (`proj`, `proj_2x`, `proj_4x`: patchify the clean history latents at 1×, 2×
and 4× compression) and the SigLIP projection `image_projection` (`up`, `down`). Its release (the
`lllyasviel/FramePackI2V_HY` folder, and Kijai's / ComfyUI's `FramePackI2V_HY_bf16.safetensors` made
from it) is saved by lllyasviel's own class, whose names are diffusers' (`transformer_blocks.0.attn.to_q`).

Adapters are exported in HunyuanVideo's Tencent names with fused `img_attn_qkv` / `txt_attn_qkv` /
`linear1`, exactly as `hunyuan_video` does (HunyuanVideo LoRAs are what FramePack tools take; kohya
stems in ComfyUI's spelling, `img_mlp_0`). ComfyUI's
FramePack wrapper reads a LoRA through diffusers' HunyuanVideo LoRA converter, which takes those names but
not the `.alpha` keys of fused layers, so for it (and diffusers) save with `save.format = "diffusers"`
(tests/test_framepack.py). The layout is therefore HunyuanVideo's table plus
the FramePack modules under their own names; a whole checkpoint converted with it is a HunyuanVideo-named
FramePack file, which the loader reads as well as the release's diffusers-named one.

musubi-tuner's FramePack model is lllyasviel's class (`musubi_tuner/frame_pack/hunyuan_video_packed.py`;
`networks/lora_framepack.py` targets its `HunyuanVideoTransformerBlock` / `HunyuanVideoSingleTransformerBlock`),
so its adapters are named in diffusers' names, unfused (`lora_unet_transformer_blocks_0_attn_to_q`): what `save.format = "musubi"` writes
(`MUSUBI_DIFFUSERS_NAMES`).
"""

from __future__ import annotations

from tuner.archs.hunyuan_video.keys import (
    COMFY_ATTENTION_NAMES,
    COMFY_FORMS,
    FINAL_MODULATION,
    FUSED_LAYERS,
    KOHYA_NAMES,
    TRANSFORMER_RULES,
)
from tuner.networks.architectures import MUSUBI_DIFFUSERS_NAMES, ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

# FramePack's own modules keep their names in both layouts
FRAMEPACK_MODULES = (
    "clean_x_embedder.proj",
    "clean_x_embedder.proj_2x",
    "clean_x_embedder.proj_4x",
    "image_projection.up",
    "image_projection.down",
)

FRAMEPACK_KEYS = ArchitectureKeys(
    "framepack",
    TRANSFORMER_RULES + tuple((m, m) for m in FRAMEPACK_MODULES),
    FUSED_LAYERS,
    kohya_names=KOHYA_NAMES,
    musubi=MUSUBI_DIFFUSERS_NAMES,
    comfy_forms=COMFY_FORMS,
    comfy_renames=COMFY_ATTENTION_NAMES,
)
"""The adapter name map (diffusers module name -> HunyuanVideo's Tencent name), carrying the fused layers."""

FRAMEPACK_LAYOUT = CheckpointLayout(FRAMEPACK_KEYS, swapped_halves=(FINAL_MODULATION,))
"""Whole transformer checkpoints in HunyuanVideo's names, both directions."""
