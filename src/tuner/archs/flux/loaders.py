"""FLUX.1 (dev, Kontext): loading its four models and turning captions and images into model inputs.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder, or BFL's single file (`flux1-dev.safetensors`,
  `flux1-kontext-dev.safetensors`: `double_blocks.0.img_attn.qkv.weight`, ...; with or without ComfyUI's
  `model.diffusion_model.` prefix; scaled-fp8 files are dequantized), converted by tuner's own
  `flux_keys` at any hidden size. Kontext has dev's architecture: which one a file is, is declared by
  the config's architecture name, not detected;
* VAE: a diffusers folder, or BFL's `ae.safetensors` (the LDM autoencoder layout);
* CLIP-L: a diffusers folder, or ComfyUI's `clip_l.safetensors` (transformers' `text_model.*` keys;
  a `text_projection.weight` / `logit_scale` there is ignored, FLUX uses the pooled output);
* T5-XXL encoder: a diffusers folder, or ComfyUI's `t5xxl_*.safetensors` (transformers' T5 layout,
  `shared.weight` standing for the tied `encoder.embed_tokens.weight`).
A single text-encoder file carries no tokenizer: pass the tokenizer folder.

Model inputs are what FluxPipeline / FluxKontextPipeline compute: CLIP's pooled output over 77 tokens,
T5's last hidden state over the prompt padded to `max_length` tokens *without* an attention mask (so
the padding rows carry content and are kept: an entry is [max_length, 4096]), latents
(z − shift_factor) · scaling_factor packed 2×2 into tokens with position ids (0, row, col), the
reference image of Kontext with ids (1, row, col), and the timestep in [0, 1] (the model scales it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from tuner.archs.flux.keys import (
    transformer_key_to_original,
    transformer_to_diffusers,
    vae_key_to_original,
    vae_to_diffusers,
)
from tuner.errors import CheckpointError
from tuner.models.component import component_spec, diffusers_keys, load_component, vae_levels
from tuner.models.encoders import (
    CLIP_COLUMNS,
    T5_COLUMNS,
    clip_text_entries,
    load_clip_encoder,
    load_encoder,
    model_keys,
)
from tuner.models.identify import CHROMA_MARKER, FLUX2_MARKERS, SingleFileSpec, Variant, variant_table
from tuner.models.loading import (
    load_tokenizer,
    normalize_shapes,
    read_folder_config,
    read_tensor_shapes,
    resolve_folder,
    second_text_encoder,
)

# diffusers and transformers are imported where a model is built: importing them costs seconds (every
# diffusers model class, torch._dynamo), which a command that loads no model should not pay.
if TYPE_CHECKING:
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, PreTrainedTokenizerBase, T5EncoderModel

CONFIGS = Path(__file__).parent / "configs"

# ---------------------------------------------------------------------------------------------------
# Known variants. Signatures use original-layout names; `None` means the tensor must be absent (it pins
# the number of blocks). FLUX.1 Fill / Depth / Canny (wider img_in) and schnell (no guidance_in) are
# not among them.
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("img_in.weight", "txt_in.weight", "vector_in.in_layer.weight", "guidance_in.in_layer.weight",
     "double_blocks.{}.img_mod.lin.weight", "single_blocks.{}.linear2.weight"),
    {
        # FLUX.1-dev and FLUX.1-Kontext-dev
        "dev": ((3072, 64), (3072, 4096), (3072, 768), (3072, 256), (19, (18432, 3072)), (38, (3072, 15360))),
        # the test fixture (tuner.archs.flux.fixture): 2 heads of 32, one block of each kind
        "tiny": ((64, 64), (64, 64), (64, 32), (64, 256), (1, (384, 64)), (1, (64, 320))),
    },
)  # fmt: skip

VAE_VARIANTS = variant_table(
    CONFIGS / "vae",
    ("encoder.conv_in.weight", "encoder.conv_out.weight", "decoder.conv_in.weight"),
    {
        "flux": ((128, 3, 3, 3), (32, 512, 3, 3), (512, 16, 3, 3)),
        "tiny": ((32, 3, 3, 3), (32, 64, 3, 3), (64, 16, 3, 3)),
    },
)

CLIP_VARIANTS = variant_table(
    CONFIGS / "clip",
    CLIP_COLUMNS,
    {"clip-l": ((49408, 768), (12, (3072, 768))), "tiny": ((1088, 32), (2, (64, 32)))},
)

# UMT5 (Wan's encoder) has a relative attention bias in every layer; T5 only in the first.
_UMT5_BIAS = "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"
T5_VARIANTS = variant_table(
    CONFIGS / "t5",
    (*T5_COLUMNS, _UMT5_BIAS),
    {"t5-xxl": ((32128, 4096), (24, (10240, 4096)), None), "tiny": ((512, 64), (2, (128, 64)), None)},
)

_ORIGINAL_TRANSFORMER_MARKERS = ("double_blocks.0.img_attn.qkv.weight", "img_in.weight")
_ORIGINAL_VAE_MARKERS = ("encoder.down.0.block.0.conv1.weight", "decoder.up.0.block.0.conv1.weight")


def _vae_keys(variant: Variant) -> list[str]:
    levels = vae_levels("AutoencoderKL", variant)
    return [vae_key_to_original(k, levels) for k in diffusers_keys("AutoencoderKL")(variant)]


def ldm_vae_to_diffusers(state_dict: dict[str, torch.Tensor], variant: Variant) -> dict[str, torch.Tensor]:
    """An LDM-layout VAE file's tensors under diffusers' keys, numbered by the variant's levels (the VAEs
    of FLUX.1, SD3 and SDXL)."""
    return vae_to_diffusers(state_dict, vae_levels("AutoencoderKL", variant))


_DIFFUSERS_MARKERS = ("transformer_blocks.0.attn.to_q.weight", "x_embedder.weight")
TRANSFORMER_SPEC = component_spec(
    "FLUX.1 transformer", "FluxTransformer2DModel", TRANSFORMER_VARIANTS,
    _ORIGINAL_TRANSFORMER_MARKERS, _DIFFUSERS_MARKERS, transformer_key_to_original)  # fmt: skip
VAE_SPEC = SingleFileSpec(
    what="FLUX.1 VAE",
    variants=VAE_VARIANTS,
    expected_keys=_vae_keys,
    original_markers=_ORIGINAL_VAE_MARKERS,
    diffusers_markers=(
        "encoder.down_blocks.0.resnets.0.conv1.weight",
        "decoder.up_blocks.0.resnets.0.conv1.weight",
    ),
    to_original=vae_key_to_original,  # both known variants have 4 levels
)

# The encoder's embedding is tied to `shared`; ComfyUI's files store only `shared.weight`.
T5_TIED_EMBEDDING = {"encoder.embed_tokens.weight": "shared.weight"}


t5_keys = model_keys("T5EncoderModel", leave_out=tuple(T5_TIED_EMBEDDING))
"""The state-dict keys of a T5 encoder of a variant's config, the tied embedding under its release name."""


