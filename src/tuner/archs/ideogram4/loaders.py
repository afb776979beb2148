"""Ideogram 4: loading the transformer, its latents, and calling it as Ideogram4Pipeline does.

The transformer (diffusers' `Ideogram4Transformer2DModel`, 34 blocks of width 4608) runs one sequence of
[text tokens, image tokens]: each text token is a 53,248-wide stack of Qwen3-VL-8B states
(`tuner.archs.ideogram4.text`), each image token a 2x2 patch of the FLUX.2 VAE's 32 channels (128 values).
The VAE is FLUX.2's, loaded and run by `tuner.archs.flux2.loaders` (`encode_images` / `decode_latents`):
latents are the VAE's mode, patchified here (`patchify`) with the token's values in (row, column, channel)
order as the pipeline unpacks them, and normalized per value by the VAE's BatchNorm statistics; they are
stored [128, H/16, W/16].

The transformer loads from either layout users have:

* a diffusers folder (`transformer/` of an Ideogram 4 pipeline, or the pipeline root);
* the release's single file (ComfyUI's `ideogram4_fp8_scaled.safetensors`, dequantized; bf16 too; with or
  without `model.diffusion_model.`), converted by `tuner.archs.ideogram4.keys`;
* a single file in diffusers' names (split `to_q` / `to_k` / `to_v`: a diffusers folder's
  `diffusion_pytorch_model.safetensors`, or a full fine-tune saved with `save.format = "diffusers"`), as is.

The release has two transformers of one shape: the conditional one (trained) and an unconditional one
that its pipeline runs for the guidance pass (asymmetric CFG). musubi-tuner tells them apart by the
file's metadata `model_type` (`ideogram4_cond` / `ideogram4_uncond`); tuner refuses a file marked
unconditional (or named so) as the transformer to train.

Calling the model (`predict_velocity`): the pipeline's layout, each caption's rows left-padded to the
batch's longest, text positions 0..n-1 on all three rotary axes, image positions (0, row, column) +
65536, segment ids keeping padding out of attention. The model's time runs the other way (0 = noise)
and it predicts x0 − noise; tuner's t (1 = noise) and velocity (noise − x0) are converted here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.ideogram4.keys import IDEOGRAM4_LAYOUT
from tuner.errors import CheckpointError
from tuner.models.component import component_spec, load_component
from tuner.models.identify import variant_table

if TYPE_CHECKING:
    from diffusers import Ideogram4Transformer2DModel

CONFIGS = Path(__file__).parent / "configs"

TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    # no fused tensor (`attention.qkv`): a file in diffusers' names has the same signature
    ("input_proj.weight", "llm_cond_proj.weight", "layers.{}.attention.o.weight", "layers.{}.feed_forward.w1.weight"),
    {
        # Ideogram 4 (the conditional and unconditional transformers alike): 34 blocks of width 4608
        "v4": ((4608, 128), (4608, 53248), (34, (4608, 4608)), (34, (12288, 4608))),
        # the test fixture (tuner.archs.ideogram4.fixture): 2 heads of 32, 2 blocks, 13 taps of width 32
        "tiny": ((64, 128), (64, 416), (2, (64, 64)), (2, (128, 64))),
    },
)  # fmt: skip

TRANSFORMER_SPEC = component_spec(
    "Ideogram 4 transformer",
    "Ideogram4Transformer2DModel",
    TRANSFORMER_VARIANTS,
    ("layers.0.attention.qkv.weight", "llm_cond_proj.weight"),
    ("layers.0.attention.to_q.weight", "llm_cond_proj.weight"),
    IDEOGRAM4_LAYOUT.key_to_original,
)

UNCONDITIONAL = "ideogram4_uncond"
"""The metadata `model_type` of the release's unconditional transformer (musubi-tuner's check)."""

# the pipeline's packed sequence (diffusers' transformer_ideogram4.py)
PADDING, IMAGE, TEXT = -1, 2, 3
IMAGE_POSITION_OFFSET = 65536


def is_unconditional(path: str | Path) -> bool:
    """Whether a transformer file is the release's unconditional one: its metadata says so, or its name."""
    from safetensors import safe_open

    path = Path(path)
    if "uncond" in path.name.lower():
        return True
    if path.is_file():
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("model_type") == UNCONDITIONAL
    return False


