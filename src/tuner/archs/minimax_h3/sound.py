"""MiniMax H3's audio stream (the record's `sound_stream`; what audio-video models share is
`tuner.archs.parts.audio`): stereo 32 kHz through the mono audio VAE (each channel a batch item), 40
latents per second of 32 channels, packed channel-major into the same sequence as the video and text.

The release runs the sound down its own schedule: shift 3 where the video's is 12, over one base grid
(`MiniMaxH3SetTimestepsStep`; ComfyUI's MiniMaxH3SigmaShift node and the H3 Turbo release name the same
pair), so the sound is at S_{3/12}(σ) when the video is at σ, in training as in generation
(`SoundStream.sound_shift`).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.minimax_h3 import loaders as h3
from tuner.archs.parts.audio import SoundStream


class MiniMaxH3Sound(SoundStream):
    sound_shift = h3.AUDIO_SHIFT

    def encode(self, encoder, waveform: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"audio_latents": h3.encode_audio(encoder["audio"], waveform)}

    def latent_shape(self, frames: int) -> tuple[int, ...]:
        """2 channels × 32 latent channels × the clip's duration at 40 latents per second."""
        return (h3.AUDIO_CHANNELS, 32, h3.audio_latent_frames(frames, self.family.record.model_fps))

    def predict_streams(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, noisy_sound: torch.Tensor,
                        sound_t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return h3.predict_velocities(model, noisy, t, noisy_sound, sound_t, self.family.prompts(cond))

    def silence(self, model: nn.Module, noisy: torch.Tensor) -> torch.Tensor:
        """Pure noise as long as the clip (deterministic in the clip's own latents, so that validation
        repeats it)."""
        frames = self.family.pixel_frames(noisy.shape[2])
        shape = (noisy.shape[0], h3.AUDIO_CHANNELS, model.config.audio_in_channels)
        gen = torch.Generator().manual_seed(int(noisy.shape.numel()))
        length = max(h3.audio_latent_frames(frames, self.family.record.model_fps), 1)
        return torch.randn((*shape, length), generator=gen).to(noisy)

    def decode(self, latents: torch.Tensor, device: torch.device, dtype: torch.dtype):
        audio_vae = h3.load_audio_vae(self.family.weights_path("vae"), dtype).to(device)
        waveform = h3.decode_audio(audio_vae, latents[0].to(device))
        return waveform.clamp(-1, 1), audio_vae.config.sampling_rate
