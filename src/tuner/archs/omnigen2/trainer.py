"""OmniGen2 text-to-image on its own transformer (`tuner.archs.omnigen2.model`).

Latents: the FLUX.1 VAE (8× compression, 16 channels, normalized with its shift and scaling factors),
which the transformer cuts into 2×2 patches itself, so pixel sides are multiples of 16. Text:
Qwen2.5-VL-3B's last hidden state over the chat-templated caption, stored at its true length and padded
per batch with a mask (`tuner.archs.omnigen2.loaders`). The model's time runs from noise (0) to image
(1) as Lumina 2's, so Lumina 2's `predict_velocity` turns it into tuner's convention.

Timesteps: the release's scheduler shifts time by the image size, s = √(latent pixels) / 40 (3.2 at
1024×1024, in tuner's t: t' = s·t / (1 + (s − 1)·t)), and trains on logit-normal times so shifted (the
training configs' `transport`: lognorm, do_shift, dynamic_time_shift). tuner has no mode for that
square-root rule: the example config trains with `mode = "shift"` at 3.2, and sampling uses 3.2 at every
size (the record's `sampling.shift`).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.flux_vae import FluxVAEImageModel
from tuner.archs.lumina2.loaders import predict_velocity
from tuner.archs.model import padded_prompts
from tuner.archs.omnigen2 import loaders as omnigen2
from tuner.memory import text_encoder_dtype


class OmniGen2Model(FluxVAEImageModel):
    architecture = "omnigen2"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return omnigen2.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str):
        encoder = omnigen2.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        length = min(self.cfg.cache.text_max_length, omnigen2.MAX_TEXT_TOKENS)
        return [{"prompt_embeds": e} for e in omnigen2.encode_prompts(encoder, captions, length)]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return padded_prompts(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return predict_velocity(model, noisy, t, cond["prompt_embeds"], cond["prompt_mask"])

    def pipeline_parts(self, model: nn.Module):
        """The refiners and embeddings as the prologue, the joint layers as blocks, the output layer (and
        Lumina 2's time convention: τ = 1 − t, output negated) as the epilogue. The rotations travel as
        real pairs, the mask as a tensor (a block gets none where no row is padded, as in `forward`)."""
        from tuner.archs.stages import PipelineParts

        def prologue(noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, ...]:
            text, mask = cond["prompt_embeds"].to(noisy.dtype), cond["prompt_mask"].to(noisy.device)
            joint, joint_mask, rope, temb = model.embed(noisy, 1 - t.float(), text, mask)
            return joint, joint_mask, torch.view_as_real(rope), temb

        def run_block(block: nn.Module, carried: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            joint, mask, rope, temb = carried
            return model.run_layer(block, joint, mask, torch.view_as_complex(rope), temb), mask, rope, temb

        def epilogue(carried, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
            lengths = cond["prompt_mask"].sum(dim=1).tolist()
            return -model.project_out(carried[0], carried[3], lengths, *noisy.shape[-2:])

        return PipelineParts(
            prologue=prologue,
            blocks=list(model.layers),
            run_block=run_block,
            epilogue=epilogue,
            prologue_modules=(
                model.x_embedder,
                model.time_caption_embed,
                model.context_refiner,
                model.noise_refiner,
            ),
        )
