"""Cosmos-Predict2 text-to-image (2B, 14B) on diffusers' CosmosTransformer3DModel.

Latents: the Wan 2.1 VAE's (8× spatial, 16 channels), normalized with its per-channel statistics and
scaled by the pipeline's `sigma_data` (1.0); an image is a one-frame video. Text: T5-11B rows at their
true length, zero-padded to `cache.text_max_length` (512, the pipeline's) when batched and given to the
transformer without a mask, as Cosmos2TextToImagePipeline does. The model's output is the flow-matching
velocity for tuner's `x_t` at timestep t (`tuner.archs.cosmos_predict2.loaders` derives this from the pipeline's
EDM preconditioning).

Timesteps: the release trains with EDM's log-normal noise levels, σ = exp(n), n ~ N(0, 1); in flow time
t = σ / (1 + σ) = sigmoid(n), which is `logit_normal` with mean 0 and std 1 (the `auto` mode).

Guidance: the pipeline guides x̂0 as cond + g · (cond − uncond), which is plain classifier-free guidance
at g + 1 (x̂0 is linear in the velocity at a given t). The record's `cfg_form = "cond_plus"` says so:
`--guidance 7` is the pipeline's 7, applied as plain CFG at 8.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tuner.archs.cosmos_predict2 import loaders as cosmos
from tuner.archs.model import ArchitectureModel
from tuner.archs.wan import loaders as wan
from tuner.memory import text_encoder_dtype


class CosmosPredict2Model(ArchitectureModel):
    architecture = "cosmos_predict2"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return cosmos.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return wan.load_vae(self.weights_path("vae"), dtype, "2.1", self.architecture).to(device)

    def load_text_encoder(self, device: torch.device, dtype: str):
        model, tokenizer = cosmos.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, model)
        return model, tokenizer

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return wan.encode_video(vae, pixels) * cosmos.SIGMA_DATA

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return wan.decode_latents(vae, latents / cosmos.SIGMA_DATA)

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        model, tokenizer = encoder
        embeds = cosmos.encode_prompts(model, tokenizer, captions, self.cfg.cache.text_max_length)
        return [{"context": e} for e in embeds]

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {"context": cosmos.collate([e["context"] for e in entries], self.cfg.cache.text_max_length)}

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        inputs, velocity = self.denoiser_call(model, noisy, t, cond)
        return velocity(model(**inputs, return_dict=False)[0])

    def denoiser_call(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor,
                      cond: dict) -> tuple[dict, Callable[[torch.Tensor], torch.Tensor]]:  # fmt: skip
        """The network's keyword arguments at x_t, and what turns its output into the velocity (each member
        of the family builds its own; `predict` and the pipeline parts call the network between them)."""
        return cosmos.model_inputs(model, noisy, t, cond["context"]), lambda out: out

    def pipeline_parts(self, model: nn.Module):
        """The network cut at its blocks between `denoiser_call`'s two halves (the epilogue builds the
        inputs again, tensor arithmetic only, for the velocity's second half)."""
        from tuner.archs.stages import PipelineParts

        def epilogue(carried: tuple, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
            inputs, velocity = self.denoiser_call(model, noisy, t, cond)
            return velocity(cosmos.project_out(model, carried, inputs["hidden_states"]))

        projections = [getattr(model, name, None) for name in ("crossattn_proj", "learnable_pos_embed")]
        return PipelineParts(
            prologue=lambda noisy, t, cond: cosmos.embed(model, self.denoiser_call(model, noisy, t, cond)[0]),
            blocks=list(model.transformer_blocks),
            run_block=lambda block, carried: cosmos.run_block(model, block, carried),
            epilogue=epilogue,
            prologue_modules=(model.patch_embed, model.time_embed, *filter(None, projections)),
        )

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (16, 1, height // 8, width // 8)
