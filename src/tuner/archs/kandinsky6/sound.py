"""Kandinsky 6's audio stream (the record's `sound_stream`; what audio-video models share is
`tuner.archs.parts.audio`): mono 44.1 kHz through MMAudio's VAE, 40 latent channels, one latent per 1024
samples; the vocoder turns decoded mels back into a waveform.

Both streams share one timestep (the transformer takes one; the pipeline steps the sound with a copy of the
video's scheduler), so the sound is noised at the video's t. A clip without sound trains the video path
alone, as the pipeline generates with `sample_audio=False`: its sound stream is empty (`silence`) and the
model is called without audio.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.kandinsky6 import loaders as k6
from tuner.archs.parts.audio import SoundStream


class Kandinsky6Sound(SoundStream):
    def encode(self, encoder, waveform: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"audio_latents": k6.encode_audio(encoder["audio"], waveform)}

    def latent_shape(self, frames: int) -> tuple[int, ...]:
        """40 channels × the pipeline's audio length for the clip's frames at 24 fps."""
        return (k6.AUDIO_CHANNELS, k6.audio_latent_length(frames, self.family.record.model_fps))

    def predict_streams(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, noisy_sound: torch.Tensor,
                        sound_t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Both velocities at the video's t (the model has one timestep; `sound_t` is t or, without sound,
        unused). An empty sound stream runs the video path alone."""
        video, sound = k6.predict_velocities(
            model, noisy, t, noisy_sound if noisy_sound.shape[-1] else None, cond
        )
        return video, noisy_sound if sound is None else sound

    def silence(self, model: nn.Module, noisy: torch.Tensor) -> torch.Tensor:
        """No sound: an empty stream (the model then runs its video path alone)."""
        return noisy.new_zeros(noisy.shape[0], k6.AUDIO_CHANNELS, 0)

    def decode(self, latents: torch.Tensor, device: torch.device, dtype: torch.dtype):
        vae = self.family.weights_path("vae")
        audio_vae = k6.load_audio_vae(vae, dtype).to(device)
        vocoder = k6.load_vocoder(vae, dtype).to(device)
        waveform = k6.decode_audio(audio_vae, vocoder, latents.to(device))
        return waveform.clamp(-1, 1), audio_vae.config.sample_rate
