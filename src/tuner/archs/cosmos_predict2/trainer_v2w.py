"""Cosmos-Predict2 Video2World (2B, 14B; 480p and 720p, 10 and 16 fps): video continued from given frames.

The Text2Image network (`trainers/cosmos_predict2.py`: Wan 2.1 VAE latents, T5-11B text, the EDM
preconditioning that makes the output tuner's velocity) with one more input channel, the **condition
mask**, fed as diffusers' `Cosmos2VideoToWorldPipeline` feeds it:

* the first `k` latent frames are *given*: the model input holds them clean (the pipeline's
  `conditioning_latents`, not scaled by c_in), the other frames hold x_t;
* the condition mask (`cond_indicator` spread over the frame: [B, 1, F, H, W]) is 1 on the given
  frames; the model input is [latents, condition mask, padding mask] (the order the transformer
  concatenates them in; the padding mask is the zero channel the Text2Image trainer appends too);
* every latent frame has its own timestep ([B, 1, F, 1, 1]): t on the generated frames and
  t_cond = σ_cond / (1 + σ_cond), σ_cond = 1e-4 (the pipeline's `sigma_conditioning`), on the given ones;
* no `fps`: the released checkpoints were trained with `rope_enable_fps_modulation=False` (NVIDIA's
  `config_video2world.py`; ComfyUI runs them so), their temporal RoPE positions plain frame indices.
  diffusers' pipeline passes `fps=16`, and its transformer then scales those positions by 24 / fps (×1.5),
  which the releases never saw (diffusers issue #14768); the test pins the pipeline's call made with
  `fps=None`, and that `fps=16` differs. Clips are resampled to `model_fps` = 16, the releases' rate.

The pipeline replaces x̂0 on the given frames by the given latents; in velocity terms that is the straight
line (x_t − given) / t, which `predict` returns there, so sampling ends exactly on them. Training leaves
those frames out of the loss (`loss_mask`).

Which frames: NVIDIA trains with 1 or 2 given latent frames (`min/max_num_conditional_frames`), drawn per
sample here from the step's seeded generator (`draw_conditions`; at most all frames but one). A latent
frame is what the causal VAE encodes of the first picture (the first latent frame) or of the next four, so
the given frames come from the clip's own latents and the cache holds nothing more. `tuner generate
--image FIRST` (required, as the pipeline requires an image or a video) gives the first frame: one latent
frame, the VAE's encoding of that picture alone, as the pipeline takes from an image. Image datasets are
refused: one frame leaves nothing to predict.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.archs.cosmos_predict2 import loaders as cosmos
from tuner.archs.cosmos_predict2.trainer import CosmosPredict2Model

SIGMA_CONDITIONING = 1e-4  # Cosmos2VideoToWorldPipeline's `sigma_conditioning` (NVIDIA's sigma_conditional)
T_CONDITIONING = SIGMA_CONDITIONING / (1 + SIGMA_CONDITIONING)
GIVEN_FRAMES = (1, 2)  # the fewest and most latent frames training gives (the releases' training config)


class CosmosPredict2V2WModel(CosmosPredict2Model):
    architecture = "cosmos_predict2_v2w"

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        return cosmos.load_transformer(self.weights_path("transformer"), dtype, video2world=True)

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        return (16, (frames - 1) // 4 + 1, height // 8, width // 8)

    # ---- which frames are given ----
    def encode_frame_images(self, vae: nn.Module, images: list[torch.Tensor], frames: int) -> dict:
        """Generation's given first frame ([B, 3, H, W] in [-1, 1]): its latent frame, given."""
        first = self.encode_pixels(vae, images[0].unsqueeze(2))
        return {"first_frame": first, "given_frames": torch.ones(first.shape[0], dtype=torch.long)}

    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        """`given_frames` [B] (1 or 2, never all of a clip's latent frames; 0 for the samples
        `train.first_frame_conditioning_p` leaves without) and those frames' latents (`first_frame`,
        [B, 16, 2, H, W])."""
        low, high = GIVEN_FRAMES
        drawn = torch.randint(low, high + 1, (x0.shape[0],), generator=generator)
        given = drawn.clamp(max=x0.shape[2] - 1).to(x0.device)
        # train.first_frame_conditioning_p: the others are given no frame, every latent frame noised at t
        # under an all-zero condition mask (the input's own "nothing given"), as text-to-world
        given = torch.where(self.first_frame_given(x0, generator), given, 0)
        return {**cond, "first_frame": x0[:, :, :high], "given_frames": given}

    def loss_mask(self, x0: torch.Tensor, cond: dict) -> torch.Tensor | None:
        if "given_frames" not in cond:
            return None
        return (~frame_indicator(cond["given_frames"].to(x0.device), x0.shape[2])).to(x0.dtype)

    # ---- the model's inputs ----
    def denoiser_call(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict):
        """The network's inputs at x_t with the first `given_frames` latent frames given (see the module
        docstring; batches without given frames get an all-zero condition mask), and the velocity: the
        network's, and on the given frames the straight line to them."""
        b, _, f, h, w = noisy.shape
        given = cond.get("given_frames", torch.zeros(b, dtype=torch.long))
        indicator = frame_indicator(given.to(noisy.device), f)  # [B, 1, F, 1, 1]
        latents = torch.zeros_like(noisy)
        if "first_frame" in cond:
            first = cond["first_frame"].to(noisy.dtype)[:, :, :f]
            latents[:, :, : first.shape[2]] = first
        inputs = torch.where(indicator, latents, noisy)
        timestep = torch.where(indicator, T_CONDITIONING, t.view(b, 1, 1, 1, 1).float())
        mask = indicator.to(noisy.dtype).expand(b, 1, f, h, w)
        padding = noisy.new_zeros(b, model.config.in_channels - 17, f, h, w)  # the all-zero padding mask
        straight = (noisy.float() - latents.float()) / t.float().clamp_min(1e-3).view(b, 1, 1, 1, 1)
        return {
            "hidden_states": torch.cat([inputs, mask, padding], dim=1),
            "timestep": timestep.to(noisy.dtype),
            "encoder_hidden_states": cond["context"].to(noisy.dtype),
            "fps": None,  # the releases' RoPE takes no fps modulation (see the module docstring)
        }, lambda out: torch.where(indicator, straight.to(out.dtype), out)


def frame_indicator(given: torch.Tensor, frames: int) -> torch.Tensor:
    """[B, 1, F, 1, 1] booleans: True on each sample's first `given` latent frames (`cond_indicator`)."""
    return (torch.arange(frames, device=given.device) < given[:, None]).view(-1, 1, frames, 1, 1)
