"""Ideogram 4 on diffusers' Ideogram4Transformer2DModel.

Latents: the FLUX.2 VAE (8x, 32 channels) patchified 2x2 into 128 values per token and normalized by its
BatchNorm statistics (`tuner.archs.ideogram4.loaders`); pixel sides are multiples of 16 and each latent
pixel is one token. Text: the 13 stacked Qwen3-VL-8B layers of each caption, [L, 53248] at its true
length; a batch is left-padded to its longest caption, as Ideogram4Pipeline packs it.

Guidance: the pipeline's v = w·v_cond + (1 − w)·v_uncond, tuner's formula. Its unconditional pass runs a
second, unconditional transformer on the image tokens alone; tuner runs that image-only pass through the
transformer it loaded (the empty negative prompt encodes to no text rows), so `tuner generate`
equals the pipeline given the same transformer for both. Sampling follows the pipeline's logit-normal
schedule (mean 0.5·ln(pixels / 512²), std 1.5), not a shifted linear one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tuner.archs.flux2 import loaders as flux2
from tuner.archs.ideogram4 import loaders as ideogram4
from tuner.archs.ideogram4 import text as ideogram4_text
from tuner.archs.model import ArchitectureModel, padded_prompts
from tuner.memory import text_encoder_dtype
from tuner.models.qwen3_vl import TextEncoder

LATENT_CHANNELS = 128  # 32 VAE channels x the 2x2 patch
SCHEDULE_STD = 1.5  # Ideogram4Pipeline's `std`
# the pipeline's clamp of model time, from log-SNR in [-15, 18]
_T_MIN, _T_MAX = 1 / (1 + math.exp(9.0)), 1 / (1 + math.exp(-7.5))


def logit_normal_sigmas(steps: int, noise: torch.Tensor, std: float = SCHEDULE_STD) -> torch.Tensor:
    """The record's `flow_schedule`: `steps + 1` noise levels from about 1 down to 0 for latents shaped as
    `noise` [B, 128, H/16, W/16]: Ideogram4Pipeline's schedule, the logit-normal quantiles at evenly spaced
    probabilities with mean 0.5·ln(pixels / 512²), clamped as it clamps."""
    mu = 0.5 * math.log(noise.shape[-2] * noise.shape[-1] * 256 / 512**2)
    p = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float64)
    t = (1 - torch.special.expit(mu + std * torch.special.ndtri(p))).clamp(_T_MIN, _T_MAX)
    sigmas = (1 - t).flip(0)[:-1].float()
    return torch.cat([sigmas, sigmas.new_zeros(1)])


class Ideogram4Model(ArchitectureModel):
    architecture = "ideogram4"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return ideogram4.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return flux2.load_vae(self.weights_path("vae"), dtype).to(device)

    def load_text_encoder(self, device: torch.device, dtype: str) -> TextEncoder:
        encoder = ideogram4_text.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return flux2.encode_images(vae, self.single_images(pixels), ideogram4.patchify)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return flux2.decode_latents(vae, latents, ideogram4.unpatchify).unsqueeze(2)

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        embeds = ideogram4_text.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)
        return [{"prompt_embeds": e} for e in embeds]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return padded_prompts(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return ideogram4.predict_velocity(model, noisy, t, cond["prompt_embeds"], cond["prompt_mask"])

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import cut_at_blocks

        blocks = model.layers
        embedders = (
            model.input_proj,
            model.t_embedding,
            model.adaln_proj,
            model.llm_cond_norm,
            model.llm_cond_proj,
            model.embed_image_indicator,
        )
        return cut_at_blocks(
            model,
            ideogram4,
            lambda noisy, t, cond: ideogram4.model_inputs(
                noisy, t, cond["prompt_embeds"], cond["prompt_mask"]
            ),
            blocks,
            embedders,
        )

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (LATENT_CHANNELS, height // 16, width // 16)
