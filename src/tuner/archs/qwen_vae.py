"""`QwenVAEImageModel`: an image model whose latents are the Qwen-Image VAE's (16 channels, 8x smaller).

Qwen-Image (and Edit) and Krea 2 encode single images with the Qwen-Image VAE (the Wan 2.1 architecture,
one frame, normalized per channel with its `latents_mean` / `latents_std`,
`tuner.archs.qwen_image.loaders.encode_images`): their `load_vae`, `encode_pixels`, `decode_latents`
and `latent_shape` ([16, 1, H/8, W/8]) are written here once.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.model import ArchitectureModel
from tuner.archs.qwen_image import loaders as qwen_image


class QwenVAEImageModel(ArchitectureModel):
    """An `ArchitectureModel` whose pixels go through the Qwen-Image VAE, one frame at a time."""

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return qwen_image.load_vae(self.weights_path("vae"), dtype).to(device)

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return qwen_image.encode_images(vae, pixels)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return qwen_image.decode_latents(vae, latents)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        factor = qwen_image.VAE_FACTOR
        return (qwen_image.LATENT_CHANNELS, 1, height // factor, width // factor)