T5_SPEC = SingleFileSpec(
    what="T5 text encoder",
    variants=T5_VARIANTS,
    expected_keys=t5_keys,
    original_markers=("shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight"),
    aliases=T5_TIED_EMBEDDING,
)

CLIP_SPEC = SingleFileSpec(
    what="CLIP text encoder",
    variants=CLIP_VARIANTS,
    expected_keys=model_keys("CLIPTextModel"),
    original_markers=("embeddings.token_embedding.weight", "encoder.layers.0.self_attn.q_proj.weight"),
)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype) -> FluxTransformer2DModel:
    """Load the FLUX.1 transformer from a diffusers folder or a single file (either layout), in eval mode."""
    folder = resolve_folder(path, "transformer")
    _refuse_chroma(path, folder)
    if folder is None and any(k in normalize_shapes(read_tensor_shapes(path)) for k in FLUX2_MARKERS):
        raise CheckpointError(  # same block names, another network
            f'{path}: a FLUX.2 transformer (shared stream modulations), not FLUX.1. Set model.architecture = "flux2".'
        )
    return load_component(
        path,
        dtype,
        "FluxTransformer2DModel",
        "transformer",
        TRANSFORMER_SPEC,
        lambda sd, _: transformer_to_diffusers(sd),
    )


def _refuse_chroma(path: str | Path, folder: Path | None) -> None:
    """Chroma keeps FLUX.1's names; its guidance approximator (same name in both layouts) tells it apart."""
    if folder is not None:
        chroma = read_folder_config(folder).get("_class_name") == "ChromaTransformer2DModel"
    else:
        chroma = CHROMA_MARKER in normalize_shapes(read_tensor_shapes(path))
    if chroma:
        raise CheckpointError(
            f'{path}: this is a Chroma transformer (it has distilled_guidance_layer), which architecture "flux" '
            'does not train; use architecture = "chroma".'
        )


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKL:
    """Load the FLUX.1 VAE from a diffusers folder or a single file (`ae.safetensors`), in eval mode."""
    return load_component(path, dtype, "AutoencoderKL", "vae", VAE_SPEC, ldm_vae_to_diffusers)


