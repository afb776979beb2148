"""FLUX.2 dev and klein (text to image, and editing with up to ten reference images) on diffusers'
Flux2Transformer2DModel.

Latents: AutoencoderKLFlux2 (8× compression, 32 channels) patchified 2×2 into 128 channels at 1/16 of the
pixel size and normalized by the VAE's BatchNorm statistics; each latent pixel is one token (so pixel
sides are multiples of 16 and `latent_patch` is 1×1). Text: Mistral-Small-3.x's hidden states after
layers 10, 20 and 30 over the chat-formatted prompt padded to `cache.text_max_length` tokens (512 in
Flux2Pipeline), every row kept; klein: Qwen3's after layers 9, 18, 27 (`tuner.archs.flux2.text`). The
24B text encoder runs at `cache.text_encoder_dtype` ("nf4" / "fp8"
fit it on one GPU), placed by `tuner.memory.place_text_encoder`. dev is guidance-distilled:
`model.guidance` feeds its guidance embedding. Reference images (the dataset's control images,
`control_0`, `control_1`, ...) are appended after the target's tokens, as Flux2Pipeline appends them;
items without control images train text to image. klein is the same network, smaller and without
the guidance embedding (the base models sample with real CFG, `--guidance`).

Timesteps: `flux_shift` (FLUX.1's resolution-dependent shift over the image-token count); Flux2Pipeline
samples with its own empirical μ, which also depends on the step count.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.flux2 import loaders as flux2
from tuner.archs.flux2 import text as flux2_text
from tuner.archs.flux2_vae import Flux2VAEImageModel
from tuner.memory import text_encoder_dtype


class Flux2Model(Flux2VAEImageModel):
    architecture = "flux2"
    klein = False  # which family's transformer files it takes
    text_encoder_kind = flux2_text.MISTRAL

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return flux2.load_transformer(self.weights_path("transformer"), dtype, self.klein)

    def load_text_encoder(self, device: torch.device, dtype: str) -> flux2_text.TextEncoder:
        path, tokenizer = self.weights_path("text_encoder"), self.cfg.model.tokenizer or None
        encoder = flux2_text.load_text_encoder(
            path, tokenizer, text_encoder_dtype(dtype), self.text_encoder_kind
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_text(self, encoder: flux2_text.TextEncoder, captions: list[str], controls=None) -> list[dict]:
        embeds = flux2_text.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)
        return [{"prompt_embeds": e} for e in embeds]

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return flux2.velocity(model(**self.model_inputs(model, noisy, t, cond), return_dict=False)[0], noisy)

    def model_inputs(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict:
        references = []
        while f"control_{len(references)}" in cond:
            references.append(cond[f"control_{len(references)}"])
        return flux2.model_inputs(model, noisy, t, cond["prompt_embeds"], self.cfg.model.guidance, references)

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import cut_at_blocks

        blocks = [*model.transformer_blocks, *model.single_transformer_blocks]  # dual-, then single-stream
        embedders = (
            model.x_embedder,
            model.context_embedder,
            model.time_guidance_embed,
            model.double_stream_modulation_img,
            model.double_stream_modulation_txt,
            model.single_stream_modulation,
        )
        return cut_at_blocks(
            model, flux2, lambda noisy, t, cond: self.model_inputs(model, noisy, t, cond), blocks, embedders
        )


class Flux2KleinModel(Flux2Model):
    """FLUX.2 klein 4B / 9B: the FLUX.2 network conditioned on Qwen3 (4B / 8B), no guidance embedding."""

    architecture = "flux2_klein"
    klein = True
    text_encoder_kind = flux2_text.QWEN3
