"""SDXL (and its fine-tunes) on diffusers' UNet2DConditionModel: the first DDPM-objective architecture.

Latents: the SDXL VAE's mean × 0.13025, 4 channels at 1/8 of the pixels (sides multiples of 8; 64 keeps
every UNet level even). Text: CLIP-L's and bigG's penultimate hidden states concatenated, and bigG's
pooled projection (see `tuner.archs.sdxl.loaders`). Size conditioning: each item's latent entry carries its
`time_ids` (`tuner.archs.parts.size_conditioning`); generation uses (H, W, 0, 0, H, W).

With `network.train_text_encoder`, an adapter also trains on both text encoders
(`tuner.archs.sdxl.text_training`, the part `tuner.archs.parts.text_encoder_training`): the text cache
then holds token ids, and `predict` runs the encoders (`trained_text`) at every step. A full fine-tune
saves the bundled checkpoint (`bundled_layout`).

The objective is DDPM's (`tuner.diffusion.ddpm`): t ∈ [0, 1] from the timestep sampler (uniform by default, within
`min_timestep` / `max_timestep`) picks one of the 1000 noise levels, and the model predicts the noise or,
with `timesteps.prediction = "v"`, the velocity.

Caption dropout (`caption_dropout_rate`) trains on the encoding of the empty caption, as kohya's sd-scripts
(it sets `caption = ""` before encoding) and every trainer users bring recipes from. SDXL's own training
zeroed the dropped embeddings instead (generative-models' `ucg_rate`), which is why generation without a
negative prompt guides against zeros (diffusers' `force_zeros_for_empty_prompt`, as here). Kept: a LoRA
learns from a few per cent of dropped captions, the base model's zeros stay what it learned, and an
adapter trained here behaves as one trained with sd-scripts.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.model import ArchitectureModel
from tuner.archs.sdxl import loaders as sdxl
from tuner.dtypes import DTYPES
from tuner.memory import text_encoder_dtype


def bundled_layout(family: ArchitectureModel) -> sdxl.BundledLayout:
    """What a full fine-tune saves through (the record's `full_layout`): the bundled checkpoint (UNet,
    VAE, both text encoders), which A1111, Forge and ComfyUI load."""
    cfg = family.cfg
    vae, text_encoder = family.weights_path("vae"), family.weights_path("text_encoder")

    def companions() -> dict[str, torch.Tensor]:
        return sdxl.bundle_companions(vae, text_encoder, cfg.model.text_encoder_2 or None,
                                      DTYPES[cfg.save.precision])  # fmt: skip

    return sdxl.BundledLayout(family.layout.keys, companions=companions)


class SDXLModel(ArchitectureModel):
    architecture = "sdxl"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        path = self.weights_path("transformer")
        sdxl.warn_if_v_prediction(path, self.training_objective().prediction)
        return sdxl.load_unet(path, dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return sdxl.load_vae(self.weights_path("vae"), dtype).to(device)

    def load_text_encoder(self, device: torch.device, dtype: str) -> sdxl.TextEncoders:
        """Both encoders and tokenizers; while the text encoders train (samples), the ones training."""
        m = self.cfg.model
        if self.trained_text is not None:
            clip_l, clip_g = self.trained_text.encoders
            tokenizer, tokenizer_2 = self.text_encoders().load_tokenizers()
            return sdxl.TextEncoders(clip_l, tokenizer, clip_g, tokenizer_2)
        encoders = sdxl.load_text_encoders(
            self.weights_path("text_encoder"), m.text_encoder_2 or None, m.tokenizer or None,
            m.tokenizer_2 or None, text_encoder_dtype(dtype),
        )  # fmt: skip
        self.place_text_encoders(dtype, device, encoders.clip_l, encoders.clip_g)
        return encoders

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return sdxl.encode_images(vae, self.single_images(pixels))

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return sdxl.decode_latents(vae, latents).unsqueeze(2)

    def encode_text(
        self, encoder: sdxl.TextEncoders, captions: list[str], controls=None
    ) -> list[dict[str, torch.Tensor]]:
        return sdxl.encode_prompts(encoder, captions)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        level = (t.float() * 1000).round()
        size_ids = cond.get("time_ids")
        if size_ids is None:  # generation: the full picture at its own size, uncropped
            h, w = noisy.shape[-2] * 8, noisy.shape[-1] * 8
            size_ids = sdxl.time_ids((h, w), (0, 0), (h, w)).expand(noisy.shape[0], 6)
        if "ids_l" in cond:  # the text encoders train: their outputs now, through their adapters
            clip_l, clip_g = self.trained_text.encoders
            hidden, pooled = sdxl.encode_ids(clip_l, clip_g, cond["ids_l"], cond["ids_g"])
        else:
            hidden, pooled = cond["hidden"], cond["pooled"]
        return sdxl.predict(model, noisy, level, hidden, pooled, size_ids)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (4, height // 8, width // 8)
