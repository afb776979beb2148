"""HunyuanImage 2.1 (base, distilled; 17B) on diffusers' HunyuanImageTransformer2DModel.

Latents: AutoencoderKLHunyuanImage, 64 channels 32× smaller, scaled by 0.75289 (no shift); the
transformer's patch is 1×1, so pixel sides are multiples of 32 (the release runs at 2K). Text:
Qwen2.5-VL-7B's third-to-last hidden states of the prompt in its system template and ByT5 states of the
prompt's quoted text, each at its true length, padded with masks when batched (`text.py`;
`cache.text_max_length` is the pipeline's `tokenizer_max_length`, 1000). Objective: flow matching,
velocity noise − x0 at t × 1000, shifted timesteps as sd-scripts trains it (`timesteps.shift`; its
recommended `discrete_flow_shift` is 5). Sampling: the base model at shift 5, guided as the release guides
it (CFG at 3.5 for the first 6 steps, then adaptive projected guidance: the record's `sample_guidance`;
`--guidance-method cfg` for plain CFG); the distilled one (8 steps, shift 4, no CFG) is given its embedded
guidance 3.25 and MeanFlow's interval end r, the next step's time, as HunyuanImagePipeline gives it (the
record's `flow_next_time`). Training gives r = t, the instantaneous velocity flow matching's target is, and
warns for the distilled model: it undoes the distillation.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.hunyuan_image import loaders as hunyuan_image
from tuner.archs.hunyuan_image import text as hunyuan_image_text
from tuner.archs.hunyuan_video15.loaders import TextEncoders, collate, load_text_encoders
from tuner.archs.model import ArchitectureModel
from tuner.memory import text_encoder_dtype


def distilled_warning(cfg) -> str:
    """The record's `training_warning`: the distilled model is guidance- and MeanFlow-distilled to 8 steps."""
    path = cfg.model.transformer
    if not hunyuan_image.is_distilled(path):
        return ""
    return (f"{path} is HunyuanImage 2.1 distilled (guidance and MeanFlow distilled to 8 steps): training it "
            "directly undoes the distillation (it is trained at r = t, the instantaneous velocity, while it "
            "samples intervals). Train the base model (hunyuanimage2.1_bf16.safetensors).")  # fmt: skip


class HunyuanImageModel(ArchitectureModel):
    architecture = "hunyuan_image"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return hunyuan_image.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return hunyuan_image.load_vae(self.weights_path("vae"), dtype).to(device)

    def load_text_encoder(self, device: torch.device, dtype: str) -> TextEncoders:
        m = self.cfg.model
        encoders = load_text_encoders(
            self.weights_path("text_encoder"), m.text_encoder_2 or None, m.tokenizer or None,
            m.tokenizer_2 or None, text_encoder_dtype(dtype), model="HunyuanImage 2.1",
        )  # fmt: skip
        self.place_text_encoders(dtype, device, encoders.qwen, encoders.byt5)
        return encoders

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return hunyuan_image.encode_images(vae, self.single_images(pixels))

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return hunyuan_image.decode_latents(vae, latents).unsqueeze(2)

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        return hunyuan_image_text.encode_prompts(encoder, captions, self.cfg.cache.text_max_length)

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate(entries)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return hunyuan_image.predict_velocity(model, noisy, t, cond)

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import cut_at_blocks

        blocks = [*model.transformer_blocks, *model.single_transformer_blocks]  # dual-, then single-stream
        embedders = (
            model.x_embedder,
            model.time_guidance_embed,
            model.context_embedder,
            model.context_embedder_2,
        )
        return cut_at_blocks(
            model,
            hunyuan_image,
            lambda noisy, t, cond: hunyuan_image.model_inputs(model, noisy, t, cond),
            blocks,
            embedders,
        )

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        factor = hunyuan_image.VAE_FACTOR
        return (hunyuan_image.LATENT_CHANNELS, height // factor, width // factor)
