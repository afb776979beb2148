"""HiDream-I1 (Full, Dev, Fast) text-to-image on diffusers' HiDreamImageTransformer2DModel (a MoE DiT).

Latents: the FLUX.1 VAE (16 channels, 8×, (z − shift) · scale); the model patchifies 2×2 itself, so
pixel sides are multiples of 16. Text: four encoders (`tuner.archs.hidream.text`): T5-XXL's hidden
states and every Llama 3.1 layer's hidden states over the prompt padded to `cache.text_max_length`
tokens (HiDream's pipeline uses 128), and the CLIP-L + CLIP-G projected pooled outputs. The Llama
entry is large ([32, L, 4096] per caption: 32 MiB at L = 128 in bf16); `cache.text_encoder_dtype =
"nf4"` loads the encoders 4-bit for caching (all four, through `place_text_encoder`).

Training runs the MoE feed-forwards on diffusers' differentiable path whatever the model's mode (see
`tuner.archs.hidream.loaders`: its inference path is no-grad, so adapters on the routed experts would not
train); sampling uses the inference path. Full, Dev and Fast have identical shapes: the release is read
from the transformer's file or folder name, and only generation's default shift depends on it (Dev 6,
else 3).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.flux_vae import FluxVAEImageModel
from tuner.archs.hidream import loaders as hidream
from tuner.archs.hidream import text as hidream_text
from tuner.memory import text_encoder_dtype


class HiDreamModel(FluxVAEImageModel):
    architecture = "hidream"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return hidream.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str) -> hidream_text.TextEncoders:
        m = self.cfg.model
        paths = (self.weights_path("text_encoder"), m.text_encoder_2, m.text_encoder_3, m.text_encoder_4)
        tokenizers = (m.tokenizer, m.tokenizer_2, m.tokenizer_3, m.tokenizer_4)
        encoders = hidream_text.load_text_encoders(
            tuple(p or None for p in paths), tuple(t or None for t in tokenizers), text_encoder_dtype(dtype)
        )
        for model in encoders.models:
            self.place_text_encoders(dtype, device, model)
        return encoders

    def encode_text(
        self, encoder: hidream_text.TextEncoders, captions: list[str], controls=None
    ) -> list[dict[str, torch.Tensor]]:
        return hidream_text.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return hidream.predict_velocity(model, noisy, t, cond["t5"], cond["llama"], cond["pooled"])

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import PipelineParts

        return PipelineParts(
            prologue=lambda noisy, t, cond: hidream.embed(
                model, noisy, t, cond["t5"], cond["llama"], cond["pooled"]
            ),
            blocks=[*model.double_stream_blocks, *model.single_stream_blocks],  # dual-, then single-stream
            run_block=lambda block, carried: hidream.run_block(model, block, carried),
            epilogue=lambda carried, noisy, t, cond: hidream.project_out(model, carried, noisy),
            prologue_modules=(model.x_embedder, model.t_embedder, model.p_embedder, model.caption_projection),
        )
