"""LTX-2's release layout (Lightricks' `ltx-2-*.safetensors`, `model.diffusion_model.*`) relative to diffusers'.

The blocks keep diffusers' names for every linear layer (`transformer_blocks.N.attn1.to_q`,
`audio_attn2.to_out.0`, `audio_to_video_attn.to_k`, `ff.net.0.proj`, `audio_ff.net.2`...), so adapters
on the blocks are named alike in both layouts. What differs: the input projections (`patchify_proj`),
the timestep embedders (`adaln_single`, `audio_adaln_single`, `av_ca_*_adaln_single`), the attention
q/k RMSNorms (`q_norm` / `k_norm`) and the blocks' cross-modal modulation tables. No layer is fused.
LTX-2.3 adds per-head attention gates (`to_gate_logits`) and the blocks' `prompt_scale_shift_table` under
the same names in both layouts, and the prompt modulation embedders (`prompt_adaln_single`), and drops
the caption projections (its connectors project to each stream's width).
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
    # LTX-2.3: the text cross-attention's timestep modulation (diffusers' converter's 2.3 renames)
    ("prompt_adaln", "prompt_adaln_single"),
    ("audio_prompt_adaln", "audio_prompt_adaln_single"),
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
    # the text connectors (diffusers keeps them apart, in `connectors/`)
    bundled=("video_embeddings_connector.", "audio_embeddings_connector.", "text_embedding_projection."),
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
# their ResNets (LTX-2.3's decoder has a fourth stage: `7`, `8`). ResNets are `res_blocks` there,
# `resnets` here.
_DECODER_STAGES = 4
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
            *((f"decoder.up_blocks.{k}.upsamplers.0", f"decoder.up_blocks.{2 * k + 1}") for k in range(_DECODER_STAGES)),
            *((f"decoder.up_blocks.{k}.resnets.{{i}}", f"decoder.up_blocks.{2 * k + 2}.res_blocks.{{i}}") for k in range(_DECODER_STAGES)),
            *((f"decoder.up_blocks.{k}", f"decoder.up_blocks.{2 * k + 2}") for k in range(_DECODER_STAGES)),
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


# ---------------------------------------------------------------- the text connectors in the release's file

_STREAMS = ("video", "audio")
CONNECTORS_LAYOUT = CheckpointLayout(
    ArchitectureKeys(
        "ltx2 connectors",
        (
            ("text_proj_in", "text_embedding_projection.aggregate_embed"),  # LTX-2: one projection
            *((f"{s}_text_proj_in", f"text_embedding_projection.{s}_aggregate_embed") for s in _STREAMS),  # 2.3
            *((f"{s}_connector.transformer_blocks.{{i}}", f"{s}_embeddings_connector.transformer_1d_blocks.{{i}}")
              for s in _STREAMS),
            *((f"{s}_connector", f"{s}_embeddings_connector") for s in _STREAMS),
        ),
    ),
    tensor_renames=tuple(
        (f"{s}_connector.transformer_blocks.{{i}}.attn1.norm_{x}.weight",
         f"{s}_embeddings_connector.transformer_1d_blocks.{{i}}.attn1.{x}_norm.weight")
        for s in _STREAMS for x in ("q", "k")
    ),
)  # fmt: skip
"""The text connectors (diffusers' `LTX2TextConnectors`) as the release's file holds them: the
projection of Gemma's stacked hidden states at the top level (`text_embedding_projection.*`), the two
connector transformers beside the transformer (`model.diffusion_model.{video,audio}_embeddings_connector.*`,
blocks `transformer_1d_blocks`, q/k norms `q_norm` / `k_norm`). Facts: diffusers'
`scripts/convert_ltx2_to_diffusers.py` (its 2.0 and 2.3 connector renames) and ComfyUI's
`comfy/text_encoders/lt.py` (`LTXAVTEModel.load_sd` reads `text_embedding_projection.aggregate_embed` and
`model.diffusion_model.*_embeddings_connector.` from the checkpoint)."""


def _hifigan_renames(stage: str) -> tuple[tuple[str, str], ...]:
    """A HiFi-GAN's module renames (diffusers, release) under `stage` ("" for LTX-2's vocoder itself)."""
    renames = (("conv_in", "conv_pre"), ("conv_out", "conv_post"), ("act_out", "act_post"),
               ("upsamplers.{i}", "ups.{i}"), ("resnets.{i}", "resblocks.{i}"))  # fmt: skip
    return tuple((f"{stage}{d}", f"{stage}{o}") for d, o in renames)


_BWE_STAGES = ("vocoder.", "bwe_generator.")
_RESNET_CONVS = 3  # the convolutions of each HiFi-GAN ResNet (its three dilations)
BWE_VOCODER_LAYOUT = CheckpointLayout(
    ArchitectureKeys(
        "ltx2.3 vocoder",
        (*(r for stage in _BWE_STAGES for r in _hifigan_renames(stage)), ("mel_stft", "mel_stft")),
    ),
    tensor_renames=tuple(
        (f"{stage}{d}.downsample.filter", f"{stage}{o}.downsample.lowpass.filter")
        for stage in _BWE_STAGES
        for d, o in (
            ("act_out", "act_post"),
            *((f"resnets.{{i}}.{acts}.{j}", f"resblocks.{{i}}.{acts}.{j}") for acts in ("acts1", "acts2")
              for j in range(_RESNET_CONVS)),
        )
    ),
)  # fmt: skip
"""LTX-2.3's vocoder (`vocoder.*` of its release file) relative to diffusers' `LTX2VocoderWithBWE`: the
vocoder and its bandwidth extender (`vocoder.`, `bwe_generator.`) in HiFi-GAN's names, anti-aliased
activations' low-pass filters under `downsample.lowpass`. These are the renames diffusers'
`scripts/convert_ltx2_to_diffusers.py` applies before loading the release's tensors strictly (its 2.3
vocoder table); the file itself was not at hand offline."""

VOCODER_LAYOUT = CheckpointLayout(ArchitectureKeys("ltx2 vocoder", _hifigan_renames("")))
"""LTX-2's vocoder (`vocoder.*` in the release's file) relative to diffusers' `LTX2Vocoder` (HiFi-GAN's
names there: `conv_pre`, `ups`, `resblocks`, `conv_post`; diffusers' converter's 2.0 vocoder renames)."""
