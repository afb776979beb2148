"""Cosmos 1.0 Diffusion Text2World (7B, 14B) on diffusers' CosmosTransformer3DModel: an EDM model.

What it shares with Cosmos-Predict2 (`trainer.py`) is inherited: T5-11B text (the pipelines' 512 rows,
zero-padded, no mask), the padding mask as an input channel. What differs:

* latents are the Cosmos tokenizer CV8x8x8's (`loaders_cosmos1`: 8× in time, per-frame statistics, × 0.5);
* the objective is EDM's (`record.objective = "edm"`, `tuner.diffusion.edm`): the network is called on
  c_in·x_σ at c_noise = ¼ ln σ and its output turned into the velocity of its denoised estimate, which
  `predict` returns; the loss weight is EDM's; the timestep sampler's `logit_normal` (the `auto` mode,
  mean 0, std 1) is the release's log-normal σ;
* RoPE positions in time are scaled by 24 / fps (`fps` = the record's `model_fps`, the rate clips are
  resampled to; CosmosTextToWorldPipeline passes its `fps` argument the same way);
* generation runs the pipeline's Karras-σ Euler loop (`edm_sample`); its guidance is on x̂0 as
  cond + g·(cond − uncond), plain classifier-free guidance at g + 1: the pipeline's 7.0 is `--guidance 8`.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.cosmos_predict2 import loaders_cosmos1 as cosmos1
from tuner.archs.cosmos_predict2.trainer import CosmosPredict2Model


class Cosmos1T2WModel(CosmosPredict2Model):
    architecture = "cosmos1_t2w"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return cosmos1.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return cosmos1.load_vae(self.weights_path("vae"), dtype).to(device)

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return cosmos1.encode_video(vae, pixels)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return cosmos1.decode_latents(vae, latents)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (16, (frames - 1) // 8 + 1, height // 8, width // 8)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return self.call_denoiser(model, noisy, noisy, t, cond["context"])

    def call_denoiser(self, model: nn.Module, inputs: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor,
                      context: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The velocity at x_t = `noisy` from the network called on the preconditioned `inputs` (x_t, or
        x_t with given frames in place), then `mask` (the condition mask, if any) and the zero padding mask."""
        edm = self.training_objective()
        scaled, c_noise = edm.model_inputs(inputs, t)
        b, c, f, h, w = noisy.shape
        extra = [] if mask is None else [mask.to(noisy.dtype)]
        padding = noisy.new_zeros(b, model.config.in_channels - c - len(extra), f, h, w)
        out = model(
            hidden_states=torch.cat([scaled, *extra, padding], dim=1),
            timestep=c_noise.to(noisy.dtype),
            encoder_hidden_states=context.to(noisy.dtype),
            fps=self.record.model_fps,
            return_dict=False,
        )[0]
        return edm.velocity(out, noisy, t)
