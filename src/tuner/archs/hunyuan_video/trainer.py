"""HunyuanVideo text-to-video (the 13B cfg-distilled T2V release) on diffusers' HunyuanVideoTransformer3DModel.

Latents: AutoencoderKLHunyuanVideo, a causal 3D VAE with 4× temporal and 8× spatial compression and 16
channels, scaled by 0.476986 (no shift); the transformer patchifies them 1×2×2, so pixel sides are
multiples of 16 and frame counts 4N+1 (the release runs at 24 fps). Text: LLaVA-LLaMA-3's
third-to-last hidden states of the prompt in the video template, cropped after the template, stored at
their true length and padded with a mask when batched (`cache.text_max_length` is the pipeline's
`max_sequence_length`, 256 in the release), and CLIP-L's pooled output. The model is cfg-distilled like
FLUX.1-dev: `model.guidance` feeds its embedded guidance (1.0 is the usual training value; the release
samples at 6.0).

Guidance convention: the embedded guidance is passed × 1000 (`loaders.predict_velocity`), in training as in
generation. That is the scale the distilled guidance embedder was trained on: Tencent's reference sampler,
diffusers' HunyuanVideoPipeline, musubi-tuner's inference and diffusion-pipe's training all multiply by
1000. musubi-tuner's *training* passes the raw value (1.0 reaches the embedder as 1.0, i.e. a guidance
of 0.001 on the release's scale, which it never saw), so a `model.guidance` carried over from a musubi
config means guidance g here, not g / 1000.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.hunyuan_video import loaders as hunyuan_video
from tuner.archs.model import ArchitectureModel
from tuner.memory import text_encoder_dtype


class HunyuanVideoModel(ArchitectureModel):
    architecture = "hunyuan_video"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return hunyuan_video.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return hunyuan_video.load_vae(self.weights_path("vae"), dtype).to(device)

    def load_text_encoder(self, device: torch.device, dtype: str) -> hunyuan_video.TextEncoders:
        m = self.cfg.model
        encoders = hunyuan_video.load_text_encoders(
            self.weights_path("text_encoder"),
            m.text_encoder_2 or None,
            m.tokenizer or None,
            m.tokenizer_2 or None,
            text_encoder_dtype(dtype),
        )
        self.place_text_encoders(dtype, device, encoders.llama, encoders.clip)
        return encoders

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return hunyuan_video.encode_video(vae, pixels)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return hunyuan_video.decode_latents(vae, latents)

    def encode_text(
        self, encoder: hunyuan_video.TextEncoders, captions: list[str], controls=None
    ) -> list[dict[str, torch.Tensor]]:
        return hunyuan_video.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return hunyuan_video.collate(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return hunyuan_video.predict_velocity(model, noisy, t, cond, self.cfg.model.guidance)

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import cut_at_blocks

        blocks = [*model.transformer_blocks, *model.single_transformer_blocks]  # dual-, then single-stream
        embedders = (model.x_embedder, model.time_text_embed, model.context_embedder)
        return cut_at_blocks(
            model,
            hunyuan_video,
            lambda noisy, t, cond: hunyuan_video.model_inputs(model, noisy, t, cond, self.cfg.model.guidance),
            blocks,
            embedders,
        )

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (16, (frames - 1) // 4 + 1, height // 8, width // 8)
