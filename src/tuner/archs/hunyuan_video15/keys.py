"""HunyuanVideo 1.5's transformer in Tencent's names and diffusers': the adapter name map and the layout.

Tencent's release (`transformer/480p_t2v/diffusion_pytorch_model.safetensors`, ComfyUI's
`hunyuanvideo1.5_720p_t2v_fp16.safetensors`, ...) keeps the 1.0 names for what the two networks share
(`double_blocks.N.img_mod.linear`, `txt_in.individual_token_refiner.blocks.N.self_attn_qkv`,
`final_layer.*`), but its 54 double blocks hold q, k and v as separate linears (`img_attn_q`,
`txt_attn_v`, ...), so only the text refiner's `self_attn_qkv` is fused. New in 1.5: the ByT5 glyph
projection `byt5_in.*`, the SigLIP image projection `vision_in.proj.{0,1,3,4}` and
`cond_type_embedding` (which of text, glyph text or image a context token is). There are no single
blocks and no guidance embedder. The final modulation's two row halves are swapped, as in 1.0.
"""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.fused import FusedLayer
from tuner.networks.layouts import CheckpointLayout

_BLOCK = "transformer_blocks.{i}"
_ORIGINAL_BLOCK = "double_blocks.{i}"
_REFINER = "context_embedder.token_refiner.refiner_blocks.{i}"
_ORIGINAL_REFINER = "txt_in.individual_token_refiner.blocks.{i}"

# (diffusers, Tencent) for each double block's modules renamed one to one
_BLOCK_RULES = (
    ("norm1.linear", "img_mod.linear"),
    ("norm1_context.linear", "txt_mod.linear"),
    ("attn.to_q", "img_attn_q"),
    ("attn.to_k", "img_attn_k"),
    ("attn.to_v", "img_attn_v"),
    ("attn.norm_q", "img_attn_q_norm"),
    ("attn.norm_k", "img_attn_k_norm"),
    ("attn.to_out.0", "img_attn_proj"),
    ("attn.add_q_proj", "txt_attn_q"),
    ("attn.add_k_proj", "txt_attn_k"),
    ("attn.add_v_proj", "txt_attn_v"),
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

# The one layer the release fuses: the text refiner's q, k, v (row blocks, top to bottom).
FUSED_LAYERS: tuple[FusedLayer, ...] = (
    FusedLayer(
        f"{_ORIGINAL_REFINER}.self_attn_qkv",
        tuple(f"{_REFINER}.attn.{p}" for p in ("to_q", "to_k", "to_v")),
    ),
)

# Same matrix, row halves swapped (shift/scale order); left out of the adapter map, as in 1.0.
FINAL_MODULATION = ("norm_out.linear", "final_layer.adaLN_modulation.1")

HUNYUAN_VIDEO15_KEYS = ArchitectureKeys("hunyuan_video15", TRANSFORMER_RULES, FUSED_LAYERS)
"""The adapter name map (diffusers module name -> Tencent's)."""

HUNYUAN_VIDEO15_LAYOUT = CheckpointLayout(HUNYUAN_VIDEO15_KEYS, swapped_halves=(FINAL_MODULATION,))
"""The whole transformer checkpoint, both directions, at any size."""

transformer_key_to_original = HUNYUAN_VIDEO15_LAYOUT.key_to_original
transformer_to_original = HUNYUAN_VIDEO15_LAYOUT.to_original
transformer_to_diffusers = HUNYUAN_VIDEO15_LAYOUT.to_diffusers
