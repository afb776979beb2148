"""Qwen-Image (text-to-image) and Qwen-Image-Edit (one or more control images) on diffusers'
QwenImageTransformer2DModel.

Latents: AutoencoderKLQwenImage (the Wan 2.1 VAE architecture), 8× spatial compression, 16 channels,
one frame, normalized per channel. The transformer packs 2×2 latent patches into tokens, so pixel
sides are multiples of 16. Text: Qwen2.5-VL hidden states stored at their true length; a batch is
padded to its longest caption with a mask, as the pipelines batch prompts. Qwen-Image-Edit appends the
control images' latents (`control_0`, `control_1`, ...) as extra image tokens and also shows the
control images to the VL model with the prompt (`tuner.archs.qwen_image.text`). Qwen-Image 2.1
(`QwenImage21Model`) has its own networks (`tuner.archs.qwen_image.qwen21`).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.model import ArchitectureModel, padded_prompts
from tuner.archs.qwen_image import loaders as qwen_image
from tuner.archs.qwen_image import qwen21
from tuner.archs.qwen_image import text as qwen_image_text
from tuner.archs.qwen_vae import QwenVAEImageModel
from tuner.memory import text_encoder_dtype
from tuner.models.qwen3_vl import TextEncoder


class QwenImageModel(QwenVAEImageModel):
    architecture = "qwen_image"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return qwen_image.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str) -> qwen_image_text.QwenTextEncoder:
        encoder = qwen_image_text.load_text_encoder(
            self.weights_path("text_encoder"),
            self.cfg.model.tokenizer or None,
            text_encoder_dtype(dtype),
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        embeds = qwen_image_text.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)
        return [{"prompt_embeds": e} for e in embeds]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return padded_prompts(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return qwen_image.velocity(model(**self.model_inputs(noisy, t, cond), return_dict=False)[0], noisy)

    def model_inputs(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict:
        controls = []
        while f"control_{len(controls)}" in cond:
            controls.append(cond[f"control_{len(controls)}"])
        return qwen_image.model_inputs(noisy, t, cond["prompt_embeds"], cond.get("prompt_mask"), controls)

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import cut_at_blocks

        blocks = model.transformer_blocks
        embedders = (model.img_in, model.txt_norm, model.txt_in, model.time_text_embed)
        return cut_at_blocks(
            model, qwen_image, lambda noisy, t, cond: self.model_inputs(noisy, t, cond), blocks, embedders
        )

    def combine_guidance(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Qwen-Image's "true CFG": the guided velocity is rescaled, token by token, to the norm of the
        conditional one (norms over each packed 2×2 token's channels, as the pipeline computes them)."""
        guided = v_uncond + scale * (v_cond - v_uncond)
        height, width = guided.shape[-2:]
        cond_tokens, guided_tokens = qwen_image.pack_latents(v_cond), qwen_image.pack_latents(guided)
        ratio = cond_tokens.norm(dim=-1, keepdim=True) / guided_tokens.norm(dim=-1, keepdim=True)
        return qwen_image.unpack_latents(guided_tokens * ratio, height, width)


class QwenImageEditModel(QwenImageModel):
    """Qwen-Image-Edit-2509 / 2511. The control latents come with the batch (`control_<i>`); the prompt is
    encoded with the edit template, and with the control images when they are given."""

    architecture = "qwen_image_edit"

    def encode_text(
        self, encoder, captions: list[str], controls: list[list[torch.Tensor]] | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """None for `controls` encodes the prompt alone (the pipeline's path without images)."""
        images = controls if controls is not None else [[] for _ in captions]
        embeds = qwen_image_text.encode_edit_prompts(encoder, captions, images)
        return [{"prompt_embeds": e} for e in embeds]


class QwenImage21Model(ArchitectureModel):
    """Qwen-Image 2.1 text-to-image (`tuner.archs.qwen_image.qwen21`): its own transformer, 64-channel VAE
    (16x, one latent pixel per token) and Qwen3-VL text encoder; prompts kept at their true length and
    padded per batch with a mask, as for Qwen-Image."""

    architecture = "qwen_image_21"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return qwen21.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return qwen21.load_vae(self.weights_path("vae"), dtype).to(device)

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return qwen21.encode_images(vae, pixels)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return qwen21.decode_latents(vae, latents)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        factor = qwen21.VAE_FACTOR
        return (qwen21.LATENT_CHANNELS, 1, height // factor, width // factor)

    def load_text_encoder(self, device: torch.device, dtype: str) -> TextEncoder:
        encoder = qwen21.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        embeds = qwen21.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)
        return [{"prompt_embeds": e} for e in embeds]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return padded_prompts(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return qwen21.predict_velocity(model, noisy, t, cond["prompt_embeds"], cond.get("prompt_mask"))
