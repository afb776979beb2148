"""`FluxVAEImageModel`: an image model whose latents are the FLUX.1 VAE's (16 channels, 8× smaller).

FLUX.1 and Chroma, HiDream, Z-Image, Lumina 2 and SD 3.5 all encode single images with the FLUX.1 kind
of autoencoder (16 channels, normalized with its shift and scaling factors,
`tuner.archs.flux.loaders.encode_images`): their `load_vae` (SD 3.5 loads its own files),
`encode_pixels`, `decode_latents` and `latent_shape` are written here once. A clip of more than one
frame is refused (these are image models).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.flux import loaders as flux
from tuner.archs.model import ArchitectureModel


class FluxVAEImageModel(ArchitectureModel):
    """An `ArchitectureModel` whose pixels go through the FLUX.1 VAE, one image at a time."""

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return flux.load_vae(self.weights_path("vae"), dtype).to(device)

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return flux.encode_images(vae, self.single_images(pixels))

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return flux.decode_latents(vae, latents).unsqueeze(2)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (16, height // 8, width // 8)
