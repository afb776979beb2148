"""Qwen-Image 2.1: loading its transformer, VAE and text encoder, and calling them as QwenImage21Pipeline does.

Qwen-Image 2.1 shares the family's name and tooling but none of Qwen-Image's networks (diffusers 0.42's
`QwenImage21Transformer2DModel`, `AutoencoderKLQwenImage21` and `QwenImage21Pipeline`):

* transformer: one stack of single-stream blocks over the joint sequence [text tokens, image tokens], one
  shared modulation (`modulation.1`), bias-free SwiGLU MLPs (`img_mlp.gate_layer / proj / out`). Text and
  condition tokens are modulated from t = 0 (`causal_condition`); the attention is block-causal (text
  causal, each image block bidirectional), which the model builds itself. Loads from a diffusers folder
  or a single file: the release / ComfyUI layout is diffusers' names (`model.diffusion_model.` optional)
  except that each block's SwiGLU gate and up projections are one `img_mlp.gate_up` (gate rows first), as
  diffusers' single-file converter (`convert_qwen_image21_transformer_checkpoint_to_diffusers`,
  `diffusers/loaders/single_file_utils.py`) reads it; the same network saved in diffusers' names loads too.
* VAE: 64 latent channels, 16x spatial compression, RGBA in and out (the pipeline hands RGB images over
  with an opaque alpha). A diffusers folder, or a single file holding its diffusers keys: no other
  layout of this VAE is published in code we could read offline (ComfyUI has none).
* text: the language model of Qwen3-VL (`tuner.models.qwen3_vl`), the pipeline's template with the system
  prompt "Comprehend and analyze the provided prompt." dropped from the output, the last decoder layer's
  output *before* the final norm (what the pipeline reads).

Latents are not patched: one latent pixel is one token (16x16 image pixels), so pixel sides are multiples
of 32 (the pipeline's `vae_scale_factor * 2`: the joint sequence holds one text-width slot per 2x2
target tokens). The timestep is t ∈ [0, 1] (the pipeline passes scheduler_t / 1000).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.qwen_image import loaders as qwen_image
from tuner.models.component import component_spec, load_component
from tuner.models.identify import variant_table
from tuner.models.qwen3_vl import COLUMNS, TextEncoder, language_model_spec, load_language_model
from tuner.networks.architectures import COMFY_BARE_FORMS, ArchitectureKeys
from tuner.networks.fused import FusedLayer
from tuner.networks.layouts import CheckpointLayout

if TYPE_CHECKING:
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel

CONFIGS = Path(__file__).parent / "configs_21"  # the record's `configs`
LATENT_CHANNELS = 64
VAE_FACTOR = 16

TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("img_in.weight", "txt_in.in_layer.weight", "transformer_blocks.{}.attn.to_q.weight",
     "transformer_blocks.{}.img_mlp.out.weight"),
    {
        # Qwen-Image 2.1: diffusers' class defaults (32 blocks of width 4096, Qwen3-VL-8B's width 4096)
        "qwen-image-2.1": ((4096, 64), (4096, 4096), (32, (4096, 4096)), (32, (4096, 12288))),
        # the test fixture (tuner.archs.qwen_image.fixture): 2 heads of 32, 2 blocks, text width 64
        "tiny": ((64, 64), (64, 64), (2, (64, 64)), (2, (64, 192))),
    },
)  # fmt: skip

VAE_VARIANTS = variant_table(
    CONFIGS / "vae",
    ("encoder.conv_in.weight", "decoder.conv_in.weight"),
    {
        "qwen-image-2.1": ((96, 4, 3, 3), (1152, 64, 3, 3)),
        "tiny": ((16, 4, 3, 3), (48, 64, 3, 3)),
    },
)  # fmt: skip

TEXT_VARIANTS = variant_table(
    CONFIGS / "text_encoder",
    COLUMNS,
    {
        # Qwen3-VL-8B (unconfirmed offline: the width the transformer's `context_in_dim` asks for)
        "qwen3-vl-8b": ((151936, 4096), (36, (12288, 4096))),
        "tiny": ((2048, 64), (6, (128, 64))),
    },
)  # fmt: skip
TEXT_SPEC = language_model_spec("Qwen3-VL text encoder (Qwen-Image 2.1)", TEXT_VARIANTS)

# QwenImage21Pipeline's text-to-image template; the system turn is dropped from the output
SYSTEM = "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
PREFIX = SYSTEM + "<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"

# The release's names are diffusers' except the fused SwiGLU input (gate rows, then up rows).
_BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.out")
_LINEARS = (
    *(f"transformer_blocks.{{i}}.{m}" for m in _BLOCK_LINEARS),
    "img_in", "txt_in.in_layer", "txt_in.out_layer", "modulation.1", "norm_out.linear", "proj_out",
    "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
)  # fmt: skip
_FUSED = (
    FusedLayer(
        "transformer_blocks.{i}.img_mlp.gate_up",
        ("transformer_blocks.{i}.img_mlp.gate_layer", "transformer_blocks.{i}.img_mlp.proj"),
    ),
)
_TENSORS = tuple(
    (k, k)
    for k in (
        "transformer_blocks.{i}.attn.norm_q.weight",
        "transformer_blocks.{i}.attn.norm_k.weight",
        "txt_in.text_norm.weight",
    )
)
QWEN_IMAGE_21_KEYS = ArchitectureKeys(
    "qwen_image_21", tuple((m, m) for m in _LINEARS), _FUSED, comfy_forms=COMFY_BARE_FORMS
)
"""Qwen-Image 2.1's adapter name map: diffusers' names, the SwiGLU gate and up fused as `img_mlp.gate_up`."""
QWEN_IMAGE_21_LAYOUT = CheckpointLayout(QWEN_IMAGE_21_KEYS, tensor_renames=_TENSORS)

TRANSFORMER_SPEC = component_spec(
    "Qwen-Image 2.1 transformer",
    "QwenImage21Transformer2DModel",
    TRANSFORMER_VARIANTS,
    ("img_in.weight", "modulation.1.weight", "transformer_blocks.0.img_mlp.gate_up.weight"),
    ("img_in.weight", "modulation.1.weight", "transformer_blocks.0.img_mlp.gate_layer.weight"),
    QWEN_IMAGE_21_LAYOUT.key_to_original,
)
VAE_SPEC = component_spec(
    "Qwen-Image 2.1 VAE",
    "AutoencoderKLQwenImage21",
    VAE_VARIANTS,
    ("encoder.conv_in.weight", "decoder.conv_in.weight", "quant_conv.weight"),
)


def load_transformer(path: str | Path, dtype: torch.dtype) -> QwenImage21Transformer2DModel:
    """The Qwen-Image 2.1 transformer from a diffusers folder or a single file (either layout), in eval mode."""
    return load_component(
        path,
        dtype,
        "QwenImage21Transformer2DModel",
        "transformer",
        TRANSFORMER_SPEC,
        lambda state_dict, _: QWEN_IMAGE_21_LAYOUT.to_diffusers(state_dict),
    )


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKLQwenImage21:
    """The Qwen-Image 2.1 VAE from a diffusers folder or a single file of its diffusers keys."""
    return load_component(path, dtype, "AutoencoderKLQwenImage21", "vae", VAE_SPEC)


def load_text_encoder(path: str | Path, tokenizer_path: str | Path | None, dtype: torch.dtype) -> TextEncoder:
    """Qwen3-VL's language model and its tokenizer (`tuner.models.qwen3_vl.load_language_model`)."""
    return load_language_model(
        path,
        tokenizer_path,
        dtype,
        TEXT_SPEC,
        "Qwen3-VL tokenizer (the processor/ folder of Qwen-Image 2.1)",
        tokenizer_folder="processor",
    )


