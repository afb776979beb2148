"""Stable Diffusion 3.5 (Medium, Large, Large Turbo) text to image on diffusers' SD3Transformer2DModel.

Latents: AutoencoderKL with 8× compression and 16 channels, normalized with the VAE's shift and scaling
factors; the MMDiT patchifies 2×2 itself (pixel sides are multiples of 16). Text: CLIP-L's and OpenCLIP
bigG's penultimate hidden states and pooled outputs, and T5-XXL's hidden states over the prompt padded
to `cache.text_max_length` tokens (256 in StableDiffusion3Pipeline). T5 is optional: without
`model.text_encoder_3` its features are zeros, as the pipeline does without `text_encoder_3`.
Timesteps: flow matching with SD 3.5's fixed shift 3.0.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tuner.archs.flux_vae import FluxVAEImageModel
from tuner.archs.sd3 import loaders as sd3
from tuner.memory import text_encoder_dtype

logger = logging.getLogger(__name__)


class SD3Model(FluxVAEImageModel):
    architecture = "sd3"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return sd3.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        # FLUX.1's kind of VAE, found in the release's file too
        return sd3.load_vae(self.weights_path("vae"), dtype).to(device)

    def load_text_encoder(self, device: torch.device, dtype: str) -> sd3.TextEncoders:
        m = self.cfg.model
        if not m.text_encoder_3:
            logger.warning(
                "model.text_encoder_3 is not set: SD 3.5 is given zeros in place of T5-XXL's features, as "
                "StableDiffusion3Pipeline does without text_encoder_3 (the same must hold when generating)."
            )
        encoders = sd3.load_text_encoders(
            (self.weights_path("text_encoder"), m.text_encoder_2 or None, m.text_encoder_3 or None),
            (m.tokenizer or None, m.tokenizer_2 or None, m.tokenizer_3 or None),
            text_encoder_dtype(dtype),
        )
        self.place_text_encoders(dtype, device, encoders.clip_l, encoders.clip_g, encoders.t5)
        return encoders

    def encode_text(
        self, encoder: sd3.TextEncoders, captions: list[str], controls=None
    ) -> list[dict[str, torch.Tensor]]:
        return sd3.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return model(**self.model_inputs(model, noisy, t, cond), return_dict=False)[0]

    def model_inputs(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict:
        return sd3.model_inputs(
            model, noisy, t, cond["clip"], cond["pooled"], cond.get("t5"), self.cfg.cache.text_max_length
        )

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import cut_at_blocks

        blocks = model.transformer_blocks
        embedders = (model.pos_embed, model.time_text_embed, model.context_embedder)
        return cut_at_blocks(
            model, sd3, lambda noisy, t, cond: self.model_inputs(model, noisy, t, cond), blocks, embedders
        )
