"""LTX-Video 0.9 text-to-video (2B) on diffusers' LTXVideoTransformer3DModel (`tuner.archs.ltx_video.loaders`).

The video half of LTX-2 (`trainers/ltx2.py`) without sound: the same VAE compression (32× spatial, 8×
temporal, frame counts 8N+1, sides multiples of 32) and latent normalization, T5-XXL text padded to
`cache.text_max_length` with its mask, and the pipeline's RoPE scale (8 / fps, 32, 32) at 25 fps.

One network does text-to-video and image-to-video, as `LTXImageToVideoPipeline` runs it: the image's
latent frame replaces the first latent frame and its tokens get timestep 0 (`archs/first_frame.py`).
Training gives a video item its first frame with probability `train.first_frame_conditioning_p` (unset:
0, text-to-video only, as before the key), the way LTX-Video-Trainer users train image-to-video from plain
videos; `tuner generate --image FIRST` gives it at generation.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.first_frame import (
    FirstFrameModel,
    first_frame_rows,
    given_first_frame,
    straight_to_given,
)
from tuner.archs.ltx2 import loaders as ltx2
from tuner.archs.ltx_video import loaders as ltx_video
from tuner.archs.model import ArchitectureModel
from tuner.memory import text_encoder_dtype

FPS = 25.0  # LTXPipeline's default frame rate (it scales the temporal RoPE)


class LTXVideoModel(FirstFrameModel, ArchitectureModel):
    architecture = "ltx_video"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return ltx_video.load_transformer(self.weights_path("transformer"), dtype)

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return ltx_video.load_vae(self.weights_path("vae"), dtype).to(device)

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return ltx2.encode_video(vae, pixels)

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return ltx2.decode_video(vae, latents)

    def load_text_encoder(self, device: torch.device, dtype: str):
        from transformers import AutoTokenizer

        from tuner.archs.flux.loaders import load_t5

        t5, tokenizer_dir = load_t5(
            self.weights_path("text_encoder"), text_encoder_dtype(dtype), "text_encoder", "tokenizer"
        )
        tokenizer_dir = self.cfg.model.tokenizer or tokenizer_dir
        if tokenizer_dir is None:
            self.weights_path("tokenizer")  # names the missing key
        self.place_text_encoders(dtype, device, t5)
        return t5, AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def encode_text(self, encoder, captions: list[str], controls=None) -> list[dict[str, torch.Tensor]]:
        t5, tokenizer = encoder
        embeds, mask = ltx_video.encode_prompts(t5, tokenizer, captions, self.cfg.cache.text_max_length)
        return [{"context": e, "mask": m} for e, m in zip(embeds, mask)]

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The velocity at x_t; rows given their first frame (`clean_first`) get it in place of latent frame
        0 at timestep 0 (the pipeline's `t * (1 - conditioning_mask)` per token) and the straight line to it
        as its velocity."""
        out = model(**self.model_inputs(noisy, t, cond), return_dict=False)[0]
        return self.velocity(out, noisy, t, cond)

    def model_inputs(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict:
        b, _, frames, height, width = noisy.shape
        clean = first_frame_rows(cond)
        timestep = t * 1000
        if clean is not None:
            timestep = timestep.view(b, 1).repeat(1, frames * height * width)  # tokens in (F, H, W) order
            timestep[clean, : height * width] = 0
        given = noisy if clean is None else given_first_frame(noisy, cond, clean)
        return {
            "hidden_states": given.flatten(2).transpose(1, 2),
            "encoder_hidden_states": cond["context"].to(noisy.dtype),
            "timestep": timestep.to(noisy.dtype),
            "encoder_attention_mask": cond["mask"],
            "num_frames": frames,
            "height": height,
            "width": width,
            "rope_interpolation_scale": (8 / self.record.model_fps, 32, 32),
        }

    def velocity(self, out: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The output tokens → latents; the given frames' velocity the straight line to them."""
        out = out.transpose(1, 2).reshape(noisy.shape[0], -1, *noisy.shape[2:])
        clean = first_frame_rows(cond)
        return out if clean is None else straight_to_given(out, noisy, t, cond, clean)

    def pipeline_parts(self, model: nn.Module):
        from tuner.archs.stages import PipelineParts

        return PipelineParts(
            prologue=lambda noisy, t, cond: ltx_video.embed(model, self.model_inputs(noisy, t, cond)),
            blocks=list(model.transformer_blocks),
            run_block=lambda block, carried: ltx_video.run_block(model, block, carried),
            epilogue=lambda carried, noisy, t, cond: self.velocity(
                ltx_video.project_out(model, carried), noisy, t, cond
            ),  # fmt: skip
            prologue_modules=(model.proj_in, model.time_embed, model.caption_projection),
        )

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (128, (frames - 1) // 8 + 1, height // 32, width // 32)
