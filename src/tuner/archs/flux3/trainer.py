"""FLUX.3 (klein base) on diffusers' Flux3Transformer2DModel.

Latents: the FLUX.2 VAE's, patchified 2x2 into 128 channels at 1/16 of the pixel size and normalized by
its BatchNorm statistics (`tuner.archs.flux2_vae`, the VAE config's ε as the FLUX.3 pipeline uses it);
each latent pixel is one token. Text: Qwen3-VL-4B's hidden states after layers 4, 8, ..., 32 over the
chat-formatted prompt, every row of its 80-token window (`tuner.archs.flux3.text`). The pipeline encodes
one prompt per call; a training batch whose captions fall in windows of different sizes is brought to the
longest by repeating each shorter window's last row (a padding row: all padding rows encode alike), so
batch size 1, or captions of one window size, match the pipeline exactly. Guidance is the pipeline's
plain classifier-free guidance (3.5) against the empty prompt. Control images (`control_0`, ...; up to
the pipeline's 10) are reference images, the model's `image_cond` tokens; items without train text to
image; training and sampling use its constant
flow shift 6.93.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.flux2_vae import Flux2VAEImageModel
from tuner.archs.flux3 import loaders as flux3
from tuner.archs.flux3 import text as flux3_text
from tuner.memory import text_encoder_dtype
from tuner.models.qwen3_vl import TextEncoder


class Flux3Model(Flux2VAEImageModel):
    architecture = "flux3"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return flux3.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str) -> TextEncoder:
        encoder = flux3_text.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        embeds = flux3_text.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)
        return [{"prompt_embeds": e} for e in embeds]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        rows = [entry["prompt_embeds"] for entry in entries]
        longest = max(r.shape[0] for r in rows)
        padded = [torch.cat([r, r[-1:].expand(longest - r.shape[0], -1)]) for r in rows]
        return {"prompt_embeds": torch.stack(padded)}

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        references = []
        while f"control_{len(references)}" in cond:
            references.append(cond[f"control_{len(references)}"])
        return flux3.predict_velocity(model, noisy, t, cond["prompt_embeds"], references)
