"""LTX-2's audio stream (the record's `sound_stream`; what audio-video models share is
`tuner.archs.parts.audio`): the audio VAE compresses 4× in time and mel bins, read at 16 kHz stereo; the
vocoder turns decoded mels back into a waveform."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tuner.archs.ltx2 import loaders as ltx2
from tuner.archs.parts.audio import SoundStream


class LTX2Sound(SoundStream):
    def encode(self, encoder, waveform: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"audio_latents": ltx2.encode_audio(encoder["audio"], waveform)}

    def latent_shape(self, frames: int) -> tuple[int, ...]:
        """As LTX2Pipeline: the clip's duration at 24 fps × 25 latent audio frames per second (16 kHz,
        hop 160, 4× compression); 8 channels × 16 mel bins."""
        return (8, round(frames / self.family.record.model_fps * 16000 / 160 / 4), 16)

    def predict_streams(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, noisy_sound: torch.Tensor,
                        sound_t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The model's velocities of both streams: video [B, C, F, H, W] and audio [B, C, L, M]. LTX-2.3's
        text cross-attention is modulated by each stream's own noise level (`sigma`, `audio_sigma`)."""
        b, _, frames, height, width = noisy.shape
        mel_bins = noisy_sound.shape[-1]
        mask = cond["text_mask"]
        video, audio = model(
            hidden_states=noisy.flatten(2).transpose(1, 2),
            audio_hidden_states=ltx2.pack_audio(noisy_sound).to(noisy.dtype),
            encoder_hidden_states=cond["video_context"].to(noisy.dtype),
            audio_encoder_hidden_states=cond["audio_context"].to(noisy.dtype),
            timestep=(t * 1000).to(noisy.dtype),
            audio_timestep=(sound_t * 1000).to(noisy.dtype),
            sigma=(t * 1000).to(noisy.dtype),
            audio_sigma=(sound_t * 1000).to(noisy.dtype),
            # LTX-2.3 modulates each stream's cross-modal attention by the other stream's noise level
            # (diffusers' `use_cross_timestep`, "the LTX-2.3 behavior"); LTX-2 by its own
            use_cross_timestep=model.config.cross_attn_mod,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=frames,
            height=height,
            width=width,
            fps=self.family.record.model_fps,
            audio_num_frames=noisy_sound.shape[2],
            return_dict=False,
        )
        video = video.transpose(1, 2).reshape(b, -1, frames, height, width)
        return video, ltx2.unpack_audio(audio, mel_bins)

    def silence(self, model: nn.Module, noisy: torch.Tensor) -> torch.Tensor:
        """Pure noise as long as the clip (deterministic in the clip's own latents so that validation
        repeats it)."""
        cfg, record = model.config, self.family.record
        per_second = cfg.audio_sampling_rate / cfg.audio_hop_length / cfg.audio_scale_factor
        frames = max(round((noisy.shape[2] - 1) * record.frame_multiple / record.model_fps * per_second), 1)
        mel_bins = cfg.audio_in_channels // 8  # the audio VAE's 8 latent channels share the token
        seed = int(noisy.shape.numel())
        gen = torch.Generator().manual_seed(seed)
        return torch.randn((noisy.shape[0], 8, frames, mel_bins), generator=gen).to(noisy)

    def decode(self, latents: torch.Tensor, device: torch.device, dtype: torch.dtype):
        path = self.family.weights_path("vae")
        audio_vae = ltx2.load_audio_vae(path, dtype).to(device)
        # the vocoder is in the diffusers folder (`vocoder/`) or bundled in the release's file
        # (`vocoder.*`); beside a file without it, the text encoder's diffusers folder holds it
        vocoder_path = path
        if Path(path).is_file() and not ltx2.bundles(path, "vocoder"):
            vocoder_path = self.family.weights_path("text_encoder")
        vocoder = ltx2.load_vocoder(vocoder_path, dtype).to(device)
        waveform = ltx2.decode_audio(audio_vae, vocoder, latents.to(device))[0]
        return waveform.clamp(-1, 1), vocoder.config.output_sampling_rate