class TextEncoders(NamedTuple):
    """FLUX.1's two text encoders and their tokenizers, in eval mode."""

    clip: CLIPTextModel
    clip_tokenizer: PreTrainedTokenizerBase
    t5: T5EncoderModel
    t5_tokenizer: PreTrainedTokenizerBase


def load_text_encoders(
    clip_path: str | Path,
    t5_path: str | Path | None,
    clip_tokenizer: str | Path | None,
    t5_tokenizer: str | Path | None,
    dtype: torch.dtype,
) -> TextEncoders:
    """Load CLIP-L and the T5-XXL encoder with their tokenizers.

    `t5_path` may be None when `clip_path` is a diffusers pipeline root (its `text_encoder_2/` is used);
    tokenizer paths may be None for diffusers folders (the sibling `tokenizer/`, `tokenizer_2/`).
    """
    if t5_path is None:
        t5_path = second_text_encoder(clip_path, "FLUX.1", "T5-XXL", "t5xxl_fp16.safetensors")
    clip, found = load_clip(clip_path, dtype)
    t5, found_2 = load_t5(t5_path, dtype)
    return TextEncoders(
        clip,
        load_tokenizer(clip_tokenizer or found, clip_path, "CLIP (the tokenizer/ folder of FLUX.1)"),
        t5,
        load_tokenizer(t5_tokenizer or found_2, t5_path, "T5 (the tokenizer_2/ folder of FLUX.1)"),
    )


def load_clip(path: str | Path, dtype: torch.dtype) -> tuple[CLIPTextModel, Path | None]:
    """The CLIP text model, and the tokenizer folder beside it in a diffusers layout (else None)."""
    from transformers import CLIPTextModel

    folders = ("text_encoder", "tokenizer")
    return load_clip_encoder(path, dtype, CLIPTextModel, folders, CLIP_SPEC, clip_text_entries)


def load_t5(
    path: str | Path, dtype: torch.dtype, subfolder: str = "text_encoder_2", tokenizer: str = "tokenizer_2"
) -> tuple[T5EncoderModel, Path | None]:
    """The T5 encoder, and the tokenizer folder beside it in a diffusers layout (else None).

    `subfolder` / `tokenizer` name the pipeline's folders (FLUX.1: `text_encoder_2/`, `tokenizer_2/`;
    Chroma, whose only encoder is T5: `text_encoder/`, `tokenizer/`)."""
    from transformers import T5EncoderModel

    return load_encoder(path, dtype, T5EncoderModel, "t5", (subfolder, tokenizer), T5_SPEC)


# ---------------------------------------------------------------------------------------------------
# Inputs for the transformer
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_prompts(
    encoders: TextEncoders, captions: list[str], max_length: int = 512
) -> list[dict[str, torch.Tensor]]:
    """Per caption {"t5": [max_length, D_t5], "pooled": [D_clip]}, as FluxPipeline computes them.

    CLIP: tokens padded to its 77 positions, the pooled output (at the end token). T5: tokens padded to
    `max_length` (FluxPipeline's `max_sequence_length`, 512 for FLUX.1-dev) and run without an attention
    mask, so every row, padding included, is a function of the prompt; all are kept.
    """
    clip, clip_tokenizer, t5, t5_tokenizer = encoders
    clip_ids = clip_tokenizer(
        captions, padding="max_length", max_length=clip_tokenizer.model_max_length, truncation=True,
        return_tensors="pt",
    ).input_ids  # fmt: skip
    pooled = clip(clip_ids.to(clip.device), output_hidden_states=False).pooler_output
    t5_ids = t5_tokenizer(
        captions, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    ).input_ids
    hidden = t5(t5_ids.to(t5.device), output_hidden_states=False).last_hidden_state
    return [{"t5": h, "pooled": p} for h, p in zip(hidden, pooled)]


