"""FLUX.3: loading the transformer, and calling it as diffusers' modular FLUX.3 pipeline does.

The transformer (diffusers' `Flux3Transformer2DModel`; klein: 5 per-mode blocks per token mode and 28
joint single blocks of width 3072) keeps three token modes: the noisy image, optional reference images and
the text context. Each first runs through its own blocks, then the text and the image tokens share the
joint blocks; the image is modulated by the flow timestep, the text (and references) by timestep 0.

It loads from

* a diffusers folder (`transformer/` of `black-forest-labs/flux-3-image-klein-base`, or the pipeline root);
* the release's single file (BFL's names: `content_mode_blocks.image.0.q_proj`, `single_blocks.0.mlp_in`,
  `early_stream_modulations.image.lin`, ...; with or without `model.diffusion_model.`), converted by
  `tuner.archs.flux3.keys` (bit for bit what diffusers' own converter gives, a test), or the same network
  under diffusers' names.

The step-distilled release (a flow map with `ref_time_in`, which every step also tells the timestep it
jumps to) is refused: tuner trains and samples the base model, whose adapters are what one trains.

Reference images (the dataset's control images, editing) are the model's `image_cond` mode: their clean
latents enter as tokens of their own, with ids (0, row / 2, column / 2, -1 - index), and give no output.

Calling the model (`predict_velocity`): the normalized, 2x2-patchified FLUX.2 VAE latents [B, 128, H, W]
flattened to H·W tokens, t ∈ [0, 1] as the timestep (the pipeline passes the scheduler's timestep / 1000),
the text rows with ids (0, 0, 0, l) and the image tokens with (0, row / 2, column / 2, 0): the model was
trained with the image's H/W positions scaled by 0.5 (`IMAGE_ROPE_SCALE`). It predicts the velocity
noise − x0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.flux2.loaders import image_ids, text_ids
from tuner.archs.flux3.keys import FLUX3_LAYOUT
from tuner.errors import CheckpointError
from tuner.models.component import component_spec, load_component
from tuner.models.identify import variant_table

if TYPE_CHECKING:
    from diffusers import Flux3Transformer2DModel

CONFIGS = Path(__file__).parent / "configs"

IMAGE_ROPE_SCALE = 0.5
"""The factor on the image tokens' H/W position ids (`Flux3PrepareLatentsStep.image_rope_scale`)."""

TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("emb_in.image.weight", "txt_in.weight", "single_blocks.{}.q_proj.weight"),
    {
        # FLUX.3 klein base: width 3072, Qwen3-VL-4B's 8 stacked layers (8 x 2560), 28 joint blocks
        "klein-base": ((3072, 128), (3072, 20480), (28, (3072, 3072))),
        # the test fixture (tuner.archs.flux3.fixture): 2 heads of 32, 1 + 2 blocks, 8 x 16 text
        "tiny": ((64, 128), (64, 128), (2, (64, 64))),
    },
)  # fmt: skip

_FLOW_MAP = ("ref_time_in.in_layer.weight", "target_timestep_embedder.linear_1.weight")


def _refuse_flow_map(shapes: Mapping[str, tuple[int, ...]], path: Path) -> None:
    """The step-distilled FLUX.3 (a flow map) has a second timestep embedder; tuner trains the base."""
    if any(k in shapes for k in _FLOW_MAP):
        raise CheckpointError(
            f"{path}: this is the step-distilled FLUX.3 (a flow map: `ref_time_in`), which tuner does not "
            "train or sample; use the base model (black-forest-labs/flux-3-image-klein-base)."
        )


TRANSFORMER_SPEC = component_spec(
    "FLUX.3 transformer",
    "Flux3Transformer2DModel",
    TRANSFORMER_VARIANTS,
    ("emb_in.image.weight", "early_stream_modulations.image.lin.weight", "single_blocks.0.q_proj.weight"),
    ("x_embedders.image.weight", "early_stream_modulations.image.linear.weight"),
    FLUX3_LAYOUT.key_to_original,
    refuse=_refuse_flow_map,
)


def load_transformer(path: str | Path, dtype: torch.dtype) -> Flux3Transformer2DModel:
    """Load the FLUX.3 transformer from a diffusers folder or a single file (either layout), in eval mode."""
    model = load_component(
        path,
        dtype,
        "Flux3Transformer2DModel",
        "transformer",
        TRANSFORMER_SPEC,
        lambda state_dict, _: FLUX3_LAYOUT.to_diffusers(state_dict),
    )
    if model.config.flow_map:
        _refuse_flow_map(dict.fromkeys(_FLOW_MAP), Path(path))
    return model


def flux3_image_ids(
    height: int, width: int, layer: int = 0, device: torch.device | None = None
) -> torch.Tensor:
    """Position ids [H · W, 4] of a latent's tokens: (0, row / 2, column / 2, layer) on the (t, h, w, l)
    axes; `layer` is 0 for the generated image and -1, -2, ... for the reference images."""
    ids = image_ids(height, width, device=device).float()
    ids[:, 1:3] *= IMAGE_ROPE_SCALE
    ids[:, 3] = layer
    return ids


def _tokens(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] latents as [B, H · W, C] tokens, row by row."""
    return latents.flatten(2).transpose(1, 2)


def predict_velocity(
    model: Flux3Transformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    prompt_embeds: torch.Tensor,
    references: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """The velocity (noise − x0) for latents `noisy` [B, 128, H, W] at t ∈ [0, 1], given the text rows
    [B, L, 8·D] (every row of each caption's window) and optional reference latents [B, 128, H', W']:
    the model's clean `image_cond` tokens, told apart on the `l` position axis (-1, -2, ...) as the
    pipeline's `Flux3PrepareImageCondLatentsStep` does."""
    batch, channels, height, width = noisy.shape
    cond = {}
    if references:
        cond = {
            "image_cond_hidden_states": torch.cat([_tokens(r.to(noisy.dtype)) for r in references], dim=1),
            "image_cond_ids": torch.cat([
                flux3_image_ids(r.shape[-2], r.shape[-1], -(1 + i), noisy.device) for i, r in enumerate(references)
            ]),
        }  # fmt: skip
    out = model(
        hidden_states=_tokens(noisy),
        encoder_hidden_states=prompt_embeds.to(noisy.dtype),
        timestep=t.to(noisy.dtype),
        img_ids=flux3_image_ids(height, width, device=noisy.device),
        txt_ids=text_ids(prompt_embeds.shape[1], noisy.device).float(),
        return_dict=False,
        **cond,
    )[0]
    return out.transpose(1, 2).reshape(batch, channels, height, width)
