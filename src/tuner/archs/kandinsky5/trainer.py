"""Kandinsky 5.0 Video Lite text-to-video (2B) on diffusers' Kandinsky5Transformer3DModel.

Latents are HunyuanVideo's (the release ships its VAE): 4× temporal, 8× spatial, 16 channels,
× 0.476986, patchified 1×2×2 by the model, so pixel sides are multiples of 16 and frame counts 4N+1 at
24 fps — hence a `HunyuanVideoModel` subclass that keeps the VAE side and replaces the rest. Text:
Qwen2.5-VL's last hidden states of the prompt in the video template, cropped after the template and
stored at their true length (`cache.text_max_length` is the pipeline's `max_sequence_length`), and
CLIP-L's pooled output. The T2V model's visual condition (an image-to-video input) is zeros.

The releases (pretrain / sft / nocfg / distilled16steps, 5 s / 10 s) share shapes; the name of the file
or folder picks the 10 s config, whose NABLA sparse attention tuner replaces by the dense attention it
approximates. Sampling uses the release's flow shift 10; the
release's steps and guidance are sft / pretrain 50 and 5, nocfg 50 and 1 (`tuner generate --guidance 1`),
distilled16steps 16 and 1 (`--steps 16 --guidance 1`). bf16 works because the loaders keep the time
embedding and modulations in fp32 (see `tuner.archs.kandinsky5.loaders`).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.hunyuan_video.trainer import HunyuanVideoModel
from tuner.archs.kandinsky5 import loaders as kandinsky5
from tuner.memory import text_encoder_dtype


class Kandinsky5Model(HunyuanVideoModel):
    architecture = "kandinsky5"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return kandinsky5.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str) -> kandinsky5.TextEncoders:
        m = self.cfg.model
        encoders = kandinsky5.load_text_encoders(
            self.weights_path("text_encoder"),
            m.text_encoder_2 or None,
            m.tokenizer or None,
            m.tokenizer_2 or None,
            text_encoder_dtype(dtype),
        )
        self.place_text_encoders(dtype, device, encoders.qwen.model, encoders.clip)
        return encoders

    def encode_text(
        self, encoder: kandinsky5.TextEncoders, captions: list[str], controls=None
    ) -> list[dict[str, torch.Tensor]]:
        return kandinsky5.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return kandinsky5.collate(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return kandinsky5.predict_velocity(model, noisy, t, cond)

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import PipelineParts

        return PipelineParts(
            prologue=lambda noisy, t, cond: kandinsky5.embed(model, noisy, t, cond),
            blocks=list(model.visual_transformer_blocks),
            run_block=lambda block, carried: kandinsky5.run_block(model, block, carried),
            epilogue=lambda carried, noisy, t, cond: kandinsky5.project_out(model, carried, noisy),
            prologue_modules=(
                model.text_embeddings,
                model.time_embeddings,
                model.pooled_text_embeddings,
                model.visual_embeddings,
                model.text_transformer_blocks,
            ),  # fmt: skip
        )
