"""MiniMax H3 text-to-video-and-audio on diffusers' MiniMaxH3Transformer3DModel (`tuner.archs.minimax_h3.loaders`).

Latents: the video VAE compresses 16× in space and 17n + 5 frames into 5n + 2 (24 fps; pixel sides
multiples of 32 with the 2×2 patch). A video clip's latent entry holds `latents` and, when its file has
sound and the dataset's `audio` option takes it, `audio_latents` [2, 32, L]: the sound of exactly the
clip's frames, read at 32 kHz stereo. Text entries hold `hidden_states[50]` of Qwen3-VL at the caption's
length; a batch pads them, and each sample is one packed sequence of its own true length.

The audio stream is `tuner.archs.minimax_h3.sound.MiniMaxH3Sound` (shared part `tuner.archs.parts.audio`):
training noises the video at σ and the sound at the release's audio level for σ and sums both losses;
generation denoises both down their two schedules and writes the audio VAE's waveform into the mp4.
The model is guidance-distilled (its pipeline has no guidance), so generation runs without CFG.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.minimax_h3 import loaders as h3
from tuner.archs.model import ArchitectureModel, padded_prompts
from tuner.archs.parts.audio import draw_sound_noise, video_velocity
from tuner.memory import text_encoder_dtype
from tuner.models.qwen3_vl import TextEncoder


class MiniMaxH3Model(ArchitectureModel):
    architecture = "minimax_h3"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return h3.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return h3.load_vae(self.weights_path("vae"), dtype).to(device)

    def load_latent_encoder(self, device: torch.device, dtype: torch.dtype):
        """The video VAE and the audio VAE (beside it)."""
        audio_vae = h3.load_audio_vae(self.weights_path("vae"), dtype).to(device)
        return nn.ModuleDict({"video": self.load_vae(device, dtype), "audio": audio_vae})

    def encode_latents(self, encoder, pixels: torch.Tensor, controls: list[torch.Tensor]) -> dict:
        return {"latents": h3.encode_video(encoder["video"], pixels)}

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return h3.encode_video(vae, pixels)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return h3.decode_video(vae, latents)

    def load_text_encoder(self, device: torch.device, dtype: str) -> TextEncoder:
        encoder = h3.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        embeds = h3.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)
        return [{"prompt_embeds": e} for e in embeds]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return padded_prompts(entries)

    @staticmethod
    def prompts(cond: dict) -> list[torch.Tensor]:
        """Each sample's text rows at its true length."""
        return [e[m] for e, m in zip(cond["prompt_embeds"], cond["prompt_mask"], strict=True)]

    def pixel_frames(self, latent_frames: int) -> int:
        """The frame count 17n + 5 whose latents have `latent_frames` = 5n + 2 frames."""
        return (latent_frames - 2) // 5 * 17 + 5

    # --- the two streams (`tuner.archs.minimax_h3.sound`) -------------------------------------------
    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        return draw_sound_noise(cond, generator)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The video stream's velocity (`tuner.archs.parts.audio.video_velocity`)."""
        return video_velocity(self.sound_stream(), model, noisy, t, cond)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (24, (frames - 5) // 17 * 5 + 2, height // 16, width // 16)
