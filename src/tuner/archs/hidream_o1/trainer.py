"""HiDream-O1-Image (full, dev): text-to-image in pixel space on a Qwen3-VL (`tuner.archs.hidream_o1.model`).

Latents: none. The cache holds each resized picture ([3, 1, H, W] in [-1, 1], sides multiples of 32:
`tuner.archs.pixel_space`); the network cuts it into 32×32 patch tokens. Text: the chat-templated prompt's
token ids at their true length (`tuner.archs.hidream_o1.loaders.tokenize`); a batch is padded on the right
with a mask. No text encoder runs: the network embeds the ids itself.

The objective (musubi-tuner's `hidream_o1_train_network.py`, `get_noisy_model_input_and_timesteps` and
`call_dit`): the noise is scaled, x_σ = (1 − σ)·x0 + σ·s·ε with s = 8 (dev: 7.5, ε first clipped to ±2.5 of
its standard deviation), the network is told 1 − σ and predicts x0, and the loss is the mean squared error
to x0 (`PixelFlowObjective`). σ is drawn uniformly (musubi-tuner's default for HiDream-O1). Generation runs
tuner's Euler sampler on the velocity (x_σ − x̂0)/σ (σ floored at 1e-3, as the release's sampler does),
from noise scaled the same way, with classifier-free guidance on that velocity (the release's).

What the published descriptions left open, and what tuner does:
* The release samples full with UniPC and dev with its own "flash" Euler on 28 fixed timesteps; tuner
  samples both with its Euler steps on the shifted schedule (full: shift 3, dev: shift 1), so samples
  differ in detail from the release's, not in kind.
* Image-to-image (reference images read by the vision tower, musubi-tuner's `--task i2i`) is not trained:
  control images are refused (`control_images` is (0, 0)).
* Which checkpoint is dev is read from its name (`dev` in it), as the shapes are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tuner.archs.hidream_o1 import loaders as hidream_o1
from tuner.archs.pixel_space import PixelSpaceImageModel
from tuner.diffusion.timesteps import FlowObjective, loss_weight, weighted_mse

NOISE_SCALE = {"full": 8.0, "dev": 7.5}
"""The noise's standard deviation in training and generation (musubi-tuner's `--noise_scale_start`)."""
NOISE_CLIP_STD = {"full": 0.0, "dev": 2.5}
"""Dev clips ε to ± this many of its standard deviations first (musubi-tuner's `--noise_clip_std`)."""
SIGMA_FLOOR = 1e-3
"""σ below which the velocity is taken at 1e-3 (the release sampler's `T_EPS`)."""


@dataclass(frozen=True)
class PixelFlowObjective(FlowObjective):
    """Flow matching on scaled noise with the clean image as the target (x0-prediction)."""

    noise_scale: float = 8.0
    noise_clip_std: float = 0.0

    def scaled_noise(self, noise: torch.Tensor) -> torch.Tensor:
        if self.noise_clip_std > 0:
            bound = self.noise_clip_std * noise.float().std()
            noise = noise.clamp(-bound, bound)
        return noise * self.noise_scale

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return super().add_noise(x0, self.scaled_noise(noise), t)

    def loss(
        self, pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        weights = loss_weight(t, self.weighting, self.logit_mean, self.logit_std, self.mode_scale)
        return weighted_mse(pred.float(), x0.float(), weights, mask)


class HiDreamO1Model(PixelSpaceImageModel):
    architecture = "hidream_o1"

    @property
    def kind(self) -> str:
        """"dev" or "full", by the transformer's name."""
        return "dev" if hidream_o1.is_dev(self.cfg.model.transformer or "") else "full"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return hidream_o1.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str):
        """The tokenizer (prompts are cached as token ids)."""
        return hidream_o1.load_prompt_tokenizer(self.cfg.model.tokenizer or None, self.weights_path("text_encoder"))

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        return [{"input_ids": ids} for ids in hidream_o1.tokenize(encoder, captions, self.cfg.cache.text_max_length)]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return hidream_o1.padded_ids(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The clean image x̂0 (not a velocity: `PixelFlowObjective` and `sample_flow` take it so)."""
        return hidream_o1.predict_clean(model, noisy, t, cond["input_ids"], cond["text_mask"])

    def training_objective(self) -> PixelFlowObjective:
        if self._objective is None:
            flow = super().training_objective()  # the [timesteps] section checked as for any flow model
            self._objective = PixelFlowObjective(
                flow.weighting, flow.logit_mean, flow.logit_std, flow.mode_scale,
                noise_scale=NOISE_SCALE[self.kind], noise_clip_std=NOISE_CLIP_STD[self.kind],
            )  # fmt: skip
        return self._objective

    def sample_flow(self, model_fn, noise: torch.Tensor, sigmas: torch.Tensor, cond: dict, uncond: dict,
                    guidance_scale: float, progress: bool = False,
                    guidance_method: str = "auto") -> torch.Tensor:  # fmt: skip
        """Euler steps on the velocity (x_σ − x̂0)/σ from noise scaled as in training."""

        def velocity(x: torch.Tensor, t: torch.Tensor, c: dict) -> torch.Tensor:
            sigma = (t.float() / 1000).clamp_min(SIGMA_FLOOR).reshape(-1, *([1] * (x.ndim - 1)))
            return (x.float() - model_fn(x, t, c).float()) / sigma

        noise = self.training_objective().scaled_noise(noise)
        return super().sample_flow(velocity, noise, sigmas, cond, uncond, guidance_scale, progress, guidance_method)