@torch.no_grad()
def encode_prompts(encoder: TextEncoder, captions: list[str], max_length: int = 512) -> list[torch.Tensor]:
    """One [L, D] tensor per caption, as QwenImage21Pipeline encodes a prompt without images: the template's
    hidden states after the system turn, from the last decoder layer before the final norm. Captions are
    cut at `max_length` tokens; an empty caption is " " (the pipeline's rule)."""
    model, tokenizer = encoder
    captions = [c or " " for c in captions]
    drop = len(tokenizer(SYSTEM).input_ids)
    head = tokenizer(
        [PREFIX + c for c in captions],
        truncation=True,
        padding=True,
        padding_side="right",
        max_length=max_length + len(tokenizer(PREFIX).input_ids),
        return_tensors="pt",
    )
    tail = tokenizer([SUFFIX] * len(captions), return_tensors="pt")
    ids = torch.cat([head.input_ids, tail.input_ids], dim=1).to(model.device)
    mask = torch.cat([head.attention_mask, tail.attention_mask], dim=1).to(model.device).bool()
    # positions count real tokens only (the pipeline pads on the left; causal attention makes it the same)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
    before_norm = []
    handle = model.norm.register_forward_hook(lambda module, args, output: before_norm.append(args[0]))
    try:
        model(input_ids=ids, attention_mask=mask, position_ids=positions)
    finally:
        handle.remove()
    return [h[m][drop:] for h, m in zip(before_norm[0], mask, strict=True)]


