"""LTX-2's release layout (Lightricks' `ltx-2-*.safetensors`, `model.diffusion_model.*`) relative to diffusers'.

The blocks keep diffusers' names for every linear layer (`transformer_blocks.N.attn1.to_q`,
`audio_attn2.to_out.0`, `audio_to_video_attn.to_k`, `ff.net.0.proj`, `audio_ff.net.2`...), so adapters
on the blocks are named alike in both layouts. What differs: the input projections (`patchify_proj`),
the timestep embedders (`adaln_single`, `audio_adaln_single`, `av_ca_*_adaln_single`), the attention
q/k RMSNorms (`q_norm` / `k_norm`) and the blocks' cross-modal modulation tables. No layer is fused.
The release file also bundles the text connectors (`video_embeddings_connector`,
`audio_embeddings_connector`), the VAEs (`vae.*`, `audio_vae.*`) and the vocoder (`vocoder.*`); they
are not the transformer's.
"""

from __future__ import annotations

from tuner.models.layouts import CheckpointLayout
from tuner.networks.architectures import ArchitectureKeys

ATTENTIONS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
BLOCK_LINEARS = (
    *(f"{attn}.{proj}" for attn in ATTENTIONS for proj in ("to_q", "to_k", "to_v", "to_out.0")),
    "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2",
)  # fmt: skip

# diffusers timestep embedder -> the release's
_EMBEDDERS = (
    ("time_embed", "adaln_single"),
    ("audio_time_embed", "audio_adaln_single"),
    ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
    ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
    ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
    ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
)
_EMBEDDER_LINEARS = ("emb.timestep_embedder.linear_1", "emb.timestep_embedder.linear_2", "linear")

LTX2_KEYS = ArchitectureKeys(
    "ltx2",
    (
        *((f"transformer_blocks.{{i}}.{name}", f"transformer_blocks.{{i}}.{name}") for name in BLOCK_LINEARS),
        ("proj_in", "patchify_proj"),
        ("audio_proj_in", "audio_patchify_proj"),
        *((f"{d}.{lin}", f"{o}.{lin}") for d, o in _EMBEDDERS for lin in _EMBEDDER_LINEARS),
        *((f"{p}.{lin}", f"{p}.{lin}") for p in ("caption_projection", "audio_caption_projection")
          for lin in ("linear_1", "linear_2")),
        ("proj_out", "proj_out"),
        ("audio_proj_out", "audio_proj_out"),
        ("transformer_blocks.{i}", "transformer_blocks.{i}"),  # the blocks' other tensors keep their names
    ),
)  # fmt: skip
"""The key table of LTX-2: module renames (diffusers, release)."""

LTX2_LAYOUT = CheckpointLayout(
    LTX2_KEYS,
    tensor_renames=(
        *(
            (f"transformer_blocks.{{i}}.{attn}.norm_{x}.weight", f"transformer_blocks.{{i}}.{attn}.{x}_norm.weight")
            for attn in ATTENTIONS
            for x in ("q", "k")
        ),
        ("transformer_blocks.{i}.video_a2v_cross_attn_scale_shift_table",
         "transformer_blocks.{i}.scale_shift_table_a2v_ca_video"),
        ("transformer_blocks.{i}.audio_a2v_cross_attn_scale_shift_table",
         "transformer_blocks.{i}.scale_shift_table_a2v_ca_audio"),
        ("scale_shift_table", "scale_shift_table"),
        ("audio_scale_shift_table", "audio_scale_shift_table"),
    ),
)  # fmt: skip
