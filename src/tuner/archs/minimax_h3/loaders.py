"""MiniMax H3 (MiniMax): one transformer over one packed sequence of text, video and audio rows.

The pieces, as diffusers' `MiniMaxH3ModularPipeline` holds them (the release `MiniMaxAI/MiniMax-H3` is
a diffusers folder, one sub-folder each; diffusers has no `DiffusionPipeline` for it):

* `transformer`: `MiniMaxH3Transformer3DModel` (33B: 50 blocks of width 5376). Full self-attention over
  `[text | audio | video]` rows, no cross-attention; each row carries a modality tag (video 0, text 1,
  audio 2) that picks its AdaLN modulation, and its own timestep index. It predicts the *data-ward*
  velocity (x0 − noise) at `timestep = 1 − σ` (1 = clean; `MiniMaxH3Scheduler`'s docstring).
  Single files: the reference code's names (`tuner.archs.minimax_h3.keys`), ComfyUI's too.
* `vae`: `AutoencoderKLMiniMaxH3`, 16× spatial, 17n + 5 frames → 5n + 2 latent frames, 24 channels,
  ImageNet-normalized RGB over [0, 1] in and out, latents normalized per channel (`latents_mean` /
  `latents_std`). Video latents enter the transformer as 1×2×2 patches, frame-major then row-major.
* `audio_vae`: `AutoencoderKLMiniMaxH3Audio`, mono 32 kHz waveform → 32 channels at 40 latents per
  second (hop 800) and back (a BigVGAN decoder, no vocoder); stereo is two batch items, and the
  transformer reads the two channels' rows one after the other (channel-major), normalized per channel.
* `text_encoder`: Qwen3-VL-32B; MiniMax H3 reads `hidden_states[50]` of the prompt's tokens (no chat
  template, no special tokens), one prompt at a time at its true length. Only the language model is
  loaded (`tuner.models.qwen3_vl`).

The packed layout (rotary coordinates, modality tags, row indices) and the per-row timestep table are
diffusers' own static helpers (`MiniMaxH3PrepareLayoutStep.build_packed_sequence`,
`MiniMaxH3SetTimestepsStep.build_row_timesteps`), called as the pipeline's t2va workflow calls them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.minimax_h3.keys import MINIMAX_H3_LAYOUT, RECOMPUTED
from tuner.errors import CheckpointError
from tuner.models.component import component_spec, load_component
from tuner.models.identify import variant_table
from tuner.models.loading import beside, load_diffusers_folder, resolve_folder
from tuner.models.qwen3_vl import COLUMNS, TextEncoder, language_model_spec, load_language_model

if TYPE_CHECKING:
    from torch import nn

CONFIGS = Path(__file__).parent / "configs"

TEXT_LAYER = 50
"""The Qwen3-VL hidden state MiniMax H3 conditions on (`MiniMaxH3ModularPipeline.text_encoder_layer`)."""
PIXEL_MEAN = (0.485, 0.456, 0.406)  # the video VAE's pixel convention: ImageNet's
PIXEL_STD = (0.229, 0.224, 0.225)
AUDIO_CHANNELS = 2  # stereo, packed channel-major
AUDIO_LATENTS_PER_SECOND = 40  # 32 kHz, hop 800
VIDEO_SHIFT = 12.0  # the release's two schedules (MiniMaxH3SetTimestepsStep): video ...
AUDIO_SHIFT = 3.0  # ... and audio, over one base grid
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2

TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("video_patch_proj.weight", "audio_patch_proj.weight", "blocks.{}.attn.qkv_proj.weight"),
    {
        # MiniMax H3 (33B): 50 blocks, width 5376, 56 heads of 128
        "h3": ((5376, 96), (5376, 32), (50, (21504, 5376))),
        # the test fixture (tuner.archs.minimax_h3.fixture): 2 blocks of width 48, 2 heads of 32
        "tiny": ((48, 96), (48, 32), (2, (192, 48))),
    },
)  # fmt: skip
TRANSFORMER_SPEC = component_spec(
    "MiniMax H3 transformer",
    "MiniMaxH3Transformer3DModel",
    TRANSFORMER_VARIANTS,
    ("video_patch_proj.weight", "blocks.0.attn.qkv_proj.weight", "final_layer.video_out.weight"),
    ("proj_in.weight", "transformer_blocks.0.attn.to_q.weight"),
    MINIMAX_H3_LAYOUT.key_to_original,
)

TEXT_VARIANTS = variant_table(
    CONFIGS / "text_encoder",
    COLUMNS,
    {
        "qwen3-vl-32b": ((151936, 5120), (64, (25600, 5120))),
        # the test fixture: 51 layers of width 32 (hidden_states[50] exists, as in the 32B)
        "tiny": ((2048, 32), (51, (64, 32))),
    },
)  # fmt: skip
TEXT_SPEC = language_model_spec("Qwen3-VL text encoder", TEXT_VARIANTS)


def _without_recomputed(entries: dict) -> dict:
    return {k: v for k, v in entries.items() if k not in RECOMPUTED}


def load_transformer(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The transformer from a diffusers folder, or from a single file in the release's names (ComfyUI's,
    `diffusion_model.` / `model.diffusion_model.` optional, fp8 too) or in diffusers' names."""
    return load_component(
        path, dtype, "MiniMaxH3Transformer3DModel", "transformer", TRANSFORMER_SPEC,
        lambda state_dict, _: MINIMAX_H3_LAYOUT.to_diffusers(state_dict),
        bundled=("model.diffusion_model.", "diffusion_model."), entries=_without_recomputed,
    )  # fmt: skip


