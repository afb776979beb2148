"""FramePack image-to-video (lllyasviel's FramePackI2V_HY) on diffusers' HunyuanVideoFramepackTransformer3DModel.

FramePack predicts a video one section of latent frames at a time, each given the image's latent frame,
clean history latents at 1×/2×/4× compression and the image's SigLIP embedding (`tuner.archs.framepack.loaders`
explains the inputs). Text, VAE and guidance are HunyuanVideo's, so this is `HunyuanVideoModel` with
the section's inputs added.

Training on a clip (section training): the clip's first frame is the given image; the next
`min(9, F' - 1)` latent frames are the section, and the latent frames after it (up to 19, zero-padded as
the sampler's empty history is) are its history, split 1 / 2 / 16 into the three compressions. That is
the section the release's sampler makes last (right after the image, padding 0), with the indices it
uses. The cache holds per clip:

* `latents` [16, 1 + W, H, W]: the image's latent frame followed by the section. The image's frame is
  never predicted: `predict` returns the straight line from x_t to it (so sampling ends on it exactly)
  and `loss_mask` leaves it out;
* `first_frame` [16, 1, H, W]: the VAE's encoding of the first frame alone (the pipeline's image latent);
* `history` [16, 19, H, W] and `image_embeds` [tokens, 1152] (SigLIP's last hidden state).

The latent key covers `model.vae` and `model.image_encoder`. `tuner generate --image` makes the video
section by section (`tuner.archs.framepack.sections`), as the release's sampler. `FramePackF1Model` is
FramePack-F1 (forward sections) and `FramePackOneFrameModel` the one-frame (image editing) mode.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from tuner.archs.framepack import loaders as framepack
from tuner.archs.hunyuan_video import loaders as hunyuan_video
from tuner.archs.hunyuan_video.trainer import HunyuanVideoModel
from tuner.archs.wan.trainer_i2v import LatentEncoders
from tuner.memory import text_encoder_dtype


class FramePackModel(HunyuanVideoModel):
    architecture = "framepack"

    # ---- loading ----
    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return framepack.load_transformer(self.weights_path("transformer"), dtype)

    def load_latent_encoder(self, device: torch.device, dtype: torch.dtype) -> LatentEncoders:
        image_encoder = framepack.load_image_encoder(self.weights_path("image_encoder"), dtype)
        image_encoder.model.to(device)
        return LatentEncoders(self.load_vae(device, dtype), image_encoder)

    # ---- what the cache holds ----
    def encode_latents(
        self, encoders: LatentEncoders, pixels: torch.Tensor, controls: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        clip = self.encode_pixels(encoders.vae, pixels)
        given = self.encode_frame_images(encoders, [pixels[:, :, 0]], pixels.shape[2])
        window = min(framepack.LATENT_WINDOW, clip.shape[2] - 1)
        return {"latents": self.trained_section(clip, window, given["history"]), **given}

    def trained_section(self, clip: torch.Tensor, window: int, history: torch.Tensor) -> torch.Tensor:
        """The image's slot and the section a clip's latents train (the first after the image), writing the
        frames after it into `history` (zeros)."""
        after = clip[:, :, 1 + window :][:, :, : history.shape[2]]
        history[:, :, : after.shape[2]] = after
        return clip[:, :, : 1 + window]

    def encode_frame_images(
        self, encoders: LatentEncoders, images: list[torch.Tensor], frames: int
    ) -> dict[str, torch.Tensor]:
        """`first_frame` (the image's latent frame), an empty `history` and `image_embeds` of the image."""
        first = self.encode_pixels(encoders.vae, images[0].unsqueeze(2))
        history = first.new_zeros(*first.shape[:2], sum(framepack.HISTORY_SIZES), *first.shape[3:])
        return {
            "first_frame": first,
            "history": history,
            "image_embeds": encoders.image_encoder.encode(images[0]),
        }

    # ---- the model's inputs ----
    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The section's velocity from the model; for the image's frame (frame 0) the straight line from
        x_t to the given latent, (x_t − x0) / t, which sampling follows to land on it."""
        return self.with_first_frame(self.predict_section(model, noisy[:, :, 1:], t, cond), noisy, t, cond)

    @staticmethod
    def with_first_frame(out: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        first = cond["first_frame"].to(noisy)
        straight = (noisy[:, :, :1].float() - first.float()) / t.float().clamp_min(1e-3).view(-1, 1, 1, 1, 1)
        return torch.cat([straight.to(out.dtype), out], dim=2)

    def pipeline_parts(self, model: nn.Module):
        return section_parts(model, lambda noisy, t, cond: self.section_inputs(model, noisy[:, :, 1:], t, cond),
                             lambda out, noisy, t, cond: self.with_first_frame(out, noisy, t, cond),
                             lambda noisy: noisy[:, :, 1:])  # fmt: skip

    def loss_mask(self, x0: torch.Tensor, cond: dict) -> torch.Tensor:
        mask = torch.ones(1, 1, x0.shape[2], 1, 1, device=x0.device)
        mask[:, :, 0] = 0
        return mask

    def predict_section(
        self, model: nn.Module, section: torch.Tensor, t: torch.Tensor, cond: dict
    ) -> torch.Tensor:
        """The velocity of the section's frames (`section_inputs`)."""
        return model(**self.section_inputs(model, section, t, cond), return_dict=False)[0]

    def section_inputs(self, model: nn.Module, section: torch.Tensor, t: torch.Tensor, cond: dict) -> dict:
        """The transformer's inputs for the section (the base model's inverted anti-drifting indices)."""
        return framepack.section_inputs(model, section, t, cond, self.cfg.model.guidance)


class FramePackF1Model(FramePackModel):
    """FramePack-F1 (`FramePack_F1_I2V_HY_20250503`): the same network trained to predict the video forwards,
    each section from the frames *before* it (diffusers' vanilla sampling, musubi-tuner's `--f1` cache).

    A clip trains its last section: `latents` is the image's slot (frame 0, out of the loss as in
    `framepack`) followed by the clip's last `min(9, F' - 1)` latent frames, and `history` the 19 latent
    frames before them in time order (the clip's own, its first frame included; zeros in front where the
    clip is shorter), split 16 / 2 / 1 into 4× / 2× / 1× with `forward_section_indices`. Generation makes
    the sections from the image on (`tuner.archs.framepack.sections.sample_sections_f1`)."""

    architecture = "framepack_f1"

    def trained_section(self, clip: torch.Tensor, window: int, history: torch.Tensor) -> torch.Tensor:
        """The image's slot and the clip's last section, writing the frames before it into `history`'s end."""
        before = clip[:, :, : clip.shape[2] - window][:, :, -history.shape[2] :]
        history[:, :, history.shape[2] - before.shape[2] :] = before
        return torch.cat([clip[:, :, :1], clip[:, :, -window:]], dim=2)

    def section_inputs(self, model: nn.Module, section: torch.Tensor, t: torch.Tensor, cond: dict) -> dict:
        indices = framepack.forward_section_indices(section.shape[2])
        return framepack.section_inputs(
            model, section, t, cond, self.cfg.model.guidance, indices, forward=True
        )


class OneFrameEncoders(NamedTuple):
    """What the one-frame mode's `encode_text` needs: HunyuanVideo's text encoders and SigLIP."""

    text: hunyuan_video.TextEncoders
    image_encoder: framepack.ImageEncoder


class FramePackOneFrameModel(HunyuanVideoModel):
    """FramePack's single-frame mode (musubi-tuner's "one frame" training, used for image editing): one
    target image generated from one reference image, as a one-frame section.

    An image item with one or two control images (the references): the target is one latent frame at
    `one_frame.target_index` (default the end of a 9-frame section, index 9), the references' latents are
    clean latents at `one_frame.clean_indices` (default [0]) followed by a zero "post" latent at 1 +
    `one_frame.latent_window` (10; left out with `one_frame.no_post`), and the 2× / 4× history is zeros at
    the indices after it (musubi's zeros when `one_frame_no_2x` / `no_4x` are off). The indices are applied
    when the model is called, so changing them needs no new cache. The reference's SigLIP
    embedding is computed with the caption (`text_uses_controls`), so `tuner generate --control REF`
    gets it as training does; the latent entry holds `latents` and `control_0`."""

    architecture = "framepack_1f"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return framepack.load_transformer(self.weights_path("transformer"), dtype)

    def load_text_encoder(self, device: torch.device, dtype: str) -> OneFrameEncoders:
        image_encoder = framepack.load_image_encoder(
            self.weights_path("image_encoder"), text_encoder_dtype(dtype)
        )
        image_encoder.model.to(device)
        return OneFrameEncoders(super().load_text_encoder(device, dtype), image_encoder)

    def encode_text(
        self, encoder: OneFrameEncoders, captions: list[str], controls=None
    ) -> list[dict[str, torch.Tensor]]:
        entries = super().encode_text(encoder.text, captions)
        for entry, images in zip(entries, controls):
            entry["image_embeds"] = encoder.image_encoder.encode(images[0][:, 0].unsqueeze(0))[0]
        return entries

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {
            **super().collate_text(entries),
            "image_embeds": torch.stack([e["image_embeds"] for e in entries]),
        }

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return model(**self.section_inputs(model, noisy, t, cond), return_dict=False)[0]

    def pipeline_parts(self, model: nn.Module):
        return section_parts(model, lambda noisy, t, cond: self.section_inputs(model, noisy, t, cond),
                             lambda out, noisy, t, cond: out, lambda noisy: noisy)  # fmt: skip

    def section_inputs(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> dict:
        """The transformer's inputs: the references as the clean frames, the target at its index."""
        one = self.cfg.one_frame
        references = [cond[f"control_{i}"] for i in range(len(one.clean_indices))]
        reference = references[0]
        post = 0 if one.no_post else 1
        history = reference.new_zeros(*reference.shape[:2], post + sum(framepack.HISTORY_SIZES[1:]),
                                      *reference.shape[3:])  # fmt: skip
        inputs = {**cond, "first_frame": torch.cat(references, dim=2), "history": history}
        indices = framepack.one_frame_indices(
            one.latent_window, one.clean_indices, one.target(self.record.one_frame), one.no_post
        )
        return framepack.section_inputs(model, noisy, t, inputs, self.cfg.model.guidance, indices)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (16, 1, height // 8, width // 8)


def section_parts(model: nn.Module, inputs, finish, section):
    """The FramePack network cut at its blocks between `inputs(noisy, t, cond)` (the transformer's keyword
    arguments) and `finish(out, noisy, t, cond)` (the prediction from its output for `section(noisy)`)."""
    from tuner.archs.stages import PipelineParts

    def epilogue(carried: tuple, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        return finish(framepack.project_out(model, carried, section(noisy)), noisy, t, cond)

    return PipelineParts(
        prologue=lambda noisy, t, cond: framepack.embed(model, inputs(noisy, t, cond)),
        blocks=[*model.transformer_blocks, *model.single_transformer_blocks],  # dual-, then single-stream
        run_block=lambda block, carried: framepack.run_block(model, block, carried),
        epilogue=epilogue,
        prologue_modules=(
            model.x_embedder,
            model.clean_x_embedder,
            model.time_text_embed,
            model.context_embedder,
            model.image_projection,
        ),  # fmt: skip
    )
