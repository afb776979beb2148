"""HunyuanVideo 1.5's transformer in Tencent's names and diffusers': the adapter name map and the layout.

Two single-file layouts are in users' hands, both in Tencent's module names, told apart by their keys:

* Tencent's release (`transformer/480p_t2v/diffusion_pytorch_model.safetensors`, ...) holds each double
  block's q, k and v as separate linears (`double_blocks.N.img_attn_q` / `_k` / `_v`, `txt_attn_q` ...);
* Comfy-Org's repackaged files (`hunyuanvideo1.5_720p_t2v_fp16.safetensors`, the 480p, I2V and
  distilled ones: what `tuner download hunyuan_video15 --comfy` fetches) hold them fused, rows q, k, v,
  as HunyuanVideo 1.0 does: `double_blocks.N.img_attn_qkv` / `txt_attn_qkv` (weights and biases).

Where that comes from (public code, read for the facts): ComfyUI builds HunyuanVideo 1.5 from the same
`HunyuanVideo` class as 1.0 (`comfy/ldm/hunyuan_video/model.py`, whose double blocks are FLUX's
`DoubleStreamBlock` with one `img_attn.qkv` linear); its `comfy/supported_models.py` renames a file's
`_attn_qkv.` to `_attn.qkv.` and has no rule that joins separate q/k/v, and its `comfy/lora.py` maps
adapter names onto that model (`lora_unet_<its module name, "." -> "_">`, `diffusion_model.<its module
name>`, and for every `HunyuanVideo` model Tencent's spelling under `diffusion_model.` / `transformer.`).
musubi-tuner's `src/musubi_tuner/hunyuan_video_1_5/hunyuan_video_1_5_models.py` recognises a "ComfyUI
repackaged" file by `double_blocks.0.img_attn_qkv.weight` (an official one by `img_attn_k`) and splits
`img_attn_qkv` / `txt_attn_qkv` into q, k, v when it loads it.

So the layout tuner reads takes both (the renames list Tencent's separate q/k/v, the fused layers
ComfyUI's `*_attn_qkv`; `tensor_to_diffusers` splits a fused tensor, fp8 rows and scale included), and
everything tuner writes (adapters, full fine-tunes) is ComfyUI's: q/k/v fused, the way the exporter
fuses them for FLUX and HunyuanVideo 1.0. Adapters in Tencent's names (musubi-tuner's, tuner's older
files) still read. ComfyUI's `lora_unet_` names are its own module names, which differ from Tencent's
for the MLPs (`img_mlp.0` / `.2` for `img_mlp.fc1` / `.fc2`), as for 1.0: kohya stems spell them
(`KOHYA_NAMES`, `ArchitectureKeys.kohya_names`; the release's spelling reads back); comfy stems keep Tencent's names, which ComfyUI maps too.

musubi-tuner's model has Tencent's module names: it loads either file with `load_state_dict(strict=True)`
after splitting only the double blocks' `*_attn_qkv` (`comfyui_hunyuan_video_1_5_weight_split_hook`), so
it has `img_attn_q` / `_k` / `_v`, `img_mlp.fc1` and the refiner's fused `self_attn_qkv`, and its LoRA
(`networks/lora_hv_1_5.py`: `lora_unet_` + those names with "_", in the `MMDoubleStreamBlock`s) would drop
ComfyUI's fused `img_attn_qkv` silently. `save.format = "musubi"` writes Tencent's names
(`TENCENT_KEYS`, `ArchitectureKeys.musubi`): `lora_unet_double_blocks_0_img_attn_q`, `..._img_mlp_fc1`.

Shared with 1.0: the modulations, norms, the text refiner (`txt_in.*`, its q/k/v fused in every file as
`self_attn_qkv`) and `final_layer.*`, whose modulation's two row halves are swapped. New in 1.5: the
ByT5 glyph projection `byt5_in.*`, the SigLIP image projection `vision_in.proj.{0,1,3,4}` and
`cond_type_embedding` (which of text, glyph text or image a context token is). There are no single
blocks and no guidance embedder.
"""

from __future__ import annotations

from tuner.archs.hunyuan_video.keys import COMFY_ATTENTION_NAMES, COMFY_FORMS, comfy_name
from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.fused import FusedLayer
from tuner.networks.layouts import CheckpointLayout

_BLOCK = "transformer_blocks.{i}"
_ORIGINAL_BLOCK = "double_blocks.{i}"
_REFINER = "context_embedder.token_refiner.refiner_blocks.{i}"
_ORIGINAL_REFINER = "txt_in.individual_token_refiner.blocks.{i}"

# q, k, v of each stream: (diffusers parts in row order, Tencent's separate names, ComfyUI's fused name)
_QKV = (
    (("attn.to_q", "attn.to_k", "attn.to_v"), ("img_attn_q", "img_attn_k", "img_attn_v"), "img_attn_qkv"),
    (
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
        ("txt_attn_q", "txt_attn_k", "txt_attn_v"),
        "txt_attn_qkv",
    ),
)

