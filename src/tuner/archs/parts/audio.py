"""An audio stream beside the video: what audio-video models (`audio_format` set) share.

The record names its family's `SoundStream` (`sound_stream = "module:Class"`): how a clip's waveform
becomes latents, the shape of a clip's sound latents, the model's velocities of both streams and how sound
latents become a waveform again. Shared code calls it at one point each: caching encodes a clip's sound
beside its pictures (`tuner.cache`), `ArchitectureModel.loss` is `two_stream_loss` and generation denoises
both streams together (`tuner.generate`).

Training noises both streams at the same t (or, where the release gives its sound a schedule of its own,
at that schedule's level for t: `SoundStream.sound_shift`) and the loss is the objective's loss of each
stream, summed. A clip without sound trains video-only: its audio stream is the stream's `silence` at
t = 1 (nothing to learn from, as at the first step of generation) and adds no loss.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.diffusion.timesteps import shift_timesteps
from tuner.dtypes import DTYPES


class SoundStream:
    """What an audio-video family implements for its sound; `family` is its `ArchitectureModel`."""

    sound_shift: float | None = None
    """Where the release runs the sound down a schedule of its own over the video's base grid of levels
    (MiniMax H3: video shift 12, sound shift 3): the sound's shift; the sound is then at
    `sound_levels(t)` when the video is at t. None: both streams at the same t (LTX-2)."""

    def __init__(self, family):
        self.family = family

    def sound_levels(self, t: torch.Tensor, video_shift: float | None = None) -> torch.Tensor:
        """The sound's noise level when the video's is t: the base level u with S_video(u) = t, shifted
        by `sound_shift` (shifts compose: S_a(S_b⁻¹(t)) = S_{a/b}(t)). `video_shift`: the video's
        (generation's); else the record's sampling shift."""
        if self.sound_shift is None:
            return t
        video_shift = video_shift or self.family.record.sampling.shift
        return shift_timesteps(t, self.sound_shift / video_shift)

    def encode(self, encoder, waveform: torch.Tensor) -> dict[str, torch.Tensor]:
        """The latent entry's tensors for a clip's sound, float [channels, samples] at `audio_format`'s
        rate; `encoder` is what the family's `load_latent_encoder` returned."""
        raise NotImplementedError

    def latent_shape(self, frames: int) -> tuple[int, ...]:
        """The shape (without batch) of the sound latents of a clip of `frames` frames."""
        raise NotImplementedError

    def predict_streams(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, noisy_sound: torch.Tensor,
                        sound_t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The model's velocities of both streams (video at t, sound at `sound_t`)."""
        raise NotImplementedError

    def silence(self, model: nn.Module, noisy: torch.Tensor) -> torch.Tensor:
        """The sound stream of a clip without sound (pure noise, given at t = 1)."""
        raise NotImplementedError

    def decode(self, latents: torch.Tensor, device: torch.device, dtype: torch.dtype):
        """Sound latents [1, ...] → (waveform [channels, samples] in [-1, 1], rate)."""
        raise NotImplementedError


def draw_sound_noise(cond: dict, generator: torch.Generator) -> dict:
    """`cond` plus the sound stream's noise, drawn after the video's from the step's generator."""
    audio = cond.get("audio_latents")
    if audio is None:
        return cond
    return {**cond, "audio_noise": torch.randn(audio.shape, generator=generator).to(audio)}


def video_velocity(sound: SoundStream, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor,
                   cond: dict) -> torch.Tensor:  # fmt: skip
    """An audio-video family's `predict`: the video stream's velocity beside the batch's sound
    (`noisy_audio`, at the sound's level for t) or, without, the stream's silence at t = 1."""
    noisy_audio = cond.get("noisy_audio")
    audio_t = sound.sound_levels(t)
    if noisy_audio is None:
        noisy_audio, audio_t = sound.silence(model, noisy), torch.ones_like(t)
    return sound.predict_streams(model, noisy, t, noisy_audio, audio_t, cond)[0]


def two_stream_loss(family, sound: SoundStream, model: nn.Module, x0: torch.Tensor, noise: torch.Tensor,
                    t: torch.Tensor, cond: dict, accelerator) -> torch.Tensor:  # fmt: skip
    """The video stream's loss (with the dataset's loss mask, as the one-stream loss), plus the sound
    stream's where the batch has sound; times the dataset's loss_weight."""
    objective = family.training_objective()
    t = objective.discretize(t)
    dtype = DTYPES[family.cfg.model.dtype]
    noisy = objective.add_noise(x0, noise, t).to(dtype)
    cond = dict(cond)
    weights = cond.pop("loss_mask", None)  # a dataset's cached loss mask (`tuner.data.masks`)
    factor = cond.pop("loss_weight", None)  # a dataset's loss_weight, per sample
    audio = cond.get("audio_latents")
    if audio is None:
        noisy_audio, audio_t = sound.silence(model, noisy), torch.ones_like(t)
    else:
        audio_t = sound.sound_levels(t)
        noisy_audio = objective.add_noise(audio, cond["audio_noise"], audio_t).to(dtype)
    with accelerator.autocast():
        video_pred, audio_pred = sound.predict_streams(model, noisy, t, noisy_audio, audio_t, cond)
    mask = family.loss_mask(x0, cond)
    if weights is not None:
        mask = weights if mask is None else mask * weights
    loss = objective.loss(video_pred.float(), x0, noise, t, mask=mask)
    if audio is not None:
        loss = loss + objective.loss(audio_pred.float(), audio, cond["audio_noise"], audio_t)
    return loss if factor is None else loss * factor.mean()
