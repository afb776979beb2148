"""ERNIE-Image (base, Turbo) on diffusers' ErnieImageTransformer2DModel.

Latents: the FLUX.2 VAE's, patchified 2x2 into 128 channels at 1/16 of the pixel size and normalized by
its BatchNorm statistics with ε = 1e-5 as ErnieImagePipeline does (`tuner.archs.flux2_vae`); each latent
pixel is one token (`latent_patch` 1x1, pixel sides multiples of 16). Text: Ministral 3 3B's second-to-last
hidden states at each caption's true length (`tuner.archs.ernie_image.text`); a batch is padded to its
longest caption with a mask, whose lengths the model takes. Guidance is ErnieImagePipeline's
v_uncond + w·(v_cond − v_uncond) (its default 4; Turbo samples without, 1), the negative being the empty
prompt. Training and sampling use the flow shift 3 (ComfyUI's `ErnieImage` sampling settings). Training
Turbo warns: it is step-distilled.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.ernie_image import loaders as ernie
from tuner.archs.ernie_image import text as ernie_text
from tuner.archs.flux2 import text as flux2_text
from tuner.archs.flux2_vae import Flux2VAEImageModel
from tuner.archs.model import padded_prompts
from tuner.memory import text_encoder_dtype

BATCH_NORM_EPS = 1e-5
"""ErnieImagePipeline's latent normalization ε (the trained value; the released VAE config says 1e-4)."""


def turbo_warning(cfg) -> str:
    """The record's `training_warning`: Turbo is distilled to 8 steps; training it directly undoes that."""
    path = cfg.model.transformer
    if not ernie.is_turbo(path):
        return ""
    return (f"{path} is ERNIE-Image-Turbo, which is step-distilled: training it directly undoes the "
            "distillation. Train on ERNIE-Image (ernie-image.safetensors) instead.")  # fmt: skip


class ErnieImageModel(Flux2VAEImageModel):
    architecture = "ernie_image"
    batch_norm_eps = BATCH_NORM_EPS

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return ernie.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str) -> flux2_text.TextEncoder:
        encoder = flux2_text.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype),
            ernie_text.MINISTRAL3,
        )  # fmt: skip
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        embeds = ernie_text.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)
        return [{"prompt_embeds": e} for e in embeds]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return padded_prompts(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return ernie.predict_velocity(model, noisy, t, cond["prompt_embeds"], cond["prompt_mask"])

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import PipelineParts

        embedders = (
            model.x_embedder,
            model.text_proj,
            model.pos_embed,
            model.time_embedding,
            model.adaLN_modulation,
        )
        return PipelineParts(
            prologue=lambda noisy, t, cond: ernie.embed(
                model, noisy, t, cond["prompt_embeds"], cond["prompt_mask"]
            ),
            blocks=list(model.layers),
            run_block=lambda block, carried: ernie.run_block(model, block, carried),
            epilogue=lambda carried, noisy, t, cond: ernie.project_out(model, carried, noisy),
            prologue_modules=tuple(m for m in embedders if m is not None),
        )
