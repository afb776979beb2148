"""Krea 2 (RAW, Turbo): loading the transformer, and calling it as Krea2Pipeline does.

The transformer (diffusers' `Krea2Transformer2DModel`, 12B) is one stack of single-stream blocks over
[text tokens, image tokens]; the text enters as a stack of Qwen3-VL layers per token, which a small
text-fusion transformer collapses first (`tuner.archs.krea2.text`). The VAE is Qwen-Image's, loaded and
normalized by `tuner.archs.qwen_image.loaders` (16 channels, 8x, per-channel mean / std), and the latents
are packed 2x2 into tokens of 64 values the same way.

The transformer loads from either layout users have:

* a diffusers folder (`transformer/` of a Krea 2 diffusers pipeline, or the pipeline root);
* the release's single file (ComfyUI's `krea2_raw_bf16.safetensors`, `krea2_turbo_bf16.safetensors`,
  `*_fp8_scaled.safetensors` dequantized; with or without `model.diffusion_model.`), converted by
  `tuner.archs.krea2.keys` (bit for bit what diffusers' own single-file converter gives), or the same
  network saved under diffusers' names.

RAW (the base, trained on; about 52 steps with guidance) and Turbo (distilled to 8 steps without guidance)
have the same tensors, so a file cannot say which it is: `turbo` in the file or folder name picks Turbo
(`is_turbo`), which changes only generation's defaults (Krea2Pipeline's `is_distilled`: a fixed shift μ =
1.15 instead of one from the image size).

Calling the model (`predict_velocity`): packed latent tokens, the text stack [B, L, layers, D] with its
mask (padded text rows are masked as keys), t ∈ [0, 1] (1 = noise) as the timestep, and position ids
(0, 0, 0) for every text token and (0, row, column) for the image tokens. It predicts the velocity
noise − x0.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.krea2.keys import KREA2_LAYOUT
from tuner.archs.qwen_image.loaders import pack_latents, unpack_latents
from tuner.models.component import component_spec, load_component
from tuner.models.identify import variant_table

if TYPE_CHECKING:
    from diffusers import Krea2Transformer2DModel

CONFIGS = Path(__file__).parent / "configs"

TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("first.weight", "txtfusion.projector.weight", "blocks.{}.attn.wq.weight", "blocks.{}.mlp.gate.weight"),
    {
        # Krea 2 RAW and Turbo (12B): 28 blocks of width 6144, 12 tapped Qwen3-VL-4B layers (Turbo: by name)
        "raw": ((6144, 64), (1, 12), (28, (6144, 6144)), (28, (16384, 6144))),
        # the test fixture (tuner.archs.krea2.fixture): 2 heads of 32, 2 blocks, 2 tapped layers
        "tiny": ((64, 64), (1, 2), (2, (64, 64)), (2, (128, 64))),
    },
)  # fmt: skip
TURBO_CONFIG = CONFIGS / "transformer" / "turbo"

TRANSFORMER_SPEC = component_spec(
    "Krea 2 transformer",
    "Krea2Transformer2DModel",
    TRANSFORMER_VARIANTS,
    ("first.weight", "txtfusion.projector.weight", "blocks.0.mod.lin"),
    ("img_in.weight", "text_fusion.projector.weight", "transformer_blocks.0.scale_shift_table"),
    KREA2_LAYOUT.key_to_original,
)


def is_turbo(path: str | Path) -> bool:
    """Whether a transformer file or folder is Krea 2 Turbo, by its name (its shapes equal RAW's): the
    file's, or a diffusers folder's and its parent's (`Krea-2-Turbo/transformer`)."""
    path = Path(path)
    names = [path.name] if path.is_file() else [path.name, path.parent.name]
    return any("turbo" in name.lower() for name in names)


def load_transformer(path: str | Path, dtype: torch.dtype) -> Krea2Transformer2DModel:
    """Load the Krea 2 transformer from a diffusers folder or a single file (either layout), in eval mode."""
    return load_component(
        path,
        dtype,
        "Krea2Transformer2DModel",
        "transformer",
        TRANSFORMER_SPEC,
        lambda state_dict, _: KREA2_LAYOUT.to_diffusers(state_dict),
        config=lambda variant: (
            TURBO_CONFIG if variant.name != "tiny" and is_turbo(path) else variant.config_dir
        ),
    )


def position_ids(text_length: int, height: int, width: int, device: torch.device) -> torch.Tensor:
    """[text_length + height·width, 3] rotary coordinates: (0, 0, 0) per text token, then (0, row, column)
    per image token of a `height` x `width` token grid."""
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    image = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return torch.cat([torch.zeros(text_length, 3, dtype=image.dtype), image]).float().to(device)


def model_inputs(noisy: torch.Tensor, t: torch.Tensor, prompt_embeds: torch.Tensor,
                 prompt_mask: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    """The velocity (noise − x0) for latents `noisy` [B, 16, 1, H, W] at t ∈ [0, 1], given the text stacks
    padded to [B, L, layers, D] with `prompt_mask` [B, L] marking the real rows."""
    height, width = noisy.shape[-2:]
    return {
        "hidden_states": pack_latents(noisy),
        "encoder_hidden_states": prompt_embeds.to(noisy.dtype),
        "timestep": t.to(noisy.dtype),
        "position_ids": position_ids(prompt_embeds.shape[1], height // 2, width // 2, noisy.device),
        "encoder_attention_mask": prompt_mask.to(noisy.device).bool(),
    }


def predict_velocity(model: Krea2Transformer2DModel, noisy: torch.Tensor, t: torch.Tensor,
                     prompt_embeds: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The velocity (shape of `noisy`) on `model_inputs`."""
    out = model(**model_inputs(noisy, t, prompt_embeds, prompt_mask), return_dict=False)[0]
    return unpack_latents(out, *noisy.shape[-2:])


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# Krea2Transformer2DModel.forward; the contract suite checks the parts against the whole forward.


def embed(model: Krea2Transformer2DModel, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block: (text then image tokens, the blocks' modulation, rotary cos and
    sin, the joint attention mask [B, 1, 1, N], the timestep embedding the final layer takes)."""
    text, mask, image = (
        inputs["encoder_hidden_states"],
        inputs["encoder_attention_mask"],
        inputs["hidden_states"],
    )
    temb = model.time_embed(inputs["timestep"], dtype=image.dtype)
    modulation = model.time_mod_proj(torch.nn.functional.gelu(temb, approximate="tanh"))
    joint = torch.cat([mask, mask.new_ones(image.shape[:2])], dim=1)[:, None, None]
    text = model.txt_in(model.text_fusion(text, attention_mask=mask[:, None, None]))
    cos, sin = model.rotary_emb(inputs["position_ids"])
    return torch.cat([text, model.img_in(image)], dim=1), modulation, cos, sin, joint, temb


def run_block(model: Krea2Transformer2DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    from tuner.archs.stages import call_block

    hidden, modulation, cos, sin, mask, temb = carried
    return call_block(model, block, hidden, modulation, (cos, sin), mask), modulation, cos, sin, mask, temb


def project_out(
    model: Krea2Transformer2DModel, carried: tuple, noisy: torch.Tensor, text_length: int
) -> torch.Tensor:
    """The forward after its last block: the image tokens through the final layer, unpacked."""
    hidden, temb = carried[0], carried[-1]
    return unpack_latents(model.final_layer(hidden[:, text_length:], temb), *noisy.shape[-2:])
