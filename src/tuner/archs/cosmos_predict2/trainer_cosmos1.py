"""Cosmos 1.0 Diffusion Text2World and Video2World (7B, 14B) on diffusers' CosmosTransformer3DModel: EDM models.

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
from tuner.archs.cosmos_predict2.trainer_v2w import CosmosPredict2V2WModel, frame_indicator

AUGMENT_SIGMA = 0.001  # CosmosVideoToWorldPipeline's `augment_sigma` (generation)
AUGMENT_LOG_MEAN, AUGMENT_LOG_STD = -3.0, 2.0  # the release's training draw of ln σ_aug


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

    def denoiser_call(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict):
        return self.preconditioned_call(model, noisy, t, cond["context"])

    def preconditioned_call(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                            given: tuple[torch.Tensor, torch.Tensor] | None = None,
                            mask: torch.Tensor | None = None):  # fmt: skip
        """The network's inputs at x_t = `noisy`, its preconditioned input, where `given` ([B, 1, F, 1, 1]
        booleans, the network's input there) puts given frames in place, followed by `mask` (the condition
        mask, if any) and the zero padding mask; and the velocity from its output (EDM's)."""
        edm = self.training_objective()
        scaled, c_noise = edm.model_inputs(noisy, t)
        if given is not None:
            scaled = torch.where(given[0], given[1].to(scaled.dtype), scaled)
        b, c, f, h, w = noisy.shape
        extra = [] if mask is None else [mask.to(noisy.dtype)]
        padding = noisy.new_zeros(b, model.config.in_channels - c - len(extra), f, h, w)
        return {
            "hidden_states": torch.cat([scaled, *extra, padding], dim=1),
            "timestep": c_noise.to(noisy.dtype),
            "encoder_hidden_states": context.to(noisy.dtype),
            "fps": self.record.model_fps,
        }, lambda out: edm.velocity(out, noisy, t)


class Cosmos1V2WModel(Cosmos1T2WModel, CosmosPredict2V2WModel):
    """Cosmos 1.0 Video2World (7B, 14B): video continued from its first latent frames, fed as diffusers'
    CosmosVideoToWorldPipeline feeds them.

    Which frames are given, the loss mask and generation's `--image` are Cosmos-Predict2 Video2World's
    (`trainer_v2w.py`: 1 or 2 latent frames, as NVIDIA's `first_random_n_num_condition_t_max = 2`). What
    differs is the EDM conditioning:

    * the given frames are shown *noised* at their own level σ_aug, preconditioned at it:
      c_in(σ_aug)·(given + σ_aug·n) (the pipeline's `augment_sigma`, 0.001 at generation, n ~ N(0, 1));
      training draws σ_aug = exp(N(−3, 2)) per sample (the release's `augment_sigma_sample_p_mean/_std`);
    * where σ_aug ≥ σ the frames are not given in the input (they hold x_t like the rest), the condition
      mask is kept, as the pipeline's `current_cond_indicator`;
    * one timestep for all frames; the condition mask is a channel of the input; x̂0 on the given frames is
      the given latents (the velocity there the straight line (x_t − given) / t).

    Generation draws no augmentation noise (n = 0; the pipeline draws it at σ_aug = 0.001 each step).
    """

    architecture = "cosmos1_v2w"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return cosmos1.load_transformer(self.weights_path("transformer"), dtype, video2world=True)

    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        """Predict2 Video2World's given frames, with each sample's σ_aug and augmentation noise."""
        cond = super().draw_conditions(x0, cond, generator)
        n = torch.randn(x0.shape[0], generator=generator)
        sigma = torch.exp(AUGMENT_LOG_MEAN + AUGMENT_LOG_STD * n)
        noise = torch.randn(cond["first_frame"].shape, generator=generator)
        return {**cond, "augment_sigma": sigma.to(x0.device), "augment_noise": noise.to(x0.device, x0.dtype)}

    def denoiser_call(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict):
        b, _, f, h, w = noisy.shape
        given = cond.get("given_frames", torch.zeros(b, dtype=torch.long)).to(noisy.device)
        indicator = frame_indicator(given, f)  # [B, 1, F, 1, 1]
        latents = torch.zeros_like(noisy)
        if "first_frame" in cond:
            first = cond["first_frame"].to(noisy.dtype)[:, :, :f]
            latents[:, :, : first.shape[2]] = first
        sigma_aug = cond.get("augment_sigma", torch.full((b,), AUGMENT_SIGMA)).to(noisy.device).float()
        noise = torch.zeros_like(noisy)
        if "augment_noise" in cond:
            noise[:, :, : cond["augment_noise"].shape[2]] = cond["augment_noise"].to(noisy.dtype)[:, :, :f]
        sigma = t.float() / (1 - t.float())
        shown = indicator & (sigma_aug < sigma).view(b, 1, 1, 1, 1)  # the pipeline's current_cond_indicator
        x_aug = latents.float() + sigma_aug.view(b, 1, 1, 1, 1) * noise.float()
        inputs = self.training_objective().inputs_at_sigma(x_aug, sigma_aug)
        mask = indicator.to(noisy.dtype).expand(b, 1, f, h, w)
        call, velocity = self.preconditioned_call(
            model, noisy, t, cond["context"], given=(shown, inputs), mask=mask
        )
        straight = (noisy.float() - latents.float()) / t.float().clamp_min(1e-3).view(b, 1, 1, 1, 1)
        return call, lambda out: torch.where(shown, straight.to(out.dtype), velocity(out))
