"""Key names of HunyuanVideo's transformer in diffusers' layout and in Tencent's original layout.

The original release (`hunyuan_video_720_cfgdistill_bf16.safetensors`, ComfyUI's
`hunyuan_video_t2v_720p_bf16.safetensors`) is the network of Tencent's `hyvideo/modules/models.py`.
Facts of its layout, matched against diffusers' single-file converter (which goes original -> diffusers
only and hard-codes the hidden size 3072 when it cuts `linear1`):

* a double block keeps q, k and v of each stream in one linear layer, `img_attn_qkv` / `txt_attn_qkv`
  (rows q, k, v; underscores where FLUX has dots), and names its q/k RMSNorms `img_attn_q_norm`, ...
  with a plain `weight`;
* a single block computes q, k, v and the MLP input with one `linear1` (rows q, k, v, mlp; the MLP is
  4× wide) and its output with `linear2`;
* the text goes through a token refiner, `txt_in` (diffusers: `context_embedder`), whose blocks keep
  q, k, v in one `self_attn_qkv`;
* the final modulation `final_layer.adaLN_modulation.1` emits (shift, scale) where diffusers'
  `norm_out.linear` emits (scale, shift): the two row halves are swapped.

ComfyUI loads that file into FLUX's blocks (`comfy/ldm/hunyuan_video/model.py` builds on
`comfy/ldm/flux/layers.py`: `DoubleStreamBlock.img_mlp` is an `nn.Sequential`, `Modulation.lin`,
`MLPEmbedder.in_layer` / `out_layer`), renaming the keys as it reads them (`COMFY_RENAMES`, after
`HunyuanVideo.process_unet_state_dict` in `comfy/supported_models.py`). Its `lora_unet_` key map
(`model_lora_keys_unet` in `comfy/lora.py`) is built from those module names, so kohya stems spell
`img_mlp_0`, not the release's `img_mlp_fc1` (`kohya_names`). musubi-tuner's model keeps the release's
names (`MMDoubleStreamBlock.img_mlp.fc1`, fused `img_attn_qkv` / `linear1`, in
`musubi_tuner/hunyuan_model/models.py`), so its files spell `img_mlp_fc1`: `save.format = "musubi"` writes
that, and both spellings read back.

The VAE (`hunyuan_video_vae_bf16.safetensors`) and the text encoders' files already use diffusers' /
transformers' names (see `tuner.archs.hunyuan_video.loaders`). `HUNYUAN_VIDEO_KEYS` is the adapter name map
(renames + fused layers); `HUNYUAN_VIDEO_LAYOUT` adds the swapped final modulation for whole checkpoints.
"""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.fused import FusedLayer
from tuner.networks.layouts import CheckpointLayout

_REFINER = "context_embedder.token_refiner.refiner_blocks.{i}"
_ORIGINAL_REFINER = "txt_in.individual_token_refiner.blocks.{i}"

# (diffusers, original) for modules renamed one to one; `{i}` is a block index.
TRANSFORMER_RULES: tuple[tuple[str, str], ...] = (
    # double-stream blocks
    ("transformer_blocks.{i}.norm1.linear", "double_blocks.{i}.img_mod.linear"),
    ("transformer_blocks.{i}.norm1_context.linear", "double_blocks.{i}.txt_mod.linear"),
    ("transformer_blocks.{i}.attn.norm_q", "double_blocks.{i}.img_attn_q_norm"),
    ("transformer_blocks.{i}.attn.norm_k", "double_blocks.{i}.img_attn_k_norm"),
    ("transformer_blocks.{i}.attn.norm_added_q", "double_blocks.{i}.txt_attn_q_norm"),
    ("transformer_blocks.{i}.attn.norm_added_k", "double_blocks.{i}.txt_attn_k_norm"),
    ("transformer_blocks.{i}.attn.to_out.0", "double_blocks.{i}.img_attn_proj"),
    ("transformer_blocks.{i}.attn.to_add_out", "double_blocks.{i}.txt_attn_proj"),
    ("transformer_blocks.{i}.ff.net.0.proj", "double_blocks.{i}.img_mlp.fc1"),
    ("transformer_blocks.{i}.ff.net.2", "double_blocks.{i}.img_mlp.fc2"),
    ("transformer_blocks.{i}.ff_context.net.0.proj", "double_blocks.{i}.txt_mlp.fc1"),
    ("transformer_blocks.{i}.ff_context.net.2", "double_blocks.{i}.txt_mlp.fc2"),
    # single-stream blocks
    ("single_transformer_blocks.{i}.attn.norm_q", "single_blocks.{i}.q_norm"),
    ("single_transformer_blocks.{i}.attn.norm_k", "single_blocks.{i}.k_norm"),
    ("single_transformer_blocks.{i}.norm.linear", "single_blocks.{i}.modulation.linear"),
    ("single_transformer_blocks.{i}.proj_out", "single_blocks.{i}.linear2"),
    # the text token refiner
    (f"{_REFINER}.norm1", f"{_ORIGINAL_REFINER}.norm1"),
    (f"{_REFINER}.norm2", f"{_ORIGINAL_REFINER}.norm2"),
    (f"{_REFINER}.attn.to_out.0", f"{_ORIGINAL_REFINER}.self_attn_proj"),
    (f"{_REFINER}.ff.net.0.proj", f"{_ORIGINAL_REFINER}.mlp.fc1"),
    (f"{_REFINER}.ff.net.2", f"{_ORIGINAL_REFINER}.mlp.fc2"),
    (f"{_REFINER}.norm_out.linear", f"{_ORIGINAL_REFINER}.adaLN_modulation.1"),
    ("context_embedder.proj_in", "txt_in.input_embedder"),
    ("context_embedder.time_text_embed.timestep_embedder.linear_1", "txt_in.t_embedder.mlp.0"),
    ("context_embedder.time_text_embed.timestep_embedder.linear_2", "txt_in.t_embedder.mlp.2"),
    ("context_embedder.time_text_embed.text_embedder.linear_1", "txt_in.c_embedder.linear_1"),
    ("context_embedder.time_text_embed.text_embedder.linear_2", "txt_in.c_embedder.linear_2"),
    # embedders and the output head
    ("x_embedder.proj", "img_in.proj"),
    ("time_text_embed.timestep_embedder.linear_1", "time_in.mlp.0"),
    ("time_text_embed.timestep_embedder.linear_2", "time_in.mlp.2"),
    ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
    ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
    ("time_text_embed.guidance_embedder.linear_1", "guidance_in.mlp.0"),
    ("time_text_embed.guidance_embedder.linear_2", "guidance_in.mlp.2"),
    ("proj_out", "final_layer.linear"),
)