def _rgba(pixels: torch.Tensor) -> torch.Tensor:
    """RGB images in [-1, 1] with an opaque alpha channel (1), as the pipeline's RGBA conversion gives."""
    return torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)


@torch.no_grad()
def encode_images(vae: AutoencoderKLQwenImage21, pixels: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, 64, 1, H/16, W/16] of RGB images [B, 3, 1, H, W] in [-1, 1]: the mean of the
    latent distribution, (latents − mean) / std, as the pipeline encodes a condition image (Qwen-Image's
    rule, `tuner.archs.qwen_image.loaders.encode_images`, on the RGBA image)."""
    if pixels.ndim != 5 or pixels.shape[2] != 1 or pixels.shape[3] % 32 or pixels.shape[4] % 32:
        raise ValueError(
            f"Qwen-Image 2.1 takes single frames with sides divisible by 32, got {tuple(pixels.shape)}"
        )
    return qwen_image.encode_images(vae, _rgba(pixels))


@torch.no_grad()
def decode_latents(vae: AutoencoderKLQwenImage21, latents: torch.Tensor) -> torch.Tensor:
    """RGB images [B, 3, 1, H, W] in about [-1, 1] (the decoder's alpha dropped) from normalized latents."""
    return qwen_image.decode_latents(vae, latents)[:, :3]


def predict_velocity(
    model: QwenImage21Transformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The velocity for latents `noisy` [B, 64, 1, H, W] at t ∈ [0, 1], as QwenImage21Pipeline calls the model
    for text-to-image: one token per latent pixel, the text's slots (`img_mask` False) then one slot per 2x2
    target tokens; the text mask is dropped when it masks nothing; the output's last H·W tokens."""
    b, c, _, height, width = noisy.shape
    if height % 2 or width % 2:
        raise ValueError(f"Qwen-Image 2.1 needs even latent sides, got {tuple(noisy.shape)}")
    tokens = noisy.reshape(b, c, height * width).transpose(1, 2)
    text_slots = prompt_embeds.shape[1]
    img_mask = torch.cat(
        [torch.zeros(b, text_slots, dtype=torch.bool), torch.ones(b, height * width // 4, dtype=torch.bool)],
        dim=1,
    ).to(noisy.device)
    if prompt_mask is not None and bool(prompt_mask.all()):
        prompt_mask = None
    out = model(
        hidden_states=tokens,
        timestep=t.to(noisy.dtype),
        encoder_hidden_states=prompt_embeds.to(noisy.dtype),
        encoder_hidden_states_mask=None if prompt_mask is None else prompt_mask.to(noisy.device).bool(),
        img_shapes=[[(1, height, width)]] * b,
        img_mask=img_mask,
        return_dict=False,
    )[0]
    out = out[:, -math.prod((height, width)) :]
    return out.transpose(1, 2).reshape(b, c, 1, height, width)
