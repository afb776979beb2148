"""HunyuanVideo 1.5 text-to-video (480p / 720p, 8.3B) on diffusers' HunyuanVideo15Transformer3DModel.

Latents: AutoencoderKLHunyuanVideo15, 32 channels with 4× temporal and 16× spatial compression, scaled
by 1.03682 (no shift); the transformer's patch is 1×1×1, so pixel sides are multiples of 16 and frame
counts 4N+1 (the release runs at 24 fps). Its input stacks the latents with the first-frame condition
latents and a mask channel, zeros for text to video. Text: Qwen2.5-VL's third-to-last hidden states of
the prompt in the video chat template (cropped after the template), stored at their true length and
padded with a mask when batched (`cache.text_max_length` is the pipeline's `tokenizer_max_length`,
1000 in the release), and ByT5 states of the prompt's quoted text (none without quotes). The model is
not guidance-distilled: generation uses plain CFG (the release samples at 6.0) with shift 5 (480p;
720p T2V uses 9).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.hunyuan_video15 import loaders as hunyuan_video15
from tuner.archs.hunyuan_video15 import siglip as hunyuan_video15_siglip
from tuner.archs.model import ArchitectureModel
from tuner.archs.wan.trainer_i2v import LatentEncoders
from tuner.memory import text_encoder_dtype


class HunyuanVideo15Model(ArchitectureModel):
    architecture = "hunyuan_video15"
    task = "t2v"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return hunyuan_video15.load_transformer(self.weights_path("transformer"), dtype, self.task)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return hunyuan_video15.load_vae(self.weights_path("vae"), dtype).to(device)

    def load_text_encoder(self, device: torch.device, dtype: str) -> hunyuan_video15.TextEncoders:
        m = self.cfg.model
        encoders = hunyuan_video15.load_text_encoders(
            self.weights_path("text_encoder"),
            m.text_encoder_2 or None,
            m.tokenizer or None,
            m.tokenizer_2 or None,
            text_encoder_dtype(dtype),
        )
        self.place_text_encoders(dtype, device, encoders.qwen, encoders.byt5)
        return encoders

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return hunyuan_video15.encode_video(vae, pixels)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return hunyuan_video15.decode_latents(vae, latents)

    def encode_text(
        self, encoder: hunyuan_video15.TextEncoders, captions: list[str], controls=None
    ) -> list[dict[str, torch.Tensor]]:
        return hunyuan_video15.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return hunyuan_video15.collate(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return hunyuan_video15.predict_velocity(model, noisy, t, cond)

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import cut_at_blocks

        blocks = model.transformer_blocks
        embedders = (
            model.time_embed,
            model.x_embedder,
            model.context_embedder,
            model.context_embedder_2,
            model.image_embedder,
            model.cond_type_embed,
        )
        return cut_at_blocks(
            model,
            hunyuan_video15,
            lambda noisy, t, cond: hunyuan_video15.model_inputs(model, noisy, t, cond),
            blocks,
            embedders,
        )

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (32, (frames - 1) // 4 + 1, height // 16, width // 16)


class HunyuanVideo15I2VModel(HunyuanVideo15Model):
    """Image-to-video (480p / 720p I2V): the same network given the first frame twice, as
    HunyuanVideo15ImageToVideoPipeline gives it: its VAE latent (the frame encoded alone) in the
    condition channels of latent frame 0 with the mask channel 1 there, and SigLIP's 729 tokens as image
    context. The frame is the clip's own first frame, so caching stores per clip `image_latents` and
    `image_embeds` beside `latents`, keyed by both the VAE and the image encoder."""

    architecture = "hunyuan_video15_i2v"
    task = "i2v"

    def load_latent_encoder(self, device: torch.device, dtype: torch.dtype) -> LatentEncoders:
        image_encoder = hunyuan_video15_siglip.load_image_encoder(self.weights_path("image_encoder"), dtype)
        image_encoder.model.to(device)
        return LatentEncoders(self.load_vae(device, dtype), image_encoder)

    def encode_latents(
        self, encoders: LatentEncoders, pixels: torch.Tensor, controls: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return {
            "latents": self.encode_pixels(encoders.vae, pixels),
            **self.encode_frame_images(encoders, [pixels[:, :, 0]], pixels.shape[2]),
        }

    def encode_frame_images(
        self, encoders: LatentEncoders, images: list[torch.Tensor], frames: int
    ) -> dict[str, torch.Tensor]:
        """`image_latents` [B, 32, 1, H/16, W/16] and `image_embeds` [B, 729, 1152] of first frames
        [B, 3, H, W] in [-1, 1]."""
        first = images[0]
        return {
            "image_latents": self.encode_pixels(encoders.vae, first[:, :, None]),
            "image_embeds": encoders.image_encoder.encode(first),
        }

    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        """`first_given` [B]: which samples are given their frame (`train.first_frame_conditioning_p`)."""
        return {**cond, "first_given": self.first_frame_given(x0, generator)}

    pipeline_parts = ArchitectureModel.pipeline_parts  # predicts otherwise than the parent's parts cut

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The velocity given the first frame; samples not given it (`first_given` False) get what the
        text-to-video pipeline feeds the same network: zero condition latents, mask and image tokens. The
        transformer decides "no image" for a whole batch (all `image_embeds` zero masks the image tokens
        out), so those samples run as a batch of their own."""
        given = cond.get("first_given")
        if given is None or given.all():
            frame_cond = hunyuan_video15.first_frame_condition(cond["image_latents"], noisy)
            return hunyuan_video15.predict_velocity(model, noisy, t, {**cond, "cond_latents": frame_cond})
        text = {k: v for k, v in cond.items() if k not in ("image_latents", "image_embeds", "first_given")}
        if not given.any():
            return hunyuan_video15.predict_velocity(model, noisy, t, text)
        out = None
        for rows in (given, ~given):  # each part takes one of the branches above
            velocity = self.predict(model, noisy[rows], t[rows], {k: v[rows] for k, v in cond.items()})
            out = velocity.new_empty(noisy.shape) if out is None else out
            out[rows] = velocity
        return out
