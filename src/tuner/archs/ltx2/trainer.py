"""LTX-2 text-to-video-and-audio on diffusers' LTX2VideoTransformer3DModel (`tuner.archs.ltx2.loaders`).

Latents: the video VAE compresses 32× in space and 8× in time (frame counts 8N+1; pixel sides
multiples of 32; 24 fps), the audio VAE 4× in time and mel bins. A video clip's latent entry holds
`latents` (video) and, when its file has sound and the dataset's `audio` option takes it,
`audio_latents` [C, L, M]: the sound of exactly the clip's frames (`tuner.data.audio`), read at 16 kHz
stereo. Text entries hold the connectors' video and audio contexts and their mask.

The audio stream is `tuner.archs.ltx2.sound.LTX2Sound` (the record's `sound_stream`; the shared part is
`tuner.archs.parts.audio`): training noises both streams at the same t (the release trains them jointly)
and sums their losses; generation denoises both and writes the vocoder's waveform into the mp4.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tuner.archs.ltx2 import loaders as ltx2
from tuner.archs.model import ArchitectureModel
from tuner.archs.parts.audio import draw_sound_noise, video_velocity
from tuner.memory import text_encoder_dtype


class LTX2Model(ArchitectureModel):
    architecture = "ltx2"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return ltx2.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return ltx2.load_vae(self.weights_path("vae"), dtype).to(device)

    def load_latent_encoder(self, device: torch.device, dtype: torch.dtype):
        """The video VAE and the audio VAE (found beside it)."""
        audio_vae = ltx2.load_audio_vae(self.weights_path("vae"), dtype).to(device)
        return nn.ModuleDict({"video": self.load_vae(device, dtype), "audio": audio_vae})

    def encode_latents(self, encoder, pixels: torch.Tensor, controls: list[torch.Tensor]) -> dict:
        return {"latents": ltx2.encode_video(encoder["video"], pixels)}

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return ltx2.encode_video(vae, pixels)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return ltx2.decode_video(vae, latents)

    def load_text_encoder(self, device: torch.device, dtype: str):
        path = self.weights_path("text_encoder")
        model, tokenizer = ltx2.load_text_encoder(
            path, self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, model)
        # beside a single-file Gemma (ComfyUI's), the connectors are those the release's file bundles
        connectors_path = self.weights_path("transformer") if Path(path).is_file() else path
        connectors = ltx2.load_connectors(connectors_path, torch.float32).to(device)
        return model, tokenizer, connectors

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        model, tokenizer, connectors = encoder
        out = ltx2.encode_prompts(model, tokenizer, connectors, captions, self.cfg.cache.text_max_length)
        return [{name: t[i] for name, t in out.items()} for i in range(len(captions))]

    # --- the two streams (`tuner.archs.ltx2.sound`) -----------------------------------------------
    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        return draw_sound_noise(cond, generator)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The video stream's velocity (`tuner.archs.parts.audio.video_velocity`)."""
        return video_velocity(self.sound_stream(), model, noisy, t, cond)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (128, (frames - 1) // 8 + 1, height // 32, width // 32)
