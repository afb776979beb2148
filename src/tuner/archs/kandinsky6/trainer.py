"""Kandinsky 6 text-to-video with sound on diffusers' Kandinsky6Transformer3DModel
(`tuner.archs.kandinsky6.loaders`).

Video latents, text encoders and text entries are Kandinsky 5's (HunyuanVideo's VAE: 4N+1 frames at 24
fps, sides multiples of 16; Qwen2.5-VL rows at their true length + CLIP-L pooled), hence a
`Kandinsky5Model` subclass; only the template's crop differs (129 tokens). A video clip's latent entry
also holds `audio_latents` [40, L] when its file has sound and the dataset's `audio` option takes it
(mono 44.1 kHz, MMAudio's VAE).

The audio stream is `tuner.archs.kandinsky6.sound.Kandinsky6Sound` (shared part `tuner.archs.parts.audio`):
training noises both streams at the same t and sums their flow losses; generation denoises both down
the same schedule (the pipeline's two copies of one scheduler) and writes the vocoder's waveform into
the mp4. Sampling: the pipeline's 50 steps and CFG 5 with its negative prompt, at Kandinsky 5's flow
shift 10 (`SAMPLE_SHIFT`: Kandinsky 6's scheduler config could not be read offline).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.kandinsky5.trainer import Kandinsky5Model
from tuner.archs.kandinsky6 import loaders as k6
from tuner.archs.model import ArchitectureModel
from tuner.archs.parts.audio import draw_sound_noise, video_velocity


class Kandinsky6Model(Kandinsky5Model):
    architecture = "kandinsky6"
    pipeline_parts = ArchitectureModel.pipeline_parts  # two streams: its record's `pipeline_refused`

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return k6.load_transformer(self.weights_path("transformer"), dtype)

    def load_latent_encoder(self, device: torch.device, dtype: torch.dtype):
        """The video VAE and the audio VAE (beside it)."""
        audio_vae = k6.load_audio_vae(self.weights_path("vae"), dtype).to(device)
        return nn.ModuleDict({"video": self.load_vae(device, dtype), "audio": audio_vae})

    def encode_latents(self, encoder, pixels: torch.Tensor, controls: list[torch.Tensor]) -> dict:
        return {"latents": self.encode_pixels(encoder["video"], pixels)}

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        return k6.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)

    # --- the two streams (`tuner.archs.kandinsky6.sound`) -------------------------------------------
    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        return draw_sound_noise(cond, generator)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The video stream's velocity (`tuner.archs.parts.audio.video_velocity`)."""
        return video_velocity(self.sound_stream(), model, noisy, t, cond)