# (diffusers, Tencent) for each double block's modules renamed one to one
_BLOCK_RULES = (
    ("norm1.linear", "img_mod.linear"),
    ("norm1_context.linear", "txt_mod.linear"),
    *((d, o) for parts, separate, _ in _QKV for d, o in zip(parts, separate)),  # Tencent's file only
    ("attn.norm_q", "img_attn_q_norm"),
    ("attn.norm_k", "img_attn_k_norm"),
    ("attn.to_out.0", "img_attn_proj"),
    ("attn.norm_added_q", "txt_attn_q_norm"),
    ("attn.norm_added_k", "txt_attn_k_norm"),
    ("attn.to_add_out", "txt_attn_proj"),
    ("ff.net.0.proj", "img_mlp.fc1"),
    ("ff.net.2", "img_mlp.fc2"),
    ("ff_context.net.0.proj", "txt_mlp.fc1"),
    ("ff_context.net.2", "txt_mlp.fc2"),
)
_REFINER_RULES = (
    ("norm1", "norm1"),
    ("norm2", "norm2"),
    ("attn.to_out.0", "self_attn_proj"),
    ("ff.net.0.proj", "mlp.fc1"),
    ("ff.net.2", "mlp.fc2"),
    ("norm_out.linear", "adaLN_modulation.1"),
)

TRANSFORMER_RULES: tuple[tuple[str, str], ...] = (
    *((f"{_BLOCK}.{d}", f"{_ORIGINAL_BLOCK}.{o}") for d, o in _BLOCK_RULES),
    *((f"{_REFINER}.{d}", f"{_ORIGINAL_REFINER}.{o}") for d, o in _REFINER_RULES),
    # the text refiner's input and its timestep / pooled-text embedders
    ("context_embedder.proj_in", "txt_in.input_embedder"),
    ("context_embedder.time_text_embed.timestep_embedder.linear_1", "txt_in.t_embedder.mlp.0"),
    ("context_embedder.time_text_embed.timestep_embedder.linear_2", "txt_in.t_embedder.mlp.2"),
    ("context_embedder.time_text_embed.text_embedder.linear_1", "txt_in.c_embedder.linear_1"),
    ("context_embedder.time_text_embed.text_embedder.linear_2", "txt_in.c_embedder.linear_2"),
    # the ByT5 glyph projection
    ("context_embedder_2.norm", "byt5_in.layernorm"),
    ("context_embedder_2.linear_1", "byt5_in.fc1"),
    ("context_embedder_2.linear_2", "byt5_in.fc2"),
    ("context_embedder_2.linear_3", "byt5_in.fc3"),
    # the SigLIP image projection (an nn.Sequential in the release: LayerNorm, Linear, GELU, Linear, LayerNorm)
    ("image_embedder.norm_in", "vision_in.proj.0"),
    ("image_embedder.linear_1", "vision_in.proj.1"),
    ("image_embedder.linear_2", "vision_in.proj.3"),
    ("image_embedder.norm_out", "vision_in.proj.4"),
    # embedders and the output head
    ("x_embedder.proj", "img_in.proj"),
    ("time_embed.timestep_embedder.linear_1", "time_in.mlp.0"),
    ("time_embed.timestep_embedder.linear_2", "time_in.mlp.2"),
    ("cond_type_embed", "cond_type_embedding"),
    ("proj_out", "final_layer.linear"),
)

# The text refiner's q, k, v: fused in both files.
_REFINER_QKV = FusedLayer(
    f"{_ORIGINAL_REFINER}.self_attn_qkv", tuple(f"{_REFINER}.attn.{p}" for p in ("to_q", "to_k", "to_v"))
)

# ComfyUI's fused layers (row blocks top to bottom), as HunyuanVideo 1.0's: what tuner writes.
FUSED_LAYERS: tuple[FusedLayer, ...] = (
    *(
        FusedLayer(f"{_ORIGINAL_BLOCK}.{fused}", tuple(f"{_BLOCK}.{p}" for p in parts))
        for parts, _, fused in _QKV
    ),
    _REFINER_QKV,
)

# Same matrix, row halves swapped (shift/scale order); left out of the adapter map, as in 1.0.
FINAL_MODULATION = ("norm_out.linear", "final_layer.adaLN_modulation.1")

# (diffusers, ComfyUI's name) where ComfyUI names a module otherwise than Tencent (`img_mlp.0` for
# `img_mlp.fc1`, `img_mod.lin`, ...): ComfyUI loads 1.5 with 1.0's class and renames, so 1.0's rules apply
KOHYA_NAMES = tuple((d, comfy_name(o)) for d, o in TRANSFORMER_RULES if comfy_name(o) != o)


TENCENT_KEYS = ArchitectureKeys("hunyuan_video15 (Tencent's release)", TRANSFORMER_RULES, (_REFINER_QKV,))
"""Tencent's names, q/k/v apart in the double blocks, the refiner's fused: musubi-tuner's model's too."""

HUNYUAN_VIDEO15_KEYS = ArchitectureKeys(
    "hunyuan_video15",
    TRANSFORMER_RULES,
    FUSED_LAYERS,
    kohya_names=KOHYA_NAMES,
    musubi=TENCENT_KEYS,
    comfy_forms=COMFY_FORMS,
    comfy_renames=COMFY_ATTENTION_NAMES,
)
"""The adapter name map (diffusers module name -> Tencent's, q/k/v fused as ComfyUI's files hold them;
musubi-tuner's apart)."""

HUNYUAN_VIDEO15_LAYOUT = CheckpointLayout(HUNYUAN_VIDEO15_KEYS, swapped_halves=(FINAL_MODULATION,))
"""The whole transformer checkpoint, both directions, at any size: reads both files, writes ComfyUI's."""

TENCENT_LAYOUT = CheckpointLayout(TENCENT_KEYS, swapped_halves=(FINAL_MODULATION,))
"""Tencent's release: separate q/k/v in the double blocks (the test fixture writes a file in it)."""

transformer_key_to_original = HUNYUAN_VIDEO15_LAYOUT.key_to_original
transformer_to_original = HUNYUAN_VIDEO15_LAYOUT.to_original
transformer_to_diffusers = HUNYUAN_VIDEO15_LAYOUT.to_diffusers
