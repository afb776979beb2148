"""FramePack's generation in sections: the record's `flow_sampler` (`tuner.archs.record.Architecture`).

The release's sampler (inverted anti-drifting) makes the video from its end backwards: sections of up to
`LATENT_WINDOW` latent frames, each denoised on its own (its slice of the noise, one Euler pass given by
generation) with the sections already made after it as clean history and the pipeline's padding. Frame 0
is the image, which every section is anchored on. FramePack-F1 (`sample_sections_f1`) makes them forwards
instead, each given the 19 latent frames before it (the image's first), as diffusers' vanilla sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tuner.archs.framepack import loaders as framepack


def sample_sections(denoise: Callable[[torch.Tensor, dict, dict], torch.Tensor], noise: torch.Tensor,
                    cond: dict, uncond: dict) -> torch.Tensor:  # fmt: skip
    """The whole video [B, C, 1 + F, H, W] from `noise` of that shape; `denoise(noise, cond, uncond)` is one
    Euler pass over a section's latents (the image's frame first) with the section's inputs added."""
    frames = noise.shape[2] - 1
    window = framepack.LATENT_WINDOW
    starts = list(range(0, frames, window))
    paddings = framepack.section_paddings(len(starts), window)
    video = noise.new_zeros(*noise.shape[:2], frames + sum(framepack.HISTORY_SIZES), *noise.shape[3:])
    for start, padding in zip(reversed(starts), paddings):
        stop = min(start + window, frames)
        history = video[:, :, stop : stop + sum(framepack.HISTORY_SIZES)]
        part = {"history": history, "padding": padding}
        section = torch.cat([noise[:, :, :1], noise[:, :, 1 + start : 1 + stop]], dim=2)
        out = denoise(section, {**cond, **part}, {**uncond, **part})
        video[:, :, start:stop] = out[:, :, 1:].to(video)
    return torch.cat([out[:, :, :1].to(video), video[:, :, :frames]], dim=2)


def sample_sections_f1(denoise: Callable[[torch.Tensor, dict, dict], torch.Tensor], noise: torch.Tensor,
                       cond: dict, uncond: dict) -> torch.Tensor:  # fmt: skip
    """F1's forward order: the video [B, C, 1 + F, H, W] section by section from the image on, each section's
    `history` the 19 latent frames before it in time order (zeros, then the image's latent, then the
    sections made so far), as `HunyuanVideoFramepackPipeline` with `sampling_type="vanilla"`."""
    frames, size = noise.shape[2] - 1, sum(framepack.HISTORY_SIZES)
    video = torch.cat([noise.new_zeros(*noise.shape[:2], size - 1, *noise.shape[3:]),
                       cond["first_frame"].to(noise)], dim=2)  # fmt: skip
    for start in range(0, frames, framepack.LATENT_WINDOW):
        stop = min(start + framepack.LATENT_WINDOW, frames)
        part = {"history": video[:, :, -size:]}
        section = torch.cat([noise[:, :, :1], noise[:, :, 1 + start : 1 + stop]], dim=2)
        out = denoise(section, {**cond, **part}, {**uncond, **part})
        video = torch.cat([video, out[:, :, 1:].to(video)], dim=2)
    return torch.cat([out[:, :, :1].to(video), video[:, :, size:]], dim=2)
