"""Krea 2 (RAW, Turbo) on diffusers' Krea2Transformer2DModel.

Latents: the Qwen-Image VAE (8x, 16 channels, one frame, normalized per channel), packed 2x2 into tokens,
so pixel sides are multiples of 16. Text: the tapped Qwen3-VL layers of each caption, [L, 12, 2560] at
its true length (`tuner.archs.krea2.text`); a batch is padded to its longest caption with a mask, which
the model applies to the text keys as Krea2Pipeline does. Guidance: Krea2Pipeline adds its scale g times
(cond − uncond) to cond (the record's `cfg_form = "cond_plus"`: `--guidance g` is plain CFG at g + 1);
Turbo samples without guidance (0). Training Turbo warns: LoRAs are trained on RAW and applied to Turbo.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.krea2 import loaders as krea2
from tuner.archs.krea2 import text as krea2_text
from tuner.archs.model import padded_prompts
from tuner.archs.qwen_vae import QwenVAEImageModel
from tuner.memory import text_encoder_dtype
from tuner.models.qwen3_vl import TextEncoder


def turbo_warning(cfg) -> str:
    """The record's `training_warning`: Turbo is distilled to 8 steps; training it directly undoes that."""
    path = cfg.model.transformer
    if not krea2.is_turbo(path):
        return ""
    return (f"{path} is Krea 2 Turbo, which is step-distilled: training it directly undoes the distillation. "
            "Train on Krea 2 RAW (krea2_raw_bf16.safetensors); its adapters apply to Turbo as they are.")  # fmt: skip


class Krea2Model(QwenVAEImageModel):
    architecture = "krea2"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return krea2.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str) -> TextEncoder:
        encoder = krea2_text.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        embeds = krea2_text.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)
        return [{"prompt_embeds": e} for e in embeds]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return padded_prompts(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return krea2.predict_velocity(model, noisy, t, cond["prompt_embeds"], cond["prompt_mask"])

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import PipelineParts

        def prologue(noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, ...]:
            return krea2.embed(
                model, krea2.model_inputs(noisy, t, cond["prompt_embeds"], cond["prompt_mask"])
            )

        return PipelineParts(
            prologue=prologue,
            blocks=list(model.transformer_blocks),
            run_block=lambda block, carried: krea2.run_block(model, block, carried),
            epilogue=lambda carried, noisy, t, cond: krea2.project_out(
                model, carried, noisy, cond["prompt_embeds"].shape[1]
            ),  # fmt: skip
            prologue_modules=(
                model.time_embed,
                model.time_mod_proj,
                model.text_fusion,
                model.txt_in,
                model.img_in,
            ),
        )
