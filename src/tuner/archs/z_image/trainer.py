"""Z-Image (Turbo and Base) on diffusers' ZImageTransformer2DModel.

Latents: the FLUX.1 VAE (8× compression, 16 channels, normalized with its shift and scaling factors),
patched 2×2 by the model itself, so pixel sides are multiples of 16. Text: Qwen3-4B's second-to-last
hidden states stored at their true length; a batch is padded to its longest caption with a mask, and
`predict` hands the model each caption's real rows, as the pipeline does. Sampling uses ZImagePipeline's
constant shift of 3. Guidance: ZImagePipeline adds its scale times (cond − uncond) to cond, the record's
`cfg_form = "cond_plus"`, so `--guidance` is diffusers' `guidance_scale`; Turbo samples without (0). Training Turbo without
`model.merge_adapters` (a de-distillation adapter) warns.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.flux_vae import FluxVAEImageModel
from tuner.archs.model import padded_prompts
from tuner.archs.z_image import loaders as z_image
from tuner.archs.z_image import text as z_image_text
from tuner.memory import text_encoder_dtype


def turbo_warning(cfg) -> str:
    """The record's `training_warning`: training Turbo's distilled weights as they are undoes the 8-step
    distillation in a few hundred steps (the adapter then needs many steps and guidance at inference); a
    de-distillation adapter merged first avoids that."""
    path = cfg.model.transformer
    if not z_image.is_turbo(path) or cfg.model.merge_adapters:
        return ""
    return (f"{path} is Z-Image-Turbo, which is step-distilled: training it directly undoes the "
            "distillation. Merge a de-distillation (training) adapter first with model.merge_adapters "
            '= ["zimage_turbo_training_adapter.safetensors:1.0"], or train Z-Image (Base).')  # fmt: skip


class ZImageModel(FluxVAEImageModel):
    architecture = "z_image"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return z_image.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str) -> z_image_text.TextEncoder:
        encoder = z_image_text.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        embeds = z_image_text.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)
        return [{"prompt_embeds": e} for e in embeds]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return padded_prompts(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return z_image.predict_velocity(model, noisy, t, cond["prompt_embeds"], cond["prompt_mask"])

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import PipelineParts

        def prologue(noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, ...]:
            return z_image.embed(model, noisy, t, cond["prompt_embeds"], cond["prompt_mask"])

        return PipelineParts(
            prologue=prologue,
            blocks=list(model.layers),
            run_block=lambda block, carried: z_image.run_block(model, block, carried),
            epilogue=lambda carried, noisy, t, cond: z_image.project_out(model, carried, noisy),
            prologue_modules=(
                model.t_embedder,
                model.all_x_embedder,
                model.cap_embedder,
                model.noise_refiner,
                model.context_refiner,
            ),  # fmt: skip
        )
