"""Stable Diffusion 3.5 (Medium, Large, Large Turbo): loading its five models and building model inputs.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder, or Stability AI's single file (`sd3.5_medium.safetensors`,
  `sd3.5_large.safetensors`, `sd3.5_large_turbo.safetensors`: `joint_blocks.0.x_block.attn.qkv.weight`,
  ...; with or without ComfyUI's `model.diffusion_model.` prefix; fp8 files are dequantized), converted
  by tuner's own `sd3_keys`. Medium (24 blocks of 1536, an extra image self-attention `attn2` in blocks
  0-12) and Large (38 blocks of 2432; Turbo is the same network) are told apart by shapes. An SD 3.0
  Medium file is refused by name (it lacks the q/k norms);
* VAE: a diffusers folder, or the LDM autoencoder layout (16 latent channels; the release's single file
  bundles it as `first_stage_model.*`, so `model.vae` may name that file). SD3's VAE has FLUX's shapes,
  so the two are not told apart: the shipped config gives SD3's scaling and shift factors;
* CLIP-L and OpenCLIP bigG (`CLIPTextModelWithProjection`): diffusers folders, ComfyUI's `clip_l.safetensors`
  / `clip_g.safetensors` (`text_model.*`), or a file bundling `text_encoders.clip_l.transformer.*` /
  `text_encoders.clip_g.transformer.*`. From single files CLIP-L's projection is the identity: SD3 uses
  its pooled output unprojected (diffusers' converter sets the same), and a file's own projection is
  ignored;
* T5-XXL (optional): a diffusers folder, ComfyUI's `t5xxl_*.safetensors`, or `text_encoders.t5xxl.*`.
Single text-encoder files carry no tokenizer: pass the tokenizer folders.

Model inputs are what StableDiffusion3Pipeline computes: both CLIPs' penultimate hidden states over 77
tokens, concatenated (768 + 1280 features), zero-padded to T5's width and followed by T5's last hidden
state over the prompt padded to `max_length` tokens (zeros of that shape without T5); the pooled
outputs concatenated (2048); latents (z − shift_factor) · scaling_factor; the timestep t · 1000.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from tuner.archs.flux import loaders as flux
from tuner.archs.flux.keys import vae_key_to_original
from tuner.archs.sd3.keys import transformer_key_to_original, transformer_to_diffusers
from tuner.errors import CheckpointError
from tuner.models.component import component_spec, diffusers_keys, load_component
from tuner.models.encoders import (
    T5_COLUMNS,
    clip_with_projection_entries,
    load_clip_encoder,
    load_encoder,
    model_keys,
)
from tuner.models.identify import SingleFileSpec, Variant, variant_table
from tuner.models.loading import load_tokenizer, read_tensor_shapes, resolve_folder

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerBase, T5EncoderModel

logger = logging.getLogger(__name__)
CONFIGS = Path(__file__).parent / "configs"
T = TypeVar("T")

# Where the release's single file bundles each component (diffusers' SD3 converter reads the same).
VAE_PREFIX = "first_stage_model."
CLIP_L_PREFIX = "text_encoders.clip_l.transformer."
CLIP_G_PREFIX = "text_encoders.clip_g.transformer."
T5_PREFIX = "text_encoders.t5xxl.transformer."

# ---------------------------------------------------------------------------------------------------
# Known variants. Signatures use the release's names; `None` means the tensor must be absent.
# ---------------------------------------------------------------------------------------------------


def _mmdit(name: str, dim: int, blocks: int, positions: int, dual: int | None, head: int = 64) -> Variant:
    """An MMDiT signature: width, block count, position table, and the last block with `attn2` (None:
    no `attn2` at all)."""
    signature: dict[str, tuple[int, ...] | None] = {
        "x_embedder.proj.weight": (dim, 16, 2, 2),
        "pos_embed": (1, positions, dim),
        f"joint_blocks.{blocks - 1}.x_block.mlp.fc1.weight": (4 * dim, dim),
        f"joint_blocks.{blocks}.x_block.mlp.fc1.weight": None,
        "joint_blocks.0.x_block.attn.ln_q.weight": (head,),
    }
    if dual is None:
        signature["joint_blocks.0.x_block.attn2.proj.weight"] = None
    else:  # (not the fused qkv: a diffusers-layout file names its parts, each a third of its rows)
        signature[f"joint_blocks.{dual}.x_block.attn2.proj.weight"] = (dim, dim)
        signature[f"joint_blocks.{dual + 1}.x_block.attn2.proj.weight"] = None
    return Variant(name, CONFIGS / "transformer" / name, signature)


TRANSFORMER_VARIANTS = (
    _mmdit("large", 2432, 38, 192**2, None),  # SD 3.5 Large and Large Turbo
    _mmdit("medium", 1536, 24, 384**2, 12),  # SD 3.5 Medium (MMDiT-X)
    _mmdit("tiny", 64, 2, 32**2, 0, head=32),  # the test fixture (tuner.archs.sd3.fixture)
)

# SD 3.0 Medium: 3.5 Medium's width and depth, a smaller position table and no q/k norms. Not trained
# here (another model, other weights); recognised so that the error says what the file is.
SD30_MEDIUM = Variant(
    "sd3.0-medium",
    CONFIGS / "transformer" / "medium",  # unused: the variant is only recognised, never built
    {
        "x_embedder.proj.weight": (1536, 16, 2, 2),
        "pos_embed": (1, 192**2, 1536),
        "joint_blocks.0.x_block.attn.ln_q.weight": None,
    },
)


def _refuse_sd30(shapes: Mapping[str, tuple[int, ...]], path: Path) -> None:
    if not SD30_MEDIUM.mismatches(shapes):
        raise CheckpointError(
            f"{path}: this is Stable Diffusion 3.0 Medium (no q/k norms, a 192² position table), not a 3.5 "
            "release; architecture 'sd3' trains SD 3.5 Medium and Large. Use an sd3.5_*.safetensors file."
        )


# SD3's VAE has FLUX's shapes (only the latent scaling and shift differ).
VAE_VARIANTS = (
    Variant("sd3", CONFIGS / "vae" / "sd3", flux.VAE_VARIANTS[0].signature),
    Variant("tiny", CONFIGS / "vae" / "tiny", flux.VAE_VARIANTS[1].signature),
)


def _clip(folder: str, name: str, width: int, layers: int, vocab: int) -> Variant:
    return Variant(
        name,
        CONFIGS / folder / name,
        {
            "text_model.embeddings.token_embedding.weight": (vocab, width),
            f"text_model.encoder.layers.{layers - 1}.self_attn.q_proj.weight": (width, width),
            f"text_model.encoder.layers.{layers}.self_attn.q_proj.weight": None,
        },
    )


CLIP_L_VARIANTS = (_clip("clip_l", "clip-l", 768, 12, 49408), _clip("clip_l", "tiny", 32, 2, 1088))
CLIP_G_VARIANTS = (_clip("clip_g", "clip-g", 1280, 32, 49408), _clip("clip_g", "tiny", 64, 2, 1088))

T5_VARIANTS = (
    replace(flux.T5_VARIANTS[0], config_dir=CONFIGS / "t5" / "t5-xxl"),
    *variant_table(CONFIGS / "t5", T5_COLUMNS, {"tiny": ((512, 128), (2, (256, 128)))}),
)


_vae_keys = diffusers_keys("AutoencoderKL", vae_key_to_original)


_ORIGINAL_MARKERS = ("joint_blocks.0.x_block.attn.qkv.weight", "x_embedder.proj.weight")
_DIFFUSERS_MARKERS = ("transformer_blocks.0.attn.to_q.weight", "pos_embed.proj.weight")
TRANSFORMER_SPEC = component_spec(
    "SD 3.5 transformer", "SD3Transformer2DModel", TRANSFORMER_VARIANTS,
    _ORIGINAL_MARKERS, _DIFFUSERS_MARKERS, transformer_key_to_original, refuse=_refuse_sd30)  # fmt: skip
VAE_SPEC = replace(flux.VAE_SPEC, what="SD3 VAE", variants=VAE_VARIANTS, expected_keys=_vae_keys)
_CLIP_MARKERS = (
    "text_model.embeddings.token_embedding.weight",
    "text_model.encoder.layers.0.self_attn.q_proj.weight",
)
# CLIP-L files are read without a projection (SD3 uses the identity; see the module docstring)
_PROJECTION = "text_projection.weight"
CLIP_L_SPEC = SingleFileSpec(
    "CLIP-L text encoder",
    CLIP_L_VARIANTS,
    model_keys("CLIPTextModelWithProjection", (_PROJECTION,)),
    _CLIP_MARKERS,
)
CLIP_G_SPEC = SingleFileSpec(
    "OpenCLIP bigG text encoder", CLIP_G_VARIANTS, model_keys("CLIPTextModelWithProjection"), _CLIP_MARKERS
)
T5_SPEC = replace(flux.T5_SPEC, variants=T5_VARIANTS)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype) -> SD3Transformer2DModel:
    """Load the SD 3.5 transformer from a diffusers folder or a single file (either layout), in eval mode."""
    return load_component(path, dtype, "SD3Transformer2DModel", "transformer", TRANSFORMER_SPEC,
                          lambda sd, _: transformer_to_diffusers(sd), bundled=("model.diffusion_model.",),
                          entries=_without_bundled)  # fmt: skip


def _without_bundled(entries: Mapping[str, T]) -> dict[str, T]:
    """The transformer's own entries of a file without ComfyUI's prefix that bundles other components."""
    bundles = (VAE_PREFIX, "text_encoders.")
    return {k: v for k, v in entries.items() if not k.startswith(bundles)}


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKL:
    """Load the SD3 VAE from a diffusers folder, an LDM-layout file or the release's bundling single file."""
    spec, to_diffusers = VAE_SPEC, flux.ldm_vae_to_diffusers  # the same LDM layout
    return load_component(path, dtype, "AutoencoderKL", "vae", spec, to_diffusers, bundled=(VAE_PREFIX,))