def _vae_folder(path: str | Path, name: str) -> Path:
    if Path(path).is_file():
        raise CheckpointError(
            f"{path}: MiniMax H3's VAEs load from the diffusers folder (the release's `vae/` and `audio_vae/`); "
            "point model.vae to MiniMaxAI/MiniMax-H3 or to its vae/ folder."
        )
    folder = resolve_folder(path, "vae") if name == "vae" else beside(path, "vae", name)
    if folder is None or not (folder / "config.json").is_file():
        raise CheckpointError(f"{path}: no MiniMax H3 {name}/ here (looked for {name}/config.json).")
    return folder


def load_vae(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The video VAE: `vae/` of the diffusers folder (or that folder itself)."""
    from diffusers import AutoencoderKLMiniMaxH3

    return load_diffusers_folder(
        AutoencoderKLMiniMaxH3, _vae_folder(path, "vae"), dtype, "AutoencoderKLMiniMaxH3"
    )


def load_audio_vae(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The audio VAE: `audio_vae/` beside the video VAE's `vae/`."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    folder = _vae_folder(path, "audio_vae")
    return load_diffusers_folder(AutoencoderKLMiniMaxH3Audio, folder, dtype, "AutoencoderKLMiniMaxH3Audio")


def load_text_encoder(path: str | Path, tokenizer_path: str | Path | None, dtype: torch.dtype) -> TextEncoder:
    """Qwen3-VL's language model and its tokenizer (`tuner.models.qwen3_vl.load_language_model`)."""
    return load_language_model(
        path, tokenizer_path, dtype, TEXT_SPEC, "Qwen3-VL tokenizer (the tokenizer/ folder of MiniMax H3)"
    )


# ---------------------------------------------------------------- text


@torch.no_grad()
def encode_prompts(encoder: TextEncoder, captions: list[str], max_length: int) -> list[torch.Tensor]:
    """One [L, D] tensor per caption: `hidden_states[50]` of its tokens (no special tokens; L ≤
    `max_length`), each caption alone, as the pipeline's text encoder step runs it."""
    model, tokenizer = encoder
    layers = model.config.num_hidden_layers
    if layers <= TEXT_LAYER:
        raise CheckpointError(
            f"MiniMax H3 conditions on hidden_states[{TEXT_LAYER}] of Qwen3-VL; this text encoder has {layers} "
            "layers. Use Qwen3-VL-32B (the release's text_encoder/)."
        )
    out = []
    for caption in captions:
        ids = tokenizer(caption, add_special_tokens=False, truncation=True, max_length=max_length).input_ids
        ids = torch.tensor([ids or [tokenizer.pad_token_id or 0]], device=model.device)
        positions = torch.arange(ids.shape[1], device=model.device).expand(3, 1, -1)  # text: t = h = w
        states = model(input_ids=ids, position_ids=positions, output_hidden_states=True).hidden_states
        out.append(states[TEXT_LAYER][0])
    return out


# ---------------------------------------------------------------- latents


def _stats(config, like: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(config.latents_mean, dtype=torch.float32).view(shape).to(like)
    return mean, torch.tensor(config.latents_std, dtype=torch.float32).view(shape).to(like)


def _imagenet(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, -1, 1, 1, 1)
    return torch.tensor(PIXEL_MEAN).view(shape).to(like), torch.tensor(PIXEL_STD).view(shape).to(like)


def encode_video(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels [B, 3, F, H, W] in [-1, 1] (F = 17n + 5) → normalized latents [B, 24, 5n + 2, H/16, W/16]
    (the posterior's mode)."""
    pixels = (pixels.float() + 1) / 2
    mean, std = _imagenet(pixels)
    latents = vae.encode(((pixels - mean) / std).to(vae.dtype)).latent_dist.mode().float()
    lmean, lstd = _stats(vae.config, latents, (1, -1, 1, 1, 1))
    return (latents - lmean) / lstd


def decode_video(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents → pixels in [-1, 1]."""
    lmean, lstd = _stats(vae.config, latents.float(), (1, -1, 1, 1, 1))
    video = vae.decode((latents.float() * lstd + lmean).to(vae.dtype), return_dict=False)[0].float()
    mean, std = _imagenet(video)
    return ((video * std + mean).clamp(0, 1) * 2 - 1).clamp(-1, 1)


def audio_latent_frames(frames: int, fps: float) -> int:
    """Audio latents per channel covering `frames` video frames (`audio_latent_num_frames`)."""
    return int(round(frames / fps * AUDIO_LATENTS_PER_SECOND))


def encode_audio(audio_vae, waveform: torch.Tensor) -> torch.Tensor:
    """Waveform [2, samples] at 32 kHz → normalized latents [2, 32, L] (the posterior's mean; the two
    channels are two batch items of the mono VAE)."""
    latents = audio_vae.encode(waveform[:, None].to(audio_vae.dtype)).latent_dist.mode().float()
    mean, std = _stats(audio_vae.config, latents, (1, -1, 1))
    return (latents - mean) / std


def decode_audio(audio_vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents [2, 32, L] → waveform [2, samples] at the VAE's rate."""
    mean, std = _stats(audio_vae.config, latents.float(), (1, -1, 1))
    waveform = audio_vae.decode((latents.float() * std + mean).to(audio_vae.dtype), return_dict=False)[0]
    return waveform.float()[:, 0]


# ---------------------------------------------------------------- the packed sequence


def pack_video(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, F, H, W] → rows [B, F·H/2·W/2, C·4] (1×2×2 patches, frame-major then row-major)."""
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(b, f * (h // 2) * (w // 2), c * 4)


def unpack_video(rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    b, c, f, h, w = shape
    x = rows.reshape(b, f, h // 2, w // 2, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(shape)


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """[B, 2, C, L] → channel-major rows [B, 2·L, C]."""
    return latents.transpose(2, 3).flatten(1, 2)


def unpack_audio(rows: torch.Tensor, channels: int) -> torch.Tensor:
    return rows.unflatten(1, (channels, -1)).transpose(2, 3)


def layout(text_tokens: int, frames: int, height: int, width: int, audio_latents: int, device) -> dict:
    """The t2va layout of one sample (`[text | audio | video]`): the transformer's `position_ids`,
    `token_tags` and row indices (diffusers' `build_packed_sequence`)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    positions, tags, video, audio, text, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.full((text_tokens,), TEXT_TAG, dtype=torch.long), frames, height, width, audio_latents,
        (1, 2, 2), AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG,
    )  # fmt: skip
    return {
        "position_ids": positions.float().to(device),
        "token_tags": tags.to(device),
        "video_indices": video.to(device),
        "audio_indices": audio.to(device),
        "text_indices": text.to(device),
    }


def row_timesteps(rows: dict, sigma: float, sound_sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(timestep, timestep_indices) of one sample: video and text rows at 1 − σ, audio rows at
    1 − σ_sound (diffusers' `build_row_timesteps`, no conditioning rows)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    video, audio = rows["video_indices"].cpu(), rows["audio_indices"].cpu()
    timestep, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, 0, 0, rows["text_indices"].numel(), 1.0 - sigma, 1.0 - sound_sigma, 1.0, 1.0
    )
    return timestep, indices


def predict_velocities(model, video: torch.Tensor, t: torch.Tensor, audio: torch.Tensor, sound_t: torch.Tensor,
                       prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The flow velocities (noise − x0, tuner's convention: the model's data-ward output negated) of video
    [B, C, F, H, W] at σ = t and sound [B, 2, C, L] at σ = `sound_t`, one packed sequence per sample."""
    b, _, frames, height, width = video.shape
    video_rows, audio_rows = pack_video(video), pack_audio(audio)
    v_out, a_out = [], []
    for i in range(b):
        rows = layout(prompts[i].shape[0], frames, height, width, audio.shape[-1], video.device)
        timestep, indices = row_timesteps(rows, float(t[i]), float(sound_t[i]))
        v, a = model(
            hidden_states=video_rows[i : i + 1],
            audio_hidden_states=audio_rows[i : i + 1],
            encoder_hidden_states=prompts[i][None].to(video.dtype),
            timestep=timestep.to(video.device),
            timestep_indices=indices.to(video.device),
            return_dict=False,
            **rows,
        )
        v_out.append(-v)
        a_out.append(-a)
    return (
        unpack_video(torch.cat(v_out).to(video.dtype), tuple(video.shape)),
        unpack_audio(torch.cat(a_out).to(audio.dtype), audio.shape[1]),
    )
