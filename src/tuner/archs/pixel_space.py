"""`PixelSpaceImageModel`: an image model that denoises pixels, with no VAE (HiDream-O1).

A latent diffusion model caches what its VAE makes of each picture; a pixel-space model trains on the
picture itself. Everything downstream of "the latent" stays the same if the latent *is* the resized
picture: the cache stores it under the same keys (the bucket, the crop, the source file's bytes, the
dtype, the architecture: `Architecture.latent_space = "pixels"` names what the entries hold, and with no
`latent_encoders` no weights are part of the key), training noises it, generation starts from noise of its
shape and "decodes" by clamping. So the codec here is the identity: [B, 3, 1, H, W] in [-1, 1] in and out,
in `model.vae_dtype` (fp32 by default: bf16 would round 8-bit pixels).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.model import ArchitectureModel


class PixelCodec(nn.Module):
    """What a pixel-space model has for a VAE: nothing to load, nothing to compute."""


class PixelSpaceImageModel(ArchitectureModel):
    """An `ArchitectureModel` whose latents are the images' pixels, one frame, 3 channels in [-1, 1]."""

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return PixelCodec()

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return self.single_images(pixels).unsqueeze(2).clone()

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return latents.float().clamp(-1.0, 1.0)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (3, 1, height, width)