class TextEncoders(NamedTuple):
    """SD3's text encoders and their tokenizers, in eval mode; T5 may be absent (None)."""

    clip_l: CLIPTextModelWithProjection
    tokenizer: PreTrainedTokenizerBase
    clip_g: CLIPTextModelWithProjection
    tokenizer_2: PreTrainedTokenizerBase
    t5: T5EncoderModel | None
    tokenizer_3: PreTrainedTokenizerBase | None


def load_text_encoders(
    paths: tuple[str | Path, str | Path | None, str | Path | None],
    tokenizers: tuple[str | Path | None, str | Path | None, str | Path | None],
    dtype: torch.dtype,
) -> TextEncoders:
    """Load CLIP-L, OpenCLIP bigG and (when its path is given) T5-XXL with their tokenizers.

    `paths` = (CLIP-L, bigG, T5). bigG may be None when CLIP-L's path is a diffusers pipeline root or
    folder (its sibling `text_encoder_2/` is used) or the release's file bundling both CLIPs (the same
    file). Tokenizer paths may be None for diffusers folders (the sibling `tokenizer*/` folders).
    """
    clip_l_path, clip_g_path, t5_path = paths
    if clip_g_path is None:
        clip_g_path = _beside(clip_l_path)
    clip_l, found = load_clip(clip_l_path, CLIP_L_SPEC, CLIP_L_PREFIX, "text_encoder", dtype)
    clip_g, found_2 = load_clip(clip_g_path, CLIP_G_SPEC, CLIP_G_PREFIX, "text_encoder_2", dtype)
    t5 = tokenizer_3 = None
    if t5_path is not None:
        t5, found_3 = _load_t5(t5_path, dtype)
        tokenizer_3 = load_tokenizer(
            tokenizers[2] or found_3, t5_path, "T5 (the tokenizer_3/ folder of SD 3.5)"
        )
    return TextEncoders(
        clip_l,
        load_tokenizer(tokenizers[0] or found, clip_l_path, "CLIP-L (the tokenizer/ folder of SD 3.5)"),
        clip_g,
        load_tokenizer(
            tokenizers[1] or found_2, clip_g_path, "OpenCLIP bigG (the tokenizer_2/ folder of SD 3.5)"
        ),
        t5,
        tokenizer_3,
    )


