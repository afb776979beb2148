"""HunyuanImage 2.1's transformer in Tencent's names and diffusers': the adapter name map and the layout.

The release (`tencent/HunyuanImage-2.1`: `dit/hunyuanimage2.1.safetensors`, the distilled
`dit/hunyuanimage2.1-distilled.safetensors`) and Comfy-Org's repackaged files
(`hunyuanimage2.1_bf16.safetensors`, `..._fp8_e4m3fn`, the distilled ones) hold the network of Tencent's
`hyimage/models/hunyuan/modules/hunyuanimage_dit.py` in HunyuanVideo 1.0's module names and fusions
(`tuner.archs.hunyuan_video.keys`): a double block's q, k and v in one `img_attn_qkv` / `txt_attn_qkv`,
a single block's q, k, v and MLP input in one `linear1` and its output in `linear2`, the token refiner's
`self_attn_qkv`, and the final modulation's (shift, scale) halves in the other order than diffusers'.
Where that comes from (public code, read for the facts): Tencent's loader splits exactly those fused
tensors into its own `img_attn_q` / `linear1_q` / `linear1_mlp` / `linear2.fc` parameters when it reads
the file (`convert_hunyuan_dict_for_tensor_parallel`, copied into diffusers'
`scripts/convert_hunyuan_image_to_diffusers.py`, whose key map is the rest of this table); sd-scripts'
`library/hunyuan_image_models.py` loads the release file strictly into modules of exactly these fused
names (`img_attn_qkv`, `linear1`, `linear2`, `img_mlp.fc1`), so its `lora_unet_` files spell the
release's `img_mlp_fc1` (the musubi layout's spelling here; it reads back either way); ComfyUI builds
HunyuanImage 2.1 from its HunyuanVideo class (`comfy/ldm/hunyuan_video/model.py`, 2D patches, the ByT5
mapper), so it renames the release's modules as 1.0's (`COMFY_RENAMES`: `img_attn.qkv`, `img_mlp.0`,
`img_mod.lin`). Its model class (`comfy.model_base.HunyuanImage21`) is no `HunyuanVideo` subclass, so the
extra stems `comfy/lora.py` maps for HunyuanVideo (the release's names under `diffusion_model.` /
`transformer.`) are not held for it: its key map is every model's, `diffusion_model.` and `lora_unet_`
over its own module names (no `comfy_forms`). The kohya layout spells those, so it is the default.

What 2.1 changes against HunyuanVideo 1.0: no pooled-CLIP `vector_in`; the ByT5 glyph mapper
`byt5_in.{layernorm,fc1,fc2,fc3}` (diffusers' `context_embedder_2`, named as HunyuanVideo 1.5's); the
distilled model's guidance embedder `guidance_in` and MeanFlow's second timestep embedder `time_r_in`;
diffusers calls the time embedder `time_guidance_embed`. diffusers has no single-file converter and no
HunyuanImage LoRA loader.
"""

from __future__ import annotations

from tuner.archs.hunyuan_video import keys as hunyuan_video
from tuner.archs.hunyuan_video15.keys import TRANSFORMER_RULES as HUNYUAN_VIDEO15_RULES
from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

_TIME = "time_text_embed."  # HunyuanVideo's diffusers name of the time / guidance embedders
_POOLED_TEXT = "time_text_embed.text_embedder."  # 1.0's CLIP `vector_in`: 2.1 has none


def _from_hunyuan_video(diffusers: str) -> str | None:
    """A HunyuanVideo rule's diffusers name in HunyuanImage's transformer, or None where 2.1 has none."""
    if diffusers.startswith(_POOLED_TEXT):
        return None
    return (
        "time_guidance_embed." + diffusers.removeprefix(_TIME) if diffusers.startswith(_TIME) else diffusers
    )


TRANSFORMER_RULES: tuple[tuple[str, str], ...] = (
    *((d, o) for d0, o in hunyuan_video.TRANSFORMER_RULES if (d := _from_hunyuan_video(d0)) is not None),
    # the ByT5 glyph mapper, named as in HunyuanVideo 1.5
    *((d, o) for d, o in HUNYUAN_VIDEO15_RULES if d.startswith("context_embedder_2.")),
    # the distilled model's MeanFlow embedder of the interval's end r
    ("time_guidance_embed.timestep_embedder_r.linear_1", "time_r_in.mlp.0"),
    ("time_guidance_embed.timestep_embedder_r.linear_2", "time_r_in.mlp.2"),
)

# (diffusers, ComfyUI's name) where ComfyUI names a module otherwise than the release: 1.0's rules
KOHYA_NAMES = tuple(
    (d, hunyuan_video.comfy_name(o)) for d, o in TRANSFORMER_RULES if hunyuan_video.comfy_name(o) != o
)

HUNYUAN_IMAGE_KEYS = ArchitectureKeys(
    "hunyuan_image",
    TRANSFORMER_RULES,
    hunyuan_video.FUSED_LAYERS,
    kohya_names=KOHYA_NAMES,
    comfy_renames=hunyuan_video.COMFY_ATTENTION_NAMES,
)
"""The adapter name map (diffusers module name -> Tencent's, q/k/v and `linear1` fused as the release)."""

HUNYUAN_IMAGE_LAYOUT = CheckpointLayout(HUNYUAN_IMAGE_KEYS, swapped_halves=(hunyuan_video.FINAL_MODULATION,))
"""The whole transformer checkpoint, both directions, at any size: the release's and ComfyUI's files."""
