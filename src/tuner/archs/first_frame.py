"""Text-and-image-to-video in one network: a video's first latent frame given clean, or not, per sample.

Models that do both tasks with one set of weights (Wan 2.2 TI2V-5B, LTX-Video) take an image the same
way: the image's latent frame *replaces* the first latent frame of x_t, its tokens get timestep 0 while
the others get t, and the model's output there is never used (the pipelines keep the given latent). A
causal video VAE encodes a clip's first picture alone as its first latent frame, so training takes the
given frame from the clip's own latents and the cache holds nothing more.

`FirstFrameModel` mixes this into a trainer: `draw_conditions` picks the samples given their frame
(`train.first_frame_conditioning_p`; the others train text-to-video, every frame noised and in the loss),
`loss_mask` leaves a given frame out. The trainer's `predict` builds the input with `given_first_frame`
and the per-token timestep from `first_frame_rows`, and returns `straight_to_given` of its output: on a
given frame, the straight line from x_t to it, so sampling ends exactly on it.
"""

from __future__ import annotations

import torch


class FirstFrameModel:
    """Mixed in before an `ArchitectureModel` subclass (see the module docstring)."""

    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        """Which video samples are given their first latent frame (`clean_first`), and that frame."""
        coin = self.first_frame_given(x0, generator)
        clean = coin & (x0.shape[2] > 1)  # an image is one frame: giving it leaves nothing to learn
        return {**cond, "first_frame": x0[:, :, :1], "clean_first": clean}

    def loss_mask(self, x0: torch.Tensor, cond: dict) -> torch.Tensor | None:
        clean = first_frame_rows(cond)
        if clean is None:
            return None
        mask = torch.ones(x0.shape[0], 1, x0.shape[2], 1, 1, device=x0.device)
        mask[clean, :, 0] = 0
        return mask


def first_frame_rows(cond: dict) -> torch.Tensor | None:
    """The rows [B] (bool) given their first frame, or None when no row is."""
    clean = cond.get("clean_first")
    return clean if clean is not None and clean.any() else None


def given_first_frame(noisy: torch.Tensor, cond: dict, clean: torch.Tensor) -> torch.Tensor:
    """x_t with the given rows' first latent frame replaced by `cond["first_frame"]`."""
    rows = clean.view(-1, 1, 1, 1, 1)
    first = cond["first_frame"].to(noisy.dtype)
    return torch.cat([torch.where(rows, first, noisy[:, :, :1]), noisy[:, :, 1:]], dim=2)


def straight_to_given(out: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor, cond: dict,
                      clean: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The model's velocity `out`, with the given rows' first frame replaced by (x_t − given) / t."""
    first = cond["first_frame"].to(noisy.dtype)
    straight = (noisy[:, :, :1].float() - first.float()) / t.float().clamp_min(1e-3).view(-1, 1, 1, 1, 1)
    rows = clean.view(-1, 1, 1, 1, 1)
    return torch.cat([torch.where(rows, straight.to(out.dtype), out[:, :, :1]), out[:, :, 1:]], dim=2)
