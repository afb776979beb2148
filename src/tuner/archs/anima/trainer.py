"""Anima on diffusers' CosmosTransformer3DModel plus its LLM adapter (`tuner.archs.anima.adapter`).

Latents: the Qwen-Image VAE's (the Wan 2.1 network and per-channel statistics, one frame, 8× spatial,
16 channels; `tuner.archs.qwen_vae`). Text: Qwen3-0.6B's last hidden states and the caption's T5 ids,
cached at their true lengths; the adapter, part of the transformer, turns them into the DiT's context at
every step, so adapters and full fine-tunes train it with the DiT (diffusion-pipe's LoRA targets its blocks
too). The model's output is the flow-matching velocity at t ∈ [0, 1], as Cosmos-Predict2's
(`tuner.archs.anima.loaders`).

Timesteps: diffusion-pipe trains Anima with logit-normal t (mean 0, std 1; its `models/anima.py` default,
no shift), the `auto` mode here. Sampling: ComfyUI's `supported_models.Anima` sets a constant shift of 3.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.anima import loaders as anima
from tuner.archs.cosmos_predict2 import loaders as cosmos
from tuner.archs.qwen_vae import QwenVAEImageModel
from tuner.memory import text_encoder_dtype


class AnimaModel(QwenVAEImageModel):
    architecture = "anima"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return anima.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str):
        encoder, t5_tokenizer = anima.load_text_encoder(
            self.weights_path("text_encoder"),
            self.cfg.model.tokenizer or None,
            self.cfg.model.tokenizer_2 or None,
            text_encoder_dtype(dtype),
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder, t5_tokenizer

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        qwen, t5_tokenizer = encoder
        return anima.encode_prompts(qwen, t5_tokenizer, captions, self.cfg.cache.text_max_length)

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return anima.collate(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return anima.predict_velocity(model, noisy, t, cond)

    def pipeline_parts(self, model: nn.Module):
        """Cosmos-Predict2's cut (`cosmos_predict2.loaders.embed` / `run_block` / `project_out`) with the LLM
        adapter in the prologue: stages train adapters inside the blocks only, so the adapter's own LoRA
        (a default target) is left out with `network.exclude` there."""
        from tuner.archs.stages import cut_at_blocks

        def inputs(noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict:
            return cosmos.model_inputs(model, noisy, t, anima.context(model, noisy, cond))

        extra = getattr(model, "crossattn_proj", None)
        return cut_at_blocks(model, cosmos, inputs, model.transformer_blocks,
                             (model.patch_embed, model.time_embed, model.llm_adapter, extra))  # fmt: skip
