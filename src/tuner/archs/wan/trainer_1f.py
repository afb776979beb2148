"""One-frame Wan 2.1 (image editing / keyframe training on the I2V 14B model), as musubi-tuner documents it
(its docs/wan_1f.md; the cache layout of its `wan_cache_latents.py --one_frame`).

A dataset item is a target image and a reference (control) image. The Wan I2V network is given a short
"video" of latent frames, one per image, each encoded by the VAE on its own, laid out in the order of their
RoPE time indices: the reference at `one_frame.clean_indices` (default [0]) and the target at
`one_frame.target_index` (default 1, musubi's `target_index=1,control_index=0`). The frames' RoPE time
positions are those indices, not 0, 1, ... (`tuner.archs.wan.frame_positions`), so a target far from the
reference reads as a frame far later in time. The I2V input's 4-channel mask is 1 on the reference frames
and 0 on the target, and its condition latents are the reference's latent there and the latent of an
all-zero image at the target; the CLIP image cross-attention gets the reference's tokens.

As musubi trains it, every frame of that sequence is noised and predicted (the reference frames' targets
are their own latents), so the cache holds per item:

* `latents` [16, F, H, W]: the frames in time order (F = references + 1);
* `cond_latents` [16, F, H, W] and `clip` [tokens, width] (`encode_frame_images` of the reference, also
  what `tuner generate --control REF --frames 1` computes).

The frame order depends on the indices, so they are part of the latent cache key (the record's
`one_frame = "frames"`, `tuner.cache.plan.latent_encoder`): changing them encodes the entries anew. Generation denoises the whole sequence and decodes the target.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.wan.frame_positions import frame_positions
from tuner.archs.wan.trainer_i2v import LatentEncoders, WanI2VModel


class WanOneFrameModel(WanI2VModel):
    architecture = "wan_1f"

    def target_index(self) -> int:
        """The target's time index (`one_frame.target_index`, default 1)."""
        return self.cfg.one_frame.target(self.record.one_frame)

    def frame_indices(self) -> list[int]:
        """The time indices of the sequence's frames, ascending (references and the target)."""
        return sorted([*self.cfg.one_frame.clean_indices, self.target_index()])

    # ---- what the cache holds ----
    def encode_latents(
        self, encoders: LatentEncoders, pixels: torch.Tensor, controls: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        target = self.encode_pixels(encoders.vae, pixels[:, :, :1])
        references = [self.encode_pixels(encoders.vae, c[:, :, :1]) for c in controls]
        return {
            "latents": self._in_time_order(references, target),
            **self.encode_frame_images(encoders, [c[:, :, 0] for c in controls], 1),
        }

    def encode_frame_images(
        self, encoders: LatentEncoders, images: list[torch.Tensor], frames: int
    ) -> dict[str, torch.Tensor]:
        """`cond_latents` [B, 16, F, H', W'] (each reference's latent at its index, an all-zero image's at the
        target's) and `clip` [B, tokens, width] of the reference images ([B, 3, H, W] in [-1, 1])."""
        vae, first = encoders.vae, images[0]
        references = [self.encode_pixels(vae, image.unsqueeze(2)) for image in images]
        blank = self.encode_pixels(vae, torch.zeros_like(first).unsqueeze(2))
        return {
            "cond_latents": self._in_time_order(references, blank),
            "clip": encoders.image_encoder.encode(first),
        }

    def _in_time_order(self, references: list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        """The references' latent frames and the target's, ordered by their time indices."""
        by_index = dict(zip(self.cfg.one_frame.clean_indices, references)) | {self.target_index(): target}
        return torch.cat([by_index[i] for i in self.frame_indices()], dim=2)

    # ---- the model's inputs ----
    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        return cond  # the references are always given

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The velocity of every frame, given the mask (1 on the references), the condition latents and the
        references' CLIP tokens (`model_inputs`), with the frames at their RoPE time indices."""
        with frame_positions(model, self.frame_indices()):
            return super().predict(model, noisy, t, cond)

    def model_inputs(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict[str, torch.Tensor]:
        indices = self.frame_indices()
        given = torch.tensor([float(i in self.cfg.one_frame.clean_indices) for i in indices])
        mask = given.to(noisy).view(1, 1, -1, 1, 1).expand(noisy.shape[0], 4, -1, *noisy.shape[3:])
        return {
            "hidden_states": torch.cat([noisy, mask, cond["cond_latents"].to(noisy)], dim=1),
            "timestep": t * 1000,
            "encoder_hidden_states": cond["context"].to(noisy.dtype),
            **self.image_context(cond, noisy.dtype),
        }

    def pipeline_parts(self, model: nn.Module):
        """The parent's parts, the prologue's rotary tables at the frames' time indices."""
        parts = super().pipeline_parts(model)
        embed = parts.prologue

        def prologue(noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, ...]:
            with frame_positions(model, self.frame_indices()):
                return embed(noisy, t, cond)

        parts.prologue = prologue
        return parts

    # ---- generation ----
    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (16, len(self.frame_indices()), height // 8, width // 8)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """The target's frame only (the sequence's other frames are the references again)."""
        slot = self.frame_indices().index(self.target_index())
        return super().decode_latents(vae, latents[:, :, slot : slot + 1])
