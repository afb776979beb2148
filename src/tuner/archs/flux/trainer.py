"""FLUX.1-dev (text to image) and FLUX.1 Kontext (edit with one reference image) on diffusers'
FluxTransformer2DModel.

Latents: AutoencoderKL with 8× compression and 16 channels, normalized with the VAE's shift and
scaling factors, packed 2×2 into tokens inside `predict` (so pixel sides are multiples of 16, and the
resolution-dependent `flux_shift` counts H/16 · W/16 tokens). Text: T5-XXL's hidden states over the
prompt padded to `cache.text_max_length` tokens (512 in FluxPipeline) and CLIP-L's pooled output. dev
is guidance-distilled: `model.guidance` feeds its guidance embedding (1.0 is the usual training value;
pick the sampling value, e.g. 3.5, when generating). Kontext is the same network given the reference
image's tokens after the target's; its reference latents come from the dataset's control images.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.flux import loaders as flux
from tuner.archs.flux_vae import FluxVAEImageModel
from tuner.errors import ConfigError
from tuner.memory import text_encoder_dtype


class FluxModel(FluxVAEImageModel):
    architecture = "flux"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return flux.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str) -> flux.TextEncoders:
        m = self.cfg.model
        encoders = flux.load_text_encoders(
            self.weights_path("text_encoder"),
            m.text_encoder_2 or None,
            m.tokenizer or None,
            m.tokenizer_2 or None,
            text_encoder_dtype(dtype),
        )
        self.place_text_encoders(dtype, device, encoders.clip, encoders.t5)
        return encoders

    def encode_text(
        self, encoder: flux.TextEncoders, captions: list[str], controls=None
    ) -> list[dict[str, torch.Tensor]]:
        return flux.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return flux.predict_velocity(
            model, noisy, t, cond["t5"], cond["pooled"], self.cfg.model.guidance, self.references(cond)
        )

    def references(self, cond: dict) -> tuple[torch.Tensor, ...]:
        """Reference latents the model sees beside the target (none for text to image)."""
        return ()

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import PipelineParts

        def prologue(noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, ...]:
            g = self.cfg.model.guidance
            return flux.embed(model, flux.model_inputs(model, noisy, t, cond["t5"], cond["pooled"], g,
                                                       self.references(cond)))  # fmt: skip

        return PipelineParts(
            prologue=prologue,
            blocks=[*model.transformer_blocks, *model.single_transformer_blocks],  # dual-, then single-stream
            run_block=lambda block, carried: flux.run_block(model, block, carried),
            epilogue=lambda carried, noisy, t, cond: flux.velocity(flux.project_out(model, carried), noisy),
            prologue_modules=(model.x_embedder, model.time_text_embed, model.context_embedder),
        )


class FluxKontextModel(FluxModel):
    """FLUX.1 Kontext: the dev network, given the reference image (`control_0`) after the target."""

    architecture = "flux_kontext"

    def references(self, cond: dict) -> tuple[torch.Tensor, ...]:
        controls = sorted(k for k in cond if k.startswith("control_"))
        if controls != ["control_0"]:
            raise ConfigError(
                f"flux_kontext edits with exactly one reference image per item, got {len(controls)} "
                "(set control_directory / control_path in the dataset config, one control image per item; "
                "pass one --control when generating)."
            )
        return (cond["control_0"],)
