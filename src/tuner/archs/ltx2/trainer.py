"""LTX-2 text-to-video-and-audio on diffusers' LTX2VideoTransformer3DModel (`tuner.archs.ltx2.loaders`).

Latents: the video VAE compresses 32× in space and 8× in time (frame counts 8N+1; pixel sides
multiples of 32; 24 fps), the audio VAE 4× in time and mel bins. A video clip's latent entry holds
`latents` (video) and, when its file has sound and the dataset's `audio` option takes it,
`audio_latents` [C, L, M]: the sound of exactly the clip's frames (`tuner.data.audio`), read at 16 kHz
stereo. Text entries hold the connectors' video and audio contexts and their mask.

Training noises both streams at the same t (the release trains them jointly) and the loss is the
flow-matching loss of each stream, summed. A clip without sound trains video-only: its audio stream is
pure noise at t = 1 (nothing to learn from, as at the first step of generation) and adds no loss.
Generation denoises both streams and writes the vocoder's waveform into the mp4.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.ltx2 import loaders as ltx2
from tuner.archs.model import ArchitectureModel
from tuner.dtypes import DTYPES
from tuner.memory import place_text_encoder, text_encoder_dtype


class LTX2Model(ArchitectureModel):
    architecture = "ltx2"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return ltx2.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return ltx2.load_vae(self.weights_path("vae"), dtype).to(device)

    def load_latent_encoder(self, device: torch.device, dtype: torch.dtype):
        """The video VAE and the audio VAE (found beside it)."""
        audio_vae = ltx2.load_audio_vae(self.weights_path("vae"), dtype).to(device)
        return nn.ModuleDict({"video": self.load_vae(device, dtype), "audio": audio_vae})

    def encode_latents(self, encoder, pixels: torch.Tensor, controls: list[torch.Tensor]) -> dict:
        return {"latents": ltx2.encode_video(encoder["video"], pixels)}

    def encode_audio(self, encoder, waveform: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"audio_latents": ltx2.encode_audio(encoder["audio"], waveform)}

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return ltx2.encode_video(vae, pixels)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return ltx2.decode_video(vae, latents)

    def load_text_encoder(self, device: torch.device, dtype: str):
        path = self.weights_path("text_encoder")
        model, tokenizer = ltx2.load_text_encoder(
            path, self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        model = place_text_encoder(model, dtype, device, self.cfg.cache.text_encoder_blocks_to_swap)
        connectors = ltx2.load_connectors(path, torch.float32).to(device)
        return model, tokenizer, connectors

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        model, tokenizer, connectors = encoder
        out = ltx2.encode_prompts(model, tokenizer, connectors, captions, self.cfg.cache.text_max_length)
        return [{name: t[i] for name, t in out.items()} for i in range(len(captions))]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {name: torch.stack([e[name] for e in entries]) for name in entries[0]}

    # --- the two streams ------------------------------------------------------------------------
    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        """The audio stream's noise, drawn after the video's from the step's generator."""
        audio = cond.get("audio_latents")
        if audio is None:
            return cond
        return {**cond, "audio_noise": torch.randn(audio.shape, generator=generator).to(audio)}

    def forward_streams(
        self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, noisy_audio: torch.Tensor, audio_t: torch.Tensor,
        cond: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The model's velocities of both streams: video [B, C, F, H, W] and audio [B, C, L, M]."""
        b, _, frames, height, width = noisy.shape
        mel_bins = noisy_audio.shape[-1]
        mask = cond["text_mask"]
        video, audio = model(
            hidden_states=noisy.flatten(2).transpose(1, 2),
            audio_hidden_states=ltx2.pack_audio(noisy_audio).to(noisy.dtype),
            encoder_hidden_states=cond["video_context"].to(noisy.dtype),
            audio_encoder_hidden_states=cond["audio_context"].to(noisy.dtype),
            timestep=(t * 1000).to(noisy.dtype),
            audio_timestep=(audio_t * 1000).to(noisy.dtype),
            sigma=(t * 1000).to(noisy.dtype),
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=frames,
            height=height,
            width=width,
            fps=self.record.model_fps,
            audio_num_frames=noisy_audio.shape[2],
            return_dict=False,
        )
        video = video.transpose(1, 2).reshape(b, -1, frames, height, width)
        return video, ltx2.unpack_audio(audio, mel_bins)

    def _silent_audio(self, model: nn.Module, noisy: torch.Tensor) -> torch.Tensor:
        """Pure noise for the audio stream of a clip without sound, as long as the clip (deterministic in
        the clip's own latents so that validation repeats it)."""
        cfg = model.config
        per_second = cfg.audio_sampling_rate / cfg.audio_hop_length / cfg.audio_scale_factor
        frames = max(
            round((noisy.shape[2] - 1) * self.record.frame_multiple / self.record.model_fps * per_second), 1
        )
        mel_bins = cfg.audio_in_channels // 8  # the audio VAE's 8 latent channels share the token
        seed = int(noisy.shape.numel())
        gen = torch.Generator().manual_seed(seed)
        return torch.randn((noisy.shape[0], 8, frames, mel_bins), generator=gen).to(noisy)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        noisy_audio = cond.get("noisy_audio")
        audio_t = t
        if noisy_audio is None:
            noisy_audio, audio_t = self._silent_audio(model, noisy), torch.ones_like(t)
        return self.forward_streams(model, noisy, t, noisy_audio, audio_t, cond)[0]

    def loss(self, model: nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, cond: dict,
             accelerator) -> torch.Tensor:  # fmt: skip
        """The video stream's flow-matching loss (with the dataset's loss mask, as the base loss), plus the
        audio stream's where the batch has sound; times the dataset's loss_weight."""
        objective = self.training_objective()
        t = objective.discretize(t)
        dtype = DTYPES[self.cfg.model.dtype]
        noisy = objective.add_noise(x0, noise, t).to(dtype)
        cond = dict(cond)
        weights = cond.pop("loss_mask", None)  # a dataset's cached loss mask (`tuner.data.masks`)
        factor = cond.pop("loss_weight", None)  # a dataset's loss_weight, per sample
        audio = cond.get("audio_latents")
        if audio is None:
            noisy_audio, audio_t = self._silent_audio(model, noisy), torch.ones_like(t)
        else:
            noisy_audio, audio_t = objective.add_noise(audio, cond["audio_noise"], t).to(dtype), t
        with accelerator.autocast():
            video_pred, audio_pred = self.forward_streams(model, noisy, t, noisy_audio, audio_t, cond)
        mask = self.loss_mask(x0, cond)
        if weights is not None:
            mask = weights if mask is None else mask * weights
        loss = objective.loss(video_pred.float(), x0, noise, t, mask=mask)
        if audio is not None:
            loss = loss + objective.loss(audio_pred.float(), audio, cond["audio_noise"], t)
        return loss if factor is None else loss * factor.mean()

    # --- generation with sound -------------------------------------------------------------------
    def sound_latent_shape(self, frames: int) -> tuple[int, ...]:
        """As LTX2Pipeline: the clip's duration at 24 fps × 25 latent audio frames per second (16 kHz,
        hop 160, 4× compression); 8 channels × 16 mel bins."""
        return (8, round(frames / self.record.model_fps * 16000 / 160 / 4), 16)

    def predict_streams(self, model, noisy, noisy_sound, t, cond):
        return self.forward_streams(model, noisy, t, noisy_sound, t, cond)

    def decode_sound(self, latents: torch.Tensor, device: torch.device, dtype: torch.dtype):
        path = self.weights_path("vae")
        audio_vae = ltx2.load_audio_vae(path, dtype).to(device)
        vocoder = ltx2.load_vocoder(self._vocoder_path(path), dtype).to(device)
        waveform = ltx2.decode_audio(audio_vae, vocoder, latents.to(device))[0]
        return waveform.clamp(-1, 1), vocoder.config.output_sampling_rate

    def _vocoder_path(self, vae_path: str) -> str:
        """The vocoder is in the diffusers folder (`vocoder/`); beside a single file, the text encoder's
        diffusers folder holds it."""
        from pathlib import Path

        return vae_path if Path(vae_path).is_dir() else self.weights_path("text_encoder")

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (128, (frames - 1) // 8 + 1, height // 32, width // 32)
