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

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

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


# ---------------------------------------------------------------- the VAEs in the release's file

_STATISTICS = (
    ("latents_mean", "per_channel_statistics.mean-of-means"),
    ("latents_std", "per_channel_statistics.std-of-means"),
)
VAE_STATISTICS_UNUSED = ("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds")
"""Tensors of the release's VAEs (`vae.*`) that diffusers has no place for."""

# The release numbers the video VAE's stages and their resamplers in one sequence: encoder
# `down_blocks.0, 2, 4, 6` are diffusers' four stages, `1, 3, 5, 7` their downsamplers, `8` the mid
# block; decoder `up_blocks.0` is the mid block, `1, 3, 5` the upsamplers of stages 0-2, `2, 4, 6`
# their ResNets. ResNets are `res_blocks` there, `resnets` here.
VIDEO_VAE_LAYOUT = CheckpointLayout(
    ArchitectureKeys(
        "ltx2 video VAE",
        (
            *((f"encoder.down_blocks.{k}.resnets.{{i}}", f"encoder.down_blocks.{2 * k}.res_blocks.{{i}}") for k in range(4)),
            *((f"encoder.down_blocks.{k}.downsamplers.0", f"encoder.down_blocks.{2 * k + 1}") for k in range(4)),
            *((f"encoder.down_blocks.{k}", f"encoder.down_blocks.{2 * k}") for k in range(4)),
            ("encoder.mid_block.resnets.{i}", "encoder.down_blocks.8.res_blocks.{i}"),
            ("encoder.mid_block", "encoder.down_blocks.8"),
            ("decoder.mid_block.resnets.{i}", "decoder.up_blocks.0.res_blocks.{i}"),
            ("decoder.mid_block", "decoder.up_blocks.0"),
            *((f"decoder.up_blocks.{k}.upsamplers.0", f"decoder.up_blocks.{2 * k + 1}") for k in range(3)),
            *((f"decoder.up_blocks.{k}.resnets.{{i}}", f"decoder.up_blocks.{2 * k + 2}.res_blocks.{{i}}") for k in range(3)),
            *((f"decoder.up_blocks.{k}", f"decoder.up_blocks.{2 * k + 2}") for k in range(3)),
            ("encoder", "encoder"),
            ("decoder", "decoder"),
        ),
    ),
    tensor_renames=_STATISTICS,
)  # fmt: skip
"""The video VAE (`vae.*` in the release's file) relative to diffusers' `AutoencoderKLLTX2Video`."""

AUDIO_VAE_LAYOUT = CheckpointLayout(
    ArchitectureKeys("ltx2 audio VAE", (("encoder", "encoder"), ("decoder", "decoder"))),
    tensor_renames=_STATISTICS,
)
"""The audio VAE (`audio_vae.*`): diffusers' names, but for the latent statistics."""