def _beside(clip_l_path: str | Path) -> Path:
    """Where bigG is when only CLIP-L's path is given: beside it in a diffusers layout, or in the same file."""
    path = Path(clip_l_path)
    if path.is_file() and any(k.startswith(CLIP_G_PREFIX) for k in read_tensor_shapes(path)):
        return path
    folder = resolve_folder(path, "text_encoder")
    if folder is not None and (folder.parent / "text_encoder_2").is_dir():
        return folder.parent / "text_encoder_2"
    raise CheckpointError(
        f"{clip_l_path}: SD 3.5 needs a second CLIP (OpenCLIP bigG). Set model.text_encoder_2 to its single "
        "file (e.g. clip_g.safetensors) or diffusers folder, or point model.text_encoder at an SD 3.5 "
        "diffusers pipeline folder."
    )


def load_clip(
    path: str | Path, spec: SingleFileSpec, prefix: str, subfolder: str, dtype: torch.dtype
) -> tuple[CLIPTextModelWithProjection, Path | None]:
    """A CLIP text model with projection, and the tokenizer folder beside it in a diffusers layout."""
    from transformers import CLIPTextModelWithProjection

    folders = (subfolder, subfolder.replace("text_encoder", "tokenizer"))
    if spec is CLIP_L_SPEC:  # SD3 uses CLIP-L's pooled output unprojected (module docstring)
        entries, complete = _without_projection, _identity_projection
    else:
        entries, complete = clip_with_projection_entries, None
    return load_clip_encoder(
        path, dtype, CLIPTextModelWithProjection, folders, spec, entries, (prefix,), complete
    )


