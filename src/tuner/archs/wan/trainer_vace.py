"""Wan 2.1 VACE (1.3B, 14B): Wan 2.1 text-to-video with a control branch, on diffusers'
WanVACETransformer3DModel.

The control branch reads 96 channels per latent position, built as WanVACEPipeline builds them: the
normalized VAE latents of the control video's kept part (`video * (1 - mask)`) and of its part to
generate (`video * mask`), 16 channels each, then the mask's 8x8 pixels per latent position (64). tuner
trains and generates with the whole control video to follow (the pipeline's default mask of ones, as
for depth, pose or edge videos): the kept part is then a zero video, whose latents are cached with the
control's; the mask channels are ones, made when predicting.

Each item takes one control (`control_images = (1, 1)`): a control video with the item's frames (an
image item: a control image). Inpainting masks and reference images are not trained.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.model import ArchitectureModel
from tuner.archs.wan.trainer import WanModel
from tuner.errors import DataError

MASK_CHANNELS = 64  # the mask's 8x8 pixels under each latent position (the VAE's spatial factor squared)


class WanVACEModel(WanModel):
    architecture = "wan_vace"

    def encode_latents(
        self, vae: nn.Module, pixels: torch.Tensor, controls: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        if controls[0].shape[2] != pixels.shape[2]:
            raise DataError(
                f"a Wan VACE control has {controls[0].shape[2]} frame(s) and its item {pixels.shape[2]}: a video "
                "item takes a control video (its frames are read with the item's), an image item a control image."
            )
        return super().encode_latents(vae, pixels, controls)

    pipeline_parts = ArchitectureModel.pipeline_parts  # the control branch runs beside the blocks

    def model_inputs(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict[str, torch.Tensor]:
        """Wan's inputs plus the control branch's: the cached control latents and a mask of ones."""
        control = cond["control_0"].to(noisy.dtype)
        if control.shape[2:] != noisy.shape[2:]:
            raise DataError(
                f"the control's latents {tuple(control.shape[2:])} do not match the clip's "
                f"{tuple(noisy.shape[2:])}: a control video needs as many frames as its item."
            )
        mask = control.new_ones(control.shape[0], MASK_CHANNELS, *control.shape[2:])
        return {
            **super().model_inputs(noisy, t, cond),
            "control_hidden_states": torch.cat([control, mask], 1),
        }


def encode_control(family: WanVACEModel, vae: nn.Module, pixels: torch.Tensor, index: int) -> torch.Tensor:
    """The record's `control_encoder`: [B, 32, F', H', W'], the latents of the zero kept part, then of the
    control video (the whole of it to follow), as WanVACEPipeline's `prepare_video_latents` with a mask of
    ones."""
    return torch.cat(
        [family.encode_pixels(vae, torch.zeros_like(pixels)), family.encode_pixels(vae, pixels)], 1
    )
