"""Wan 2.1 image-to-video (I2V 14B, 480p / 720p) and first-last-frame-to-video (FLF2V 14B).

Both are Wan 2.1's text-to-video network with two additions, fed as diffusers' `WanImageToVideoPipeline`
feeds them:

* 36 input channels: the noisy latents (16), a 4-channel frame mask and the *condition latents* (16):
  the VAE's encoding of a video that is the first frame followed by zeros (FLF2V: first frame, zeros,
  last frame). The mask is 1 on the latent frames that carry a given frame: pixel mask m (1 on given
  frames) with its first entry repeated 4 times, regrouped 4 per latent frame, so latent frame j holds
  pixel frames 4j-3..4j and the first latent frame all four copies of frame 0.
* an image cross-attention on CLIP ViT-H/14's penultimate hidden states of the given frame(s)
  (`tuner.models.clip_vision`); FLF2V adds a position embedding over both frames' tokens.

The frames come from the training clip itself (its first, and for FLF2V last, frame after the bucket's
crop), so caching stores per clip `latents`, `cond_latents` and `clip`, and the cache key includes the
CLIP encoder's identity beside the VAE's (`latent_encoders`). Image datasets are refused: a single frame
has nothing left to predict. diffusers' Wan attention takes the last 512 tokens of the context as text,
so text is zero-padded to 512 whatever `cache.text_max_length` is.

Wan 2.2 I2V A14B (`trainers/wan22.py`) takes the same 36-channel input without the CLIP layers, so the
input is built by `WanFrameConditionedModel` and `WanI2VModel` adds CLIP to it (the cached `clip`,
the image encoder in the cache key, the `encoder_hidden_states_image` argument, text padded to 512).
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.wan.trainer import WanModel
from tuner.models import clip_vision

TEXT_TOKENS = 512  # the text length diffusers' WanAttnProcessor assumes when it splits off image tokens


class LatentEncoders:
    """What `encode_latents` needs for image-to-video: the VAE, and the CLIP image encoder where the model
    has image cross-attention (None for Wan 2.2 I2V A14B)."""

    def __init__(self, vae: nn.Module, image_encoder: clip_vision.ImageEncoder | None = None):
        self.vae, self.image_encoder = vae, image_encoder

    def eval(self) -> LatentEncoders:
        self.vae.eval()
        return self


class WanFrameConditionedModel(WanModel):
    """Wan's 36-channel image-to-video input (noise, frame mask, condition latents) without CLIP: what
    the Wan 2.2 I2V A14B experts take. `WanI2VModel` adds the CLIP image cross-attention of Wan 2.1."""

    in_channels = 36

    def load_latent_encoder(self, device: torch.device, dtype: torch.dtype) -> LatentEncoders:
        return LatentEncoders(self.load_vae(device, dtype))

    # ---- what the cache holds ----
    def encode_latents(
        self, encoders: LatentEncoders, pixels: torch.Tensor, controls: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        frames = [pixels[:, :, 0]] + ([pixels[:, :, -1]] if self.record.frame_images == 2 else [])
        return {
            "latents": self.encode_pixels(encoders.vae, pixels),
            **self.encode_frame_images(encoders, frames, pixels.shape[2]),
        }

    def encode_frame_images(
        self, encoders: LatentEncoders, images: list[torch.Tensor], frames: int
    ) -> dict[str, torch.Tensor]:
        """`cond_latents` [B, 16, F', H', W'] of the given frame images ([B, 3, H, W] in [-1, 1]: the
        first, and for FLF2V the last) of a `frames`-frame video."""
        first = images[0]
        video = first.new_zeros(first.shape[0], 3, frames, *first.shape[2:])
        video[:, :, 0] = first
        if self.record.frame_images == 2:
            video[:, :, -1] = images[1]
        return {"cond_latents": self.encode_pixels(encoders.vae, video)}

    # ---- with or without the first frame ----
    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        """`first_given` [B]: which samples are given their frame (`train.first_frame_conditioning_p`)."""
        return {**cond, "first_given": self.first_frame_given(x0, generator)}

    # ---- the model's inputs ----
    def model_inputs(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict[str, torch.Tensor]:
        """The transformer's inputs at x_t given the frame(s); a sample not given its frame (`first_given` False) gets
        zero condition latents and a zero mask, the input ComfyUI's WanImageToVideo builds without a start
        image (zeros in the normalized latent space, as its `concat_cond` fills an absent image); only Wan
        2.2 I2V A14B trains so (`Architecture.first_frame_required` keeps Wan 2.1's CLIP models at p = 1)."""
        cond_latents = cond["cond_latents"].to(noisy)
        mask = frame_mask(
            noisy.shape[0], noisy.shape[2], noisy.shape[3:], last=self.record.frame_images == 2
        ).to(noisy)
        given = cond.get("first_given")
        if given is not None and not given.all():
            keep = given.view(-1, 1, 1, 1, 1).to(noisy)
            cond_latents, mask = cond_latents * keep, mask * keep
        return {
            "hidden_states": torch.cat([noisy, mask, cond_latents], dim=1),
            "timestep": t * 1000,
            "encoder_hidden_states": cond["context"].to(noisy.dtype),
            **self.image_context(cond, noisy.dtype),
        }

    def image_context(self, cond: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The transformer's image cross-attention inputs (none without CLIP layers)."""
        return {}


class WanI2VModel(WanFrameConditionedModel):
    architecture = "wan_i2v"

    # ---- loading ----
    def load_latent_encoder(self, device: torch.device, dtype: torch.dtype) -> LatentEncoders:
        image_encoder = clip_vision.load_image_encoder(self.weights_path("image_encoder"), dtype)
        image_encoder.model.to(device)
        return LatentEncoders(self.load_vae(device, dtype), image_encoder)

    # ---- what the cache holds ----
    def encode_frame_images(
        self, encoders: LatentEncoders, images: list[torch.Tensor], frames: int
    ) -> dict[str, torch.Tensor]:
        """`cond_latents` (see the base class) and `clip` [B, tokens, width] (FLF2V: [B, 2, tokens, width])
        of the given frame images."""
        clip = torch.stack([encoders.image_encoder.encode(image) for image in images], dim=1)
        return {
            **super().encode_frame_images(encoders, images, frames),
            "clip": clip[:, 0] if self.record.frame_images == 1 else clip,
        }

    # ---- the model's inputs ----
    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        first = entries[0]["context"]
        out = first.new_zeros(len(entries), TEXT_TOKENS, first.shape[-1])
        for i, entry in enumerate(entries):
            ctx = entry["context"][: self.cfg.cache.text_max_length]
            out[i, : ctx.shape[0]] = ctx
        return {"context": out}

    def image_context(self, cond: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        clip = cond["clip"].to(dtype)
        if clip.dim() == 4:  # FLF2V: [B, 2, tokens, width] -> [2B, ...], each sample's two frames adjacent
            clip = clip.flatten(0, 1)
        return {"encoder_hidden_states_image": clip}


class WanFLF2VModel(WanI2VModel):
    architecture = "wan_flf2v"


def frame_mask(batch: int, latent_frames: int, size: tuple[int, int], last: bool = False) -> torch.Tensor:
    """The 4-channel mask [B, 4, F', H', W'] of Wan's image-to-video input: 1 where a frame is given."""
    frames = 4 * (latent_frames - 1) + 1
    given = torch.zeros(frames)
    given[0] = 1
    if last:
        given[-1] = 1
    per_pixel = torch.cat([given[:1].repeat(4), given[1:]])  # the first frame fills its latent frame
    mask = per_pixel.view(latent_frames, 4).t()  # [4, F']
    return mask[None, :, :, None, None].expand(batch, 4, latent_frames, *size).contiguous()
