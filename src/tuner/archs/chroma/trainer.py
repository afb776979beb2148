"""Chroma (text to image) on diffusers' ChromaTransformer2DModel: FLUX.1 with T5 as its only text
encoder and a guidance approximator in place of the modulation linears.

Everything about latents is FLUX.1's (the same VAE, 2×2 packing, `flux_shift`), so this is the FLUX.1
trainer with its own transformer, text encoder and model call. Text: T5-XXL's hidden states under the
tokenizer's attention mask, cut to the rows the transformer sees (the prompt's tokens and one padding
token; see `tuner.archs.chroma.loaders`). Chroma has no guidance embedding, so `model.guidance` is not used;
generation applies real classifier-free guidance with the negative prompt, as ChromaPipeline does.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.chroma import loaders as chroma
from tuner.archs.flux.trainer import FluxModel
from tuner.memory import text_encoder_dtype


class ChromaModel(FluxModel):
    architecture = "chroma"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return chroma.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str) -> chroma.TextEncoder:
        encoder = chroma.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, encoder.t5)
        return encoder

    def encode_text(
        self, encoder: chroma.TextEncoder, captions: list[str], controls=None
    ) -> list[dict[str, torch.Tensor]]:
        return chroma.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return chroma.collate(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return chroma.predict_velocity(model, noisy, t, cond["t5"], cond["t5_mask"])

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import PipelineParts

        return PipelineParts(
            prologue=lambda noisy, t, cond: chroma.embed(model, noisy, t, cond["t5"], cond["t5_mask"]),
            blocks=[*model.transformer_blocks, *model.single_transformer_blocks],  # dual-, then single-stream
            run_block=lambda block, carried: chroma.run_block(model, block, carried),
            epilogue=lambda carried, noisy, t, cond: chroma.project_out(model, carried, noisy),
            prologue_modules=(
                model.x_embedder,
                model.time_text_embed,
                model.distilled_guidance_layer,
                model.context_embedder,
            ),  # fmt: skip
        )
