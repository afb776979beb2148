"""Wan 2.1 VACE (1.3B, 14B): Wan 2.1 text-to-video with a control branch, on diffusers'
WanVACETransformer3DModel.

The control branch reads 96 channels per latent position, built as WanVACEPipeline builds them: the
normalized VAE latents of the control video's kept part (`video * (1 - mask)`) and of its part to
generate (`video * mask`), 16 channels each, then the mask's 8x8 pixels per latent position (64).

Each item takes a control video with the item's frames (an image item: a control image) and optionally a
mask video (white where to generate: inpainting, outpainting). Without a mask the whole control video is
followed (depth, pose, edges: the pipeline's default mask of ones): its kept part is a zero video, and the
mask channels are ones, made when predicting. Reference images are not supported.
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
        if any(control.shape[2] != pixels.shape[2] for control in controls):
            raise DataError(
                f"a Wan VACE control has {controls[0].shape[2]} frame(s) and its item {pixels.shape[2]}: a video "
                "item takes a control video (its frames are read with the item's), an image item a control image."
            )
        return super().encode_latents(vae, pixels, controls)

    pipeline_parts = ArchitectureModel.pipeline_parts  # the control branch runs beside the blocks

    def model_inputs(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict[str, torch.Tensor]:
        """Wan's inputs plus the control branch's: the cached control latents and mask (ones without one)."""
        control = cond["control_0"].to(noisy.dtype)
        if control.shape[2:] != noisy.shape[2:]:
            raise DataError(
                f"the control's latents {tuple(control.shape[2:])} do not match the clip's "
                f"{tuple(noisy.shape[2:])}: a control video needs as many frames as its item."
            )
        mask = cond.get("control_1")  # without a mask video: ones, the whole control video to follow
        mask = (
            control.new_ones(control.shape[0], MASK_CHANNELS, *control.shape[2:])
            if mask is None
            else mask.to(control)
        )
        return {
            **super().model_inputs(noisy, t, cond),
            "control_hidden_states": torch.cat([control, mask], 1),
        }


def encode_controls(
    family: WanVACEModel, vae: nn.Module, controls: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The record's `control_encoder`, as WanVACEPipeline's `prepare_video_latents` and `prepare_masks`:
    `control_0` [B, 32, F', H', W'], the latents of the control video's kept part (where the mask is black),
    then of its part to generate (white; the whole video without a mask), and with a mask `control_1`
    [B, 64, F', H', W'], its first channel's 8x8 pixels under each latent position, resampled to the latent
    frames (nearest)."""
    video = controls[0]
    if len(controls) == 1:
        return {
            "control_0": torch.cat(
                [family.encode_pixels(vae, torch.zeros_like(video)), family.encode_pixels(vae, video)], 1
            )
        }
    mask = ((controls[1] + 1) / 2).clamp(0, 1)
    given = (mask > 0.5).to(video.dtype)
    kept, generated = family.encode_pixels(vae, video * (1 - given)), family.encode_pixels(vae, video * given)
    b, _, frames, height, width = mask.shape
    packed = (
        mask[:, 0].reshape(b, frames, height // 8, 8, width // 8, 8).permute(0, 3, 5, 1, 2, 4).flatten(1, 2)
    )
    packed = torch.nn.functional.interpolate(packed, size=kept.shape[2:], mode="nearest-exact")
    return {"control_0": torch.cat([kept, generated], 1), "control_1": packed.to(kept.dtype)}
