"""Lumina Image 2.0 text-to-image on diffusers' Lumina2Transformer2DModel.

Latents: the FLUX.1 VAE (8× compression, 16 channels, normalized with its shift and scaling factors),
which the transformer cuts into 2×2 patches itself, so pixel sides are multiples of 16. Text: Gemma 2's
second-to-last hidden state behind Lumina's system prompt, stored at its true length (at most
`cache.text_max_length` tokens; the pipeline's limit is 256) and padded per batch with a mask, which
the transformer uses to drop the padding. The model's own time runs from noise (0) to image (1);
`tuner.archs.lumina2.loaders.predict_velocity` turns it into tuner's convention.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.flux_vae import FluxVAEImageModel
from tuner.archs.lumina2 import loaders as lumina2
from tuner.memory import text_encoder_dtype


class Lumina2Model(FluxVAEImageModel):
    architecture = "lumina2"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return lumina2.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str) -> lumina2.TextEncoder:
        encoder = lumina2.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        # the model's rotary table holds 300 caption positions; the pipeline allows 256 tokens
        length = min(self.cfg.cache.text_max_length, lumina2.MAX_TEXT_TOKENS)
        embeds = lumina2.encode_prompts(encoder, captions, length)
        return [{"prompt_embeds": e} for e in embeds]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        embeds, mask = lumina2.pad_prompts([entry["prompt_embeds"] for entry in entries])
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return lumina2.predict_velocity(model, noisy, t, cond["prompt_embeds"], cond["prompt_mask"])

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import PipelineParts

        def prologue(noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, ...]:
            return lumina2.embed(
                model, lumina2.model_inputs(noisy, t, cond["prompt_embeds"], cond["prompt_mask"])
            )

        return PipelineParts(
            prologue=prologue,
            blocks=list(model.layers),
            run_block=lambda block, carried: lumina2.run_block(model, block, carried),
            epilogue=lambda carried, noisy, t, cond: lumina2.project_out(
                model, carried, noisy, cond["prompt_mask"]
            ),
            prologue_modules=(
                model.time_caption_embed,
                model.x_embedder,
                model.context_refiner,
                model.noise_refiner,
            ),
        )

    def combine_guidance(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Lumina2Pipeline's guidance: plain CFG rescaled to the conditional velocity's norm, taken over
        the last axis (rows of the latent; the norm ignores the sign flip of the velocity)."""
        guided = v_uncond + scale * (v_cond - v_uncond)
        return guided * (v_cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
