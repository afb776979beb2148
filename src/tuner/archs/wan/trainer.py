"""Wan 2.1 text-to-video (1.3B and 14B) on diffusers' WanTransformer3DModel.

Latents: AutoencoderKLWan, 8× spatial and 4× temporal compression, 16 channels, normalized with the
VAE's per-channel statistics. Text: UMT5-XXL embeddings stored at their true length and zero-padded to
512 tokens when batched, as the official code and WanPipeline feed them. The transformer patchifies
latents 1×2×2, so pixel sides are multiples of 16 and frame counts are 4N+1; Wan runs at 16 fps.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.model import ArchitectureModel
from tuner.archs.wan import loaders as wan
from tuner.errors import CheckpointError
from tuner.memory import text_encoder_dtype

# What a Wan transformer's input channel count says it is
_INPUT_CHANNELS = {
    16: "a text-to-video Wan checkpoint (Wan 2.1 T2V, Wan 2.2 T2V A14B)",
    36: "an image-to-video Wan checkpoint (noise + first-frame latents + mask)",
    48: "a Wan 2.2 TI2V-5B checkpoint (the Wan 2.2 VAE's latents)",
}


class WanModel(ArchitectureModel):
    architecture = "wan"
    in_channels = 16  # the transformer's input: the VAE's latent channels (TI2V-5B: 48)

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        model = wan.load_transformer(self.weights_path("transformer"), dtype, self.architecture)
        channels = model.config.in_channels
        if channels != self.in_channels:  # a diffusers folder of a variant tuner does not ship
            what = _INPUT_CHANNELS.get(channels, "a Wan variant tuner does not know")
            raise CheckpointError(
                f"{self.cfg.model.transformer}: {what} ({channels} input channels); architecture "
                f"{self.architecture!r} trains {_INPUT_CHANNELS[self.in_channels]}. Use such a checkpoint."
            )
        return model

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return wan.load_vae(self.weights_path("vae"), dtype, "2.1", self.architecture).to(device)

    def load_text_encoder(self, device: torch.device, dtype: str):
        model, tokenizer = wan.load_text_encoder(
            self.weights_path("text_encoder"),
            self.cfg.model.tokenizer or None,
            text_encoder_dtype(dtype),
        )
        self.place_text_encoders(dtype, device, model)
        return model, tokenizer

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return wan.encode_video(vae, pixels)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return wan.decode_latents(vae, latents)

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        model, tokenizer = encoder
        embeds = wan.encode_prompts(model, tokenizer, captions, self.cfg.cache.text_max_length)
        return [{"context": e} for e in embeds]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        length = self.cfg.cache.text_max_length
        first = entries[0]["context"]
        out = first.new_zeros(len(entries), length, first.shape[-1])
        for i, entry in enumerate(entries):
            ctx = entry["context"][:length]
            out[i, : ctx.shape[0]] = ctx
        return {"context": out}

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return model(**self.model_inputs(noisy, t, cond), return_dict=False)[0]

    def model_inputs(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict[str, torch.Tensor]:
        """The transformer's keyword arguments for x_t at t."""
        return {"hidden_states": noisy, "timestep": t * 1000,
                "encoder_hidden_states": cond["context"].to(noisy.dtype)}  # fmt: skip

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import cut_at_blocks

        blocks = model.blocks
        embedders = (model.patch_embedding, model.condition_embedder)
        return cut_at_blocks(
            model, wan, lambda noisy, t, cond: self.model_inputs(noisy, t, cond), blocks, embedders
        )

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (16, (frames - 1) // 4 + 1, height // 8, width // 8)