@torch.no_grad()
def encode_images(vae: AutoencoderKL, pixels: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, 16, H/8, W/8] of images [B, 3, H, W] in [-1, 1]: the distribution's mode,
    then (z − shift_factor) · scaling_factor, as the pipelines encode reference images."""
    if pixels.shape[-1] % 8 or pixels.shape[-2] % 8:
        raise ValueError(f"the FLUX.1 VAE needs sides divisible by 8, got {tuple(pixels.shape)}")
    param = next(vae.parameters())
    latents = vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode()
    return (latents - vae.config.shift_factor) * vae.config.scaling_factor


@torch.no_grad()
def decode_latents(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in about [-1, 1] from normalized latents (the inverse of `encode_images`)."""
    param = next(vae.parameters())
    latents = latents.to(param.device, param.dtype)
    return vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] → [B, H/2 · W/2, C · 4]: one token per 2×2 patch, rows first; a token's features
    are channel-major (c, dy, dx), the order of FLUX's `img_in`."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_latents`, for latents of `height` × `width`."""
    b, _, features = tokens.shape
    patches = tokens.reshape(b, height // 2, width // 2, features // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, features // 4, height, width)


def image_ids(height: int, width: int, index: int = 0, device: torch.device | None = None) -> torch.Tensor:
    """Position ids [H/2 · W/2, 3] of the tokens of a [.., height, width] latent: (index, row, col).
    The target image has index 0; Kontext's reference image has index 1 at the same rows and cols."""
    rows = torch.arange(height // 2, device=device).repeat_interleave(width // 2)
    cols = torch.arange(width // 2, device=device).repeat(height // 2)
    return torch.stack([torch.full_like(rows, index), rows, cols], dim=1).float()


def predict_velocity(
    model: FluxTransformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    t5: torch.Tensor,
    pooled: torch.Tensor,
    guidance: float,
    references: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """The model's velocity for latents `noisy` [B, 16, H, W] at t ∈ [0, 1] (shape of `noisy`).

    `references` are Kontext's reference latents [B, 16, H', W']: their tokens follow the target's in
    the sequence (ids index 1) and their outputs are dropped. `guidance` feeds the guidance embedding
    of guidance-distilled models (ignored by models without one).
    """
    inputs = model_inputs(model, noisy, t, t5, pooled, guidance, references)
    return velocity(model(**inputs, return_dict=False)[0], noisy)


def model_inputs(
    model: FluxTransformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    t5: torch.Tensor,
    pooled: torch.Tensor,
    guidance: float,
    references: tuple[torch.Tensor, ...] = (),
) -> dict[str, torch.Tensor]:
    """The transformer's keyword arguments for `predict_velocity` (packed tokens, their ids, text)."""
    b, _, h, w = noisy.shape
    tokens, ids = [pack_latents(noisy)], [image_ids(h, w, 0, noisy.device)]
    for ref in references:
        tokens.append(pack_latents(ref.to(noisy.dtype)))
        ids.append(image_ids(ref.shape[-2], ref.shape[-1], 1, noisy.device))
    embedded_guidance = None
    if model.config.guidance_embeds:
        embedded_guidance = torch.full((b,), guidance, device=noisy.device, dtype=torch.float32)
    return {
        "hidden_states": torch.cat(tokens, dim=1),
        "timestep": t,
        "guidance": embedded_guidance,
        "pooled_projections": pooled.to(noisy.dtype),
        "encoder_hidden_states": t5.to(noisy.dtype),
        "txt_ids": torch.zeros(t5.shape[1], 3, device=noisy.device),
        "img_ids": torch.cat(ids),
    }


def velocity(out: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """The transformer's output tokens → the velocity of the target latents (reference tokens dropped)."""
    h, w = noisy.shape[-2:]
    return unpack_latents(out[:, : (h // 2) * (w // 2)], h, w)


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# FluxTransformer2DModel.forward without ControlNet residuals or IP-Adapter inputs, which training never
# passes; tests/test_distributed_pipeline.py checks the parts against the whole forward.


def embed(model: FluxTransformer2DModel, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block on `model_inputs`' arguments: (image tokens, text tokens,
    conditioning embedding, rotary cos, rotary sin)."""
    hidden = model.x_embedder(inputs["hidden_states"])
    timestep = inputs["timestep"].to(hidden.dtype) * 1000
    pooled, guidance = inputs["pooled_projections"], inputs["guidance"]
    if guidance is None:
        temb = model.time_text_embed(timestep, pooled)
    else:
        temb = model.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, pooled)
    text = model.context_embedder(inputs["encoder_hidden_states"])
    cos, sin = model.pos_embed(torch.cat((inputs["txt_ids"], inputs["img_ids"]), dim=0))
    return hidden, text, temb, cos, sin


def run_block(
    model: FluxTransformer2DModel, block: torch.nn.Module, carried: tuple
) -> tuple[torch.Tensor, ...]:
    """One dual- or single-stream block (both take and return the text and image streams)."""
    from tuner.archs.stages import call_block

    hidden, text, temb, cos, sin = carried
    text, hidden = call_block(model, block, hidden, text, temb, (cos, sin))
    return hidden, text, temb, cos, sin


def project_out(model: FluxTransformer2DModel, carried: tuple) -> torch.Tensor:
    """The forward after its last block: the output tokens."""
    hidden, _, temb, _, _ = carried
    return model.proj_out(model.norm_out(hidden, temb))
