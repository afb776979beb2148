"""Key names of Cosmos-Predict2 in diffusers' layout and in NVIDIA's release layout.

NVIDIA's checkpoints (`model.pt` of nvidia/Cosmos-Predict2-*, and the safetensors made from it) store
the network under `net.`: `net.blocks.0.self_attn.q_proj.weight`, `net.blocks.0.mlp.layer1.weight`,
`net.x_embedder.proj.1.weight`, `net.final_layer.linear.weight`, ... ComfyUI's files
(`cosmos_predict2_2B_t2i.safetensors`) hold the same names, and ComfyUI names a model's weights without
the `net.` prefix, so that is the "original" layout here (adapters are saved as
`diffusion_model.blocks.0.self_attn.q_proj`). Release files also carry buffers and training counters that
no diffusers tensor corresponds to (`pos_embedder.seq`, `pos_embedder.dim_*_range`, `accum_*`,
`*._extra_state`); loaders drop them (`RELEASE_ONLY`).

Nothing is fused and no tensor changes its leaf name: the layout is one table of module renames.
"""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

# (diffusers module, release module); `{i}` is a block index
TRANSFORMER_RULES: tuple[tuple[str, str], ...] = (
    # nn.Linear modules of the blocks (what adapters target)
    ("transformer_blocks.{i}.attn1.to_q", "blocks.{i}.self_attn.q_proj"),
    ("transformer_blocks.{i}.attn1.to_k", "blocks.{i}.self_attn.k_proj"),
    ("transformer_blocks.{i}.attn1.to_v", "blocks.{i}.self_attn.v_proj"),
    ("transformer_blocks.{i}.attn1.to_out.0", "blocks.{i}.self_attn.output_proj"),
    ("transformer_blocks.{i}.attn2.to_q", "blocks.{i}.cross_attn.q_proj"),
    ("transformer_blocks.{i}.attn2.to_k", "blocks.{i}.cross_attn.k_proj"),
    ("transformer_blocks.{i}.attn2.to_v", "blocks.{i}.cross_attn.v_proj"),
    ("transformer_blocks.{i}.attn2.to_out.0", "blocks.{i}.cross_attn.output_proj"),
    ("transformer_blocks.{i}.ff.net.0.proj", "blocks.{i}.mlp.layer1"),
    ("transformer_blocks.{i}.ff.net.2", "blocks.{i}.mlp.layer2"),
    # the AdaLN-LoRA modulation of each sub-layer (two bias-free linears) and of the output head
    ("transformer_blocks.{i}.norm1.linear_1", "blocks.{i}.adaln_modulation_self_attn.1"),
    ("transformer_blocks.{i}.norm1.linear_2", "blocks.{i}.adaln_modulation_self_attn.2"),
    ("transformer_blocks.{i}.norm2.linear_1", "blocks.{i}.adaln_modulation_cross_attn.1"),
    ("transformer_blocks.{i}.norm2.linear_2", "blocks.{i}.adaln_modulation_cross_attn.2"),
    ("transformer_blocks.{i}.norm3.linear_1", "blocks.{i}.adaln_modulation_mlp.1"),
    ("transformer_blocks.{i}.norm3.linear_2", "blocks.{i}.adaln_modulation_mlp.2"),
    ("norm_out.linear_1", "final_layer.adaln_modulation.1"),
    ("norm_out.linear_2", "final_layer.adaln_modulation.2"),
    ("proj_out", "final_layer.linear"),
    ("patch_embed.proj", "x_embedder.proj.1"),  # proj.0 is the patchifying rearrange (no weights)
    ("time_embed.t_embedder.linear_1", "t_embedder.1.linear_1"),
    ("time_embed.t_embedder.linear_2", "t_embedder.1.linear_2"),
    # everything else in the state dict: the per-head q/k RMSNorms and the timestep norm
    ("transformer_blocks.{i}.attn1.norm_q", "blocks.{i}.self_attn.q_norm"),
    ("transformer_blocks.{i}.attn1.norm_k", "blocks.{i}.self_attn.k_norm"),
    ("transformer_blocks.{i}.attn2.norm_q", "blocks.{i}.cross_attn.q_norm"),
    ("transformer_blocks.{i}.attn2.norm_k", "blocks.{i}.cross_attn.k_norm"),
    ("time_embed.norm", "t_embedding_norm"),
)

COSMOS_PREDICT2_KEYS = ArchitectureKeys("cosmos_predict2", TRANSFORMER_RULES)
COSMOS_PREDICT2_LAYOUT = CheckpointLayout(COSMOS_PREDICT2_KEYS)

RELEASE_PREFIX = "net."
# Release-file tensors that are not weights of the network: RoPE tables rebuilt at construction, and
# training counters / TransformerEngine state. Matched against the key without `net.`.
RELEASE_ONLY = (
    "pos_embedder.seq",
    "pos_embedder.dim_spatial_range",
    "pos_embedder.dim_temporal_range",
    "accum_video_sample_counter",
    "accum_image_sample_counter",
    "accum_iteration",
    "accum_train_in_hours",
)


def is_release_only(key: str) -> bool:
    """True for a release-file tensor that holds no network weight (see `RELEASE_ONLY`)."""
    return key in RELEASE_ONLY or key.endswith("_extra_state")


transformer_key_to_original = COSMOS_PREDICT2_LAYOUT.key_to_original
transformer_to_original = COSMOS_PREDICT2_LAYOUT.to_original
transformer_to_diffusers = COSMOS_PREDICT2_LAYOUT.to_diffusers