# ComfyUI's renames of the release's module names, in its order (only those that change a linear layer's
# kohya spelling: `_attn_qkv` -> `_attn.qkv` is the same with "_")
COMFY_RENAMES: tuple[tuple[str, str], ...] = (
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
    ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
    ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."),
    ("mlp.fc1.", "mlp.0."),
    ("mlp.fc2.", "mlp.2."),
    (".modulation.linear.", ".modulation.lin."),
    ("_in.mlp.2.", "_in.out_layer."),
    ("_in.mlp.0.", "_in.in_layer."),
)


def comfy_name(original: str) -> str:
    """ComfyUI's name of a module of the release."""
    name = original + "."
    for old, new in COMFY_RENAMES:
        name = name.replace(old, new)
    return name[:-1]


# (diffusers, ComfyUI) for the modules ComfyUI names otherwise than the release: their kohya stems
KOHYA_NAMES = tuple((d, comfy_name(o)) for d, o in TRANSFORMER_RULES if comfy_name(o) != o)

# Original layers that diffusers splits into row blocks (top to bottom).
FUSED_LAYERS: tuple[FusedLayer, ...] = (
    FusedLayer(
        "double_blocks.{i}.img_attn_qkv",
        tuple(f"transformer_blocks.{{i}}.attn.{p}" for p in ("to_q", "to_k", "to_v")),
    ),
    FusedLayer(
        "double_blocks.{i}.txt_attn_qkv",
        tuple(f"transformer_blocks.{{i}}.attn.{p}" for p in ("add_q_proj", "add_k_proj", "add_v_proj")),
    ),
    FusedLayer(
        "single_blocks.{i}.linear1",
        tuple(
            f"single_transformer_blocks.{{i}}.{p}"
            for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
        ),
        proportions=(1, 1, 1, 4),  # the single blocks' MLP is 4× the hidden size (mlp_ratio 4)
    ),
    FusedLayer(
        f"{_ORIGINAL_REFINER}.self_attn_qkv",
        tuple(f"{_REFINER}.attn.{p}" for p in ("to_q", "to_k", "to_v")),
    ),
)

# The final modulation: same matrix, row halves swapped. Not in the adapter map: an adapter on it would
# need its up rows swapped too, so exporting one is refused (KeyError) rather than written wrong.
FINAL_MODULATION = ("norm_out.linear", "final_layer.adaLN_modulation.1")

COMFY_FORMS = ("diffusion_model.{o}", "transformer.{o}")
"""The extra stems ComfyUI's `HunyuanVideo` model maps (its 1.5's too, and FramePack files read as
HunyuanVideo's): diffusion-pipe's release names."""
COMFY_ATTENTION_NAMES = (("_attn_qkv", "_attn.qkv"), ("_attn_proj", "_attn.proj"))
"""ComfyUI's names of the attention linears, as `HunyuanVideo.process_unet_state_dict`
(`comfy/supported_models.py`) renames them (the kohya spelling is the same)."""

HUNYUAN_VIDEO_KEYS = ArchitectureKeys(
    "hunyuan_video",
    TRANSFORMER_RULES,
    FUSED_LAYERS,
    kohya_names=KOHYA_NAMES,
    comfy_forms=COMFY_FORMS,
    comfy_renames=COMFY_ATTENTION_NAMES,
)
"""The adapter name map (diffusers module name -> Tencent's), carrying the fused layers."""

HUNYUAN_VIDEO_LAYOUT = CheckpointLayout(HUNYUAN_VIDEO_KEYS, swapped_halves=(FINAL_MODULATION,))
"""The whole transformer checkpoint, both directions, at any hidden size; `.inverse` is the loaders'
original -> diffusers map."""

transformer_key_to_original = HUNYUAN_VIDEO_LAYOUT.key_to_original
transformer_to_original = HUNYUAN_VIDEO_LAYOUT.to_original
transformer_to_diffusers = HUNYUAN_VIDEO_LAYOUT.to_diffusers