def _without_projection(entries: dict[str, T]) -> dict[str, T]:
    return {k: v for k, v in clip_with_projection_entries(entries).items() if k != _PROJECTION}


def _identity_projection(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    width = state_dict["text_model.final_layer_norm.weight"]
    return state_dict | {_PROJECTION: torch.eye(width.shape[0], dtype=width.dtype)}


def _load_t5(path: str | Path, dtype: torch.dtype) -> tuple[T5EncoderModel, Path | None]:
    """The T5 encoder, and the tokenizer folder beside it in a diffusers layout (else None)."""
    from transformers import T5EncoderModel

    folders = ("text_encoder_3", "tokenizer_3")
    return load_encoder(path, dtype, T5EncoderModel, "t5", folders, T5_SPEC, bundled=(T5_PREFIX,))


# ---------------------------------------------------------------------------------------------------
# Inputs for the transformer
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_prompts(
    encoders: TextEncoders, captions: list[str], max_length: int = 256
) -> list[dict[str, torch.Tensor]]:
    """Per caption {"clip": [77, D_L + D_G], "pooled": [D_L + D_G], "t5": [max_length, D_t5]} as
    StableDiffusion3Pipeline.encode_prompt computes them ("t5" left out without T5: `predict_velocity`
    puts the pipeline's zeros there). CLIP: tokens padded to 77, penultimate hidden states and the
    projected pooled output. T5: tokens padded to `max_length` (the pipeline's `max_sequence_length`,
    256 by default), last hidden state, no attention mask."""
    hidden, pooled = [], []
    for model, tokenizer in ((encoders.clip_l, encoders.tokenizer), (encoders.clip_g, encoders.tokenizer_2)):
        ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").input_ids  # fmt: skip
        out = model(ids.to(model.device), output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled.append(out.text_embeds)
    entries = [{"clip": h, "pooled": p} for h, p in zip(torch.cat(hidden, -1), torch.cat(pooled, -1))]
    if encoders.t5 is not None:
        ids = encoders.tokenizer_3(captions, padding="max_length", max_length=max_length, truncation=True,
                                   return_tensors="pt").input_ids  # fmt: skip
        t5 = encoders.t5(ids.to(encoders.t5.device)).last_hidden_state
        for entry, row in zip(entries, t5):
            entry["t5"] = row
    return entries


def model_inputs(
    model: SD3Transformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    clip: torch.Tensor,
    pooled: torch.Tensor,
    t5: torch.Tensor | None,
    max_length: int,
) -> dict[str, torch.Tensor]:
    """The transformer's keyword arguments for latents `noisy` [B, 16, H, W] at t ∈ [0, 1].

    `clip` [B, 77, D_L + D_G] is zero-padded to the T5 width and followed by `t5` [B, L, D_t5], or by
    zeros [B, max_length, joint_attention_dim] when there is no T5 (as the pipeline does)."""
    if t5 is None:
        t5 = noisy.new_zeros(noisy.shape[0], max_length, model.config.joint_attention_dim)
    t5 = t5.to(noisy.dtype)
    clip = torch.nn.functional.pad(clip.to(noisy.dtype), (0, t5.shape[-1] - clip.shape[-1]))
    return {
        "hidden_states": noisy,
        "timestep": t * 1000,
        "encoder_hidden_states": torch.cat([clip, t5], dim=1),
        "pooled_projections": pooled.to(noisy.dtype),
    }


def predict_velocity(model: SD3Transformer2DModel, noisy: torch.Tensor, t: torch.Tensor, clip: torch.Tensor,
                     pooled: torch.Tensor, t5: torch.Tensor | None, max_length: int) -> torch.Tensor:  # fmt: skip
    """The model's velocity (shape of `noisy`) on `model_inputs`."""
    return model(**model_inputs(model, noisy, t, clip, pooled, t5, max_length), return_dict=False)[0]


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# SD3Transformer2DModel.forward without ControlNet residuals, IP-Adapter inputs or skipped layers, which
# training never passes; the contract suite checks the parts against the whole forward.


def embed(model: SD3Transformer2DModel, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block: (image tokens with their positions, text tokens, the
    timestep-and-pooled-text embedding)."""
    hidden = model.pos_embed(inputs["hidden_states"]).contiguous()
    temb = model.time_text_embed(inputs["timestep"], inputs["pooled_projections"])
    return hidden, model.context_embedder(inputs["encoder_hidden_states"]), temb


def run_block(
    model: SD3Transformer2DModel, block: torch.nn.Module, carried: tuple
) -> tuple[torch.Tensor, ...]:
    """One joint block; the last (`context_pre_only`) returns no text stream, which nothing reads after it:
    its input text is carried on."""
    from tuner.archs.stages import call_block

    hidden, text, temb = carried
    new_text, hidden = call_block(model, block, hidden, text, temb, None)
    return hidden, text if new_text is None else new_text, temb


def project_out(model: SD3Transformer2DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last block: output norm, projection and unpatchify to `noisy`'s shape."""
    from tuner.archs.stages import unpatchify

    hidden, _, temb = carried
    tokens = model.proj_out(model.norm_out(hidden, temb))
    return unpatchify(tokens, *noisy.shape[-2:], model.config.patch_size)


encode_images = flux.encode_images  # the same 16-channel LDM VAE, normalized by its config's factors
decode_latents = flux.decode_latents
