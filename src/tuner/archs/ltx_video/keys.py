"""LTX-Video 0.9's release layout (`ltx-video-2b-v0.9*.safetensors`, `model.diffusion_model.*`) relative to diffusers'.

The same naming family as LTX-2's video stream (`tuner.archs.ltx2.keys`): the input projection is
`patchify_proj`, the timestep embedder `adaln_single`, the attention q/k RMSNorms `q_norm` / `k_norm`;
every linear layer of the blocks keeps diffusers' name. No layer is fused.
"""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

BLOCK_LINEARS = (
    *(f"{attn}.{proj}" for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v", "to_out.0")),
    "ff.net.0.proj", "ff.net.2",
)  # fmt: skip

LTX_VIDEO_KEYS = ArchitectureKeys(
    "ltx_video",
    (
        *((f"transformer_blocks.{{i}}.{name}", f"transformer_blocks.{{i}}.{name}") for name in BLOCK_LINEARS),
        ("proj_in", "patchify_proj"),
        *((f"time_embed.{lin}", f"adaln_single.{lin}")
          for lin in ("emb.timestep_embedder.linear_1", "emb.timestep_embedder.linear_2", "linear")),
        ("caption_projection.linear_1", "caption_projection.linear_1"),
        ("caption_projection.linear_2", "caption_projection.linear_2"),
        ("proj_out", "proj_out"),
        ("transformer_blocks.{i}", "transformer_blocks.{i}"),  # the blocks' other tensors keep their names
    ),
)  # fmt: skip
"""The key table of LTX-Video 0.9: module renames (diffusers, release)."""

LTX_VIDEO_LAYOUT = CheckpointLayout(
    LTX_VIDEO_KEYS,
    tensor_renames=(
        *((f"transformer_blocks.{{i}}.{attn}.norm_{x}.weight", f"transformer_blocks.{{i}}.{attn}.{x}_norm.weight")
          for attn in ("attn1", "attn2") for x in ("q", "k")),
        ("scale_shift_table", "scale_shift_table"),
    ),
)  # fmt: skip
