"""Wan 2.2 TI2V-5B: text-to-video and image-to-video in one 5B Wan network on the Wan 2.2 VAE's latents.

Latents: the Wan 2.2 VAE (`tuner.archs.wan.wan22_vae`), 48 channels at 16× spatial and 4× temporal
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

from tuner.archs.first_frame import (
    FirstFrameModel,
    first_frame_rows,
    given_first_frame,
    straight_to_given,
)
from tuner.archs.wan import loaders as wan
from tuner.archs.wan.trainer import WanModel


class Wan22TI2VModel(FirstFrameModel, WanModel):
    architecture = "wan22_ti2v"
    in_channels = 48

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return wan.load_vae(self.weights_path("vae"), dtype, "2.2", self.architecture).to(device)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (48, (frames - 1) // 4 + 1, height // 16, width // 16)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The velocity at x_t; rows with `cond["clean_first"]` get `cond["first_frame"]` as their first
        latent frame at timestep 0, the rest of their tokens at t (as the pipeline's per-token timestep;
        `model_inputs`).

        For a given frame the returned velocity is the straight line from x_t to that frame, (x_t − x0)/t:
        sampling then ends exactly on the given latent (the pipeline overwrites it instead), and training
        masks it out. Batches without a given frame use one timestep per sample, which is the same
        computation without the per-token embedding's memory (a test checks that they agree).
        """
        return self._to_given(super().predict(model, noisy, t, cond), noisy, t, cond)

    def model_inputs(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict[str, torch.Tensor]:
        clean = first_frame_rows(cond)
        if clean is None:
            return super().model_inputs(noisy, t, cond)
        frames, height, width = noisy.shape[2:]
        per_token = t.view(-1, 1, 1).expand(-1, frames, (height // 2) * (width // 2))
        first_t = torch.where(clean.view(-1, 1), torch.zeros_like(per_token[:, 0]), per_token[:, 0])
        timestep = torch.cat([first_t.unsqueeze(1), per_token[:, 1:]], dim=1).flatten(1)
        return super().model_inputs(given_first_frame(noisy, cond, clean), timestep, cond)

    def pipeline_parts(self, model: nn.Module):
        parts = super().pipeline_parts(model)
        project = parts.epilogue
        parts.epilogue = lambda carried, noisy, t, cond: self._to_given(project(carried, noisy, t, cond), noisy,
                                                                       t, cond)  # fmt: skip
        return parts

    @staticmethod
    def _to_given(out: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        clean = first_frame_rows(cond)
        return out if clean is None else straight_to_given(out, noisy, t, cond, clean)