def load_transformer(path: str | Path, dtype: torch.dtype) -> Ideogram4Transformer2DModel:
    """Load the Ideogram 4 (conditional) transformer from a diffusers folder or a single file, in eval mode."""
    if is_unconditional(path):
        raise CheckpointError(
            f"{path}: Ideogram 4's unconditional transformer (the guidance pass of its pipeline), which is not "
            "trained. Set model.transformer to the conditional one (ideogram4_fp8_scaled.safetensors)."
        )
    return load_component(
        path, dtype, "Ideogram4Transformer2DModel", "transformer", TRANSFORMER_SPEC,
        lambda state_dict, _: IDEOGRAM4_LAYOUT.to_diffusers(state_dict),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Latents
# ---------------------------------------------------------------------------------------------------


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, 4·C, H/2, W/2], each token's values in (row, column, channel) order."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4)
    return patches.reshape(b, 4 * c, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify`."""
    b, c4, h, w = latents.shape
    patches = latents.reshape(b, 2, 2, c4 // 4, h, w).permute(0, 3, 4, 1, 5, 2)
    return patches.reshape(b, c4 // 4, 2 * h, 2 * w)


# ---------------------------------------------------------------------------------------------------
# Calling the transformer
# ---------------------------------------------------------------------------------------------------


def sequence(prompt_mask: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, ...]:
    """(text row index [B, T] into the right-padded prompt, position_ids [B, T + H·W, 3], segment_ids,
    indicator) of the pipeline's layout: T = the longest caption, each caption left-padded to it."""
    lengths = prompt_mask.sum(1)
    longest = int(lengths.max()) if lengths.numel() else 0
    rows = torch.arange(longest, device=prompt_mask.device)[None] - (longest - lengths)[:, None]
    real = rows >= 0
    b = prompt_mask.shape[0]
    r, c = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    image = torch.stack([torch.zeros_like(r), r, c], -1).reshape(1, -1, 3).to(prompt_mask.device)
    text = torch.where(real, rows, 0)[..., None].expand(-1, -1, 3)
    position_ids = torch.cat([text, (image + IMAGE_POSITION_OFFSET).expand(b, -1, -1)], 1)
    ones = torch.ones(b, height * width, dtype=torch.long, device=prompt_mask.device)
    segment_ids = torch.cat([torch.where(real, 1, PADDING), ones], 1)
    indicator = torch.cat([torch.where(real, TEXT, 0), ones * IMAGE], 1)
    return rows.clamp(min=0), position_ids, segment_ids, indicator


def model_inputs(noisy: torch.Tensor, t: torch.Tensor, prompt_embeds: torch.Tensor,
                 prompt_mask: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    """The transformer's keyword arguments for latents `noisy` [B, 128, H, W] at t ∈ [0, 1] (1 = noise),
    given the text stacks right-padded to [B, L, D] with `prompt_mask` [B, L] marking the real rows: one
    sequence of the text rows then the image tokens (`velocity` reads the image's)."""
    b, channels, height, width = noisy.shape
    rows, position_ids, segment_ids, indicator = sequence(prompt_mask.to(noisy.device), height, width)
    longest = rows.shape[1]
    text = prompt_embeds.to(noisy.device, noisy.dtype).gather(
        1, rows[..., None].expand(-1, -1, prompt_embeds.shape[-1])
    ) * (indicator[:, :longest, None] == TEXT)
    image = noisy.flatten(2).transpose(1, 2)
    return {
        "hidden_states": torch.cat([image.new_zeros(b, longest, channels), image], 1),
        "timestep": (1 - t).to(noisy.dtype),
        "encoder_hidden_states": torch.cat([text, text.new_zeros(b, height * width, text.shape[-1])], 1),
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "indicator": indicator,
    }


def velocity(out: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """The output sequence → the velocity (noise − x0): its image tokens (the last H·W), negated."""
    b, channels, height, width = noisy.shape
    return -out[:, -height * width :].transpose(1, 2).reshape(b, channels, height, width)


def predict_velocity(model: Ideogram4Transformer2DModel, noisy: torch.Tensor, t: torch.Tensor,
                     prompt_embeds: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The velocity on `model_inputs`. A sample whose mask is all False has no text: the pipeline's
    unconditional (image-only) pass."""
    inputs = model_inputs(noisy, t, prompt_embeds, prompt_mask)
    return velocity(model(**inputs, return_dict=False)[0], noisy)


# --- the forward cut at its layers, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# Ideogram4Transformer2DModel.forward; the contract suite checks the parts against the whole forward.


def embed(model: Ideogram4Transformer2DModel, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The forward up to its first layer: (the sequence of text and image tokens, the attention mask [B, 1,
    S, S] (tokens see their own segment), rotary cos and sin, the layers' conditioning)."""
    from diffusers.models.transformers.transformer_ideogram4 import (
        LLM_TOKEN_INDICATOR,
        OUTPUT_IMAGE_INDICATOR,
    )

    indicator, timestep, segments = inputs["indicator"], inputs["timestep"], inputs["segment_ids"]
    tokens = inputs["hidden_states"]
    is_text = (indicator == LLM_TOKEN_INDICATOR).to(tokens.dtype).unsqueeze(-1)
    is_image = indicator == OUTPUT_IMAGE_INDICATOR
    image = model.input_proj(tokens * is_image.to(tokens.dtype).unsqueeze(-1)) * is_image.to(
        tokens.dtype
    ).unsqueeze(-1)
    t_cond = model.t_embedding(timestep)
    conditioning = torch.nn.functional.silu(
        model.adaln_proj(t_cond.unsqueeze(1) if timestep.dim() == 1 else t_cond)
    )
    text = model.llm_cond_proj(model.llm_cond_norm(inputs["encoder_hidden_states"] * is_text)) * is_text
    hidden = image + text + model.embed_image_indicator(is_image.to(torch.long))
    cos, sin = model.rotary_emb(inputs["position_ids"])
    mask = (segments.unsqueeze(2) == segments.unsqueeze(1)).unsqueeze(1)
    return hidden, mask, cos.to(hidden.dtype), sin.to(hidden.dtype), conditioning


def run_block(model: Ideogram4Transformer2DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    from tuner.archs.stages import call_block

    hidden, mask, cos, sin, conditioning = carried
    return call_block(model, block, hidden, mask, (cos, sin), conditioning), mask, cos, sin, conditioning


def project_out(model: Ideogram4Transformer2DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    hidden, conditioning = carried[0], carried[-1]
    return velocity(model.final_layer(hidden, conditioning=conditioning), noisy)
