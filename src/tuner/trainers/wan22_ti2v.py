"""Wan 2.2 TI2V-5B: text-to-video and image-to-video in one 5B Wan network on the Wan 2.2 VAE's latents.

Latents: the Wan 2.2 VAE (`tuner.models.wan22_vae`), 48 channels at 16× spatial and 4× temporal
compression, normalized with its own per-channel statistics. With the transformer's 1×2×2 patches a
token covers 32×32 pixels, so sides are multiples of 32; frame counts are 4N+1, at 24 fps. Text is
UMT5-XXL, as in Wan 2.1. Sampling defaults to shift 5 (the release's).

Image-to-video needs no extra input channels: the given image's latent frame *replaces* the first
latent frame, and every token carries its own timestep, 0 on that frame and t elsewhere (diffusers'
`expand_timesteps`: the pipeline builds a [B, tokens] timestep from a first-frame mask). The model
never predicts the given frame, so training leaves it out of the loss. One model, both tasks, so it
trains on both kinds of item:

* an image item is one latent frame: text-to-image, everything noised;
* a video item trains image-to-video (its own first latent frame given clean) with probability
  `train.first_frame_conditioning_p` (default 0.5 here), else text-to-video: its first frame noised like
  the others and counted in the loss, the text-to-video pipeline's input. The coin is drawn per sample
  from the step's seeded generator after the noise and t (`draw_conditions`), so runs resume exactly.

The first latent frame of a video is the VAE's encoding of the first picture alone (the VAE is causal
and encodes the first frame as its own chunk), which is what the pipeline encodes from the given image.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.models import wan
from tuner.trainers.wan import WanTrainer


class Wan22TI2VTrainer(WanTrainer):
    architecture = "wan22_ti2v"
    spatial_step = 32  # 16× VAE × 2×2 patches
    model_fps = 24.0
    sample_shift = 5.0
    first_frame_image = True
    in_channels = 48

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return wan.load_vae(self.weights_path("vae"), dtype, "2.2", self.architecture).to(device)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (48, (frames - 1) // 4 + 1, height // 16, width // 16)

    # ---- text-to-video or image-to-video, per sample ----
    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        """Which video samples are given their first latent frame (`clean_first`), and that frame."""
        coin = self.first_frame_given(x0, generator)
        clean = coin & (x0.shape[2] > 1)  # an image is one frame: giving it leaves nothing to learn
        return {**cond, "first_frame": x0[:, :, :1], "clean_first": clean}

    def loss_mask(self, x0: torch.Tensor, cond: dict) -> torch.Tensor | None:
        clean = cond.get("clean_first")
        if clean is None or not clean.any():
            return None
        mask = torch.ones(x0.shape[0], 1, x0.shape[2], 1, 1, device=x0.device)
        mask[clean, :, 0] = 0
        return mask

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The velocity at x_t; rows with `cond["clean_first"]` get `cond["first_frame"]` as their first
        latent frame at timestep 0, the rest of their tokens at t (as the pipeline's per-token timestep).

        For a given frame the returned velocity is the straight line from x_t to that frame, (x_t − x0)/t:
        sampling then ends exactly on the given latent (the pipeline overwrites it instead), and training
        masks it out. Batches without a given frame use one timestep per sample, which is the same
        computation without the per-token embedding's memory (a test checks that they agree).
        """
        clean = cond.get("clean_first")
        if clean is None or not clean.any():
            return super().predict(model, noisy, t, cond)
        rows = clean.view(-1, 1, 1, 1, 1)
        first = cond["first_frame"].to(noisy.dtype)
        given = torch.cat([torch.where(rows, first, noisy[:, :, :1]), noisy[:, :, 1:]], dim=2)
        frames, height, width = noisy.shape[2:]
        per_token = t.view(-1, 1, 1).expand(-1, frames, (height // 2) * (width // 2))
        first_t = torch.where(clean.view(-1, 1), torch.zeros_like(per_token[:, 0]), per_token[:, 0])
        timestep = torch.cat([first_t.unsqueeze(1), per_token[:, 1:]], dim=1).flatten(1)
        out = super().predict(model, given, timestep, cond)
        straight = (noisy[:, :, :1].float() - first.float()) / t.float().clamp_min(1e-3).view(-1, 1, 1, 1, 1)
        return torch.cat([torch.where(rows, straight.to(out.dtype), out[:, :, :1]), out[:, :, 1:]], dim=2)
