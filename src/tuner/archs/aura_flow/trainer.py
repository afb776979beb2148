"""AuraFlow (v0.1-v0.3) on diffusers' AuraFlowTransformer2DModel.

Latents: SDXL's VAE (4 channels, 8x, mean · 0.13025), which the MMDiT patchifies 2x2 itself (pixel sides
are multiples of 16, within the position table: 1024 px for v0.1, 1536 px for v0.3). Text: Pile-T5-XL's
last hidden state over the prompt padded to `cache.text_max_length` tokens (256, AuraFlowPipeline's
`max_sequence_length`), padded rows zeroed and kept: the model takes no text mask. Guidance is
AuraFlowPipeline's v_uncond + w·(v_cond − v_uncond) (its default 3.5), the negative being the empty prompt;
sampling uses its scheduler's shift 1.73 (ComfyUI's `ModelSamplingAuraFlow` default too).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.aura_flow import loaders as aura_flow
from tuner.archs.model import ArchitectureModel
from tuner.archs.sdxl import loaders as sdxl
from tuner.memory import text_encoder_dtype


class AuraFlowModel(ArchitectureModel):
    architecture = "aura_flow"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return aura_flow.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return sdxl.load_vae(self.weights_path("vae"), dtype).to(device)

    def load_text_encoder(self, device: torch.device, dtype: str) -> aura_flow.TextEncoder:
        encoder = aura_flow.load_text_encoder(
            self.weights_path("text_encoder"), self.cfg.model.tokenizer or None, text_encoder_dtype(dtype)
        )
        self.place_text_encoders(dtype, device, encoder.model)
        return encoder

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return sdxl.encode_images(vae, self.single_images(pixels))

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return sdxl.decode_latents(vae, latents).unsqueeze(2)

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        embeds = aura_flow.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)
        return [{"prompt_embeds": e} for e in embeds]

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return aura_flow.predict_velocity(model, noisy, t, cond["prompt_embeds"])

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import PipelineParts

        return PipelineParts(
            prologue=lambda noisy, t, cond: aura_flow.embed(model, noisy, t, cond["prompt_embeds"]),
            blocks=[*model.joint_transformer_blocks, *model.single_transformer_blocks],  # joint, then single
            run_block=lambda block, carried: aura_flow.run_block(model, block, carried),
            epilogue=lambda carried, noisy, t, cond: aura_flow.project_out(model, carried, noisy),
            prologue_modules=(
                model.pos_embed,
                model.time_step_embed,
                model.time_step_proj,
                model.context_embedder,
            ),
        )

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (4, height // 8, width // 8)
