"""`Flux2VAEImageModel`: an image model whose latents are the FLUX.2 VAE's (32 channels, 8x, 2x2-patchified).

FLUX.2 (dev, klein) and ERNIE-Image encode single images with `AutoencoderKLFlux2`: the distribution's
mode, patchified 2x2 into 128 channels at 1/16 of the pixel size and normalized by the VAE's BatchNorm
running statistics (`tuner.archs.flux2.loaders.encode_images`). Their `load_vae`, `encode_pixels`,
`decode_latents` and `latent_shape` ([128, H/16, W/16]) are written here once. The BatchNorm ε is the VAE
config's unless a model sets `batch_norm_eps` (ERNIE-Image was trained with 1e-5 where the released VAE
config says 1e-4: ErnieImagePipeline hard-codes it).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.flux2 import loaders as flux2
from tuner.archs.model import ArchitectureModel

LATENT_CHANNELS = 128  # 32 VAE channels × the 2×2 patch


class Flux2VAEImageModel(ArchitectureModel):
    """An `ArchitectureModel` whose pixels go through the FLUX.2 VAE, one image at a time."""

    batch_norm_eps: float | None = None
    """The ε of the latent normalization; None: the VAE config's `batch_norm_eps`."""

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        vae = flux2.load_vae(self.weights_path("vae"), dtype)
        if self.batch_norm_eps is not None:
            vae.register_to_config(batch_norm_eps=self.batch_norm_eps)
        return vae.to(device)

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return flux2.encode_images(vae, self.single_images(pixels))

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return flux2.decode_latents(vae, latents).unsqueeze(2)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (LATENT_CHANNELS, height // 16, width // 16)
