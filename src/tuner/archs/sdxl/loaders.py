"""SDXL (and its fine-tunes: Pony, Illustrious, NoobAI...): loading its four models, and its model inputs.

Each loader takes the layouts users have:

* the bundled single file of A1111 / ComfyUI / Forge (`sd_xl_base_1.0.safetensors` and every fine-tune
  shared as one file) holds all four models under prefixes: `model.diffusion_model.*` (the UNet, in the
  original `sgm` layout, see `tuner.archs.sdxl.keys`), `first_stage_model.*` (the VAE, LDM layout),
  `conditioner.embedders.0.transformer.*` (CLIP ViT-L, transformers' layout) and
  `conditioner.embedders.1.model.*` (OpenCLIP ViT-bigG). Point every `model.*` path at it;
* single component files: a UNet alone (with or without `model.diffusion_model.`), the SDXL VAE
  (`sdxl_vae.safetensors`, LDM layout; the fp16-fix VAE's diffusers-layout file), ComfyUI's
  `clip_l.safetensors` / `clip_g.safetensors` (transformers' layout);
* a diffusers folder (the pipeline root, or the `unet/`, `vae/`, `text_encoder/`, `text_encoder_2/`
  folders).
Single files carry no tokenizer: pass `model.tokenizer` (CLIP-L's) and `model.tokenizer_2` (bigG's).

Model inputs are what `StableDiffusionXLPipeline` computes: both encoders' penultimate hidden states
over 77 tokens, concatenated ([77, 768 + 1280]); bigG's projected pooled output ([1280]); and the
size conditioning `add_time_ids` = (original height, width, crop top, left, target height, width),
which training takes from each item's source size and crop (`time_ids` in the latent cache). Latents
are the VAE's mean times its scaling factor (0.13025), 4 channels at 1/8 of the pixels.

A Stable Diffusion 1.x / 2.x checkpoint (no `label_emb`, 768- or 1024-wide text context) is named as such,
and so is the SDXL refiner. A file carrying the `v_pred` marker key is a v-prediction model: training
it as epsilon warns (`timesteps.prediction = "v"`, usually with `zero_terminal_snr`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from tuner.archs.flux.keys import vae_key_to_original, vae_to_original
from tuner.archs.flux.loaders import ldm_vae_to_diffusers
from tuner.archs.sdxl.keys import (
    BUNDLED_CLIP_G,
    BUNDLED_CLIP_L,
    SDXLLayout,
    clip_g_to_diffusers,
    clip_g_to_original,
    unet_key_to_original,
    unet_to_diffusers,
)
from tuner.errors import CheckpointError
from tuner.models.component import diffusers_keys, load_component
from tuner.models.encoders import (
    clip_text_entries,
    clip_with_projection_entries,
    load_clip_encoder,
    model_keys,
)
from tuner.models.identify import UNCHECKED, SingleFileSpec, variant_table
from tuner.models.loading import beside, load_tensors, load_tokenizer, read_tensor_shapes

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, PreTrainedTokenizerBase

CONFIGS = Path(__file__).parent / "configs"

# Where each model sits in a bundled checkpoint.
UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_L_PREFIX, CLIP_G_PREFIX = BUNDLED_CLIP_L, BUNDLED_CLIP_G
V_PRED_MARKER = "v_pred"  # an empty tensor some v-prediction checkpoints carry (with `ztsnr`)

# ---------------------------------------------------------------------------------------------------
# Known variants (UNet and VAE signatures in original names; text encoders in transformers' names)
# ---------------------------------------------------------------------------------------------------
UNET_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("input_blocks.0.0.weight", "label_emb.0.0.weight",
     "input_blocks.8.1.transformer_blocks.{}.attn2.to_k.weight"),
    {
        # SDXL 1.0 base and its fine-tunes (Pony, Illustrious, NoobAI, ...)
        "sdxl": ((320, 4, 3, 3), (1280, 2816), (10, (1280, 2048))),
        # the test fixture (tuner.archs.sdxl.fixture): SDXL's block structure, widths 32-64
        "tiny": ((32, 4, 3, 3), (128, 160), (1, (64, 96))),
    },
)  # fmt: skip
VAE_VARIANTS = variant_table(
    CONFIGS / "vae",
    ("encoder.conv_in.weight", "decoder.conv_in.weight"),
    {
        # the SDXL VAE and the fp16-fix one (same shapes)
        "sdxl": ((128, 3, 3, 3), (512, 4, 3, 3)),
        "tiny": ((32, 3, 3, 3), (64, 4, 3, 3)),
    },
)  # fmt: skip
# Text encoders: embedding, then the layer past the last must be absent (12 / 32 layers, the fixtures' 2)
CLIP_L_VARIANTS = variant_table(
    CONFIGS / "clip_l",
    (
        "embeddings.token_embedding.weight",
        "encoder.layers.12.mlp.fc1.weight",
        "encoder.layers.2.mlp.fc1.weight",
    ),
    {"clip-l": ((49408, 768), None, UNCHECKED), "tiny": ((1088, 32), UNCHECKED, None)},
)
CLIP_G_VARIANTS = variant_table(
    CONFIGS / "clip_g",
    ("text_model.embeddings.token_embedding.weight", "text_projection.weight",
     "text_model.encoder.layers.32.mlp.fc1.weight", "text_model.encoder.layers.2.mlp.fc1.weight"),
    {"bigg": ((49408, 1280), (1280, 1280), None, UNCHECKED), "tiny": ((1088, 64), (64, 64), UNCHECKED, None)},
)  # fmt: skip

_UNET_MARKERS = ("input_blocks.0.0.weight", "out.2.weight")
_VAE_MARKERS = ("encoder.down.0.block.0.conv1.weight", "decoder.up.0.block.0.conv1.weight")
_VAE_DIFFUSERS_MARKERS = (
    "encoder.down_blocks.0.resnets.0.conv1.weight",
    "decoder.up_blocks.0.resnets.0.conv1.weight",
)
_OPEN_CLIP_MARKERS = ("token_embedding.weight", "transformer.resblocks.0.attn.in_proj_weight")


def check_not_sd1_or_sd2(shapes: Mapping[str, tuple[int, ...]], path: Path) -> None:
    """Name a Stable Diffusion 1.x / 2.x checkpoint or the SDXL refiner given as SDXL."""
    context = shapes.get("input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight")
    if "label_emb.0.0.weight" not in shapes and "input_blocks.0.0.weight" in shapes:
        family = {768: "Stable Diffusion 1.x", 1024: "Stable Diffusion 2.x"}.get(context[1] if context else 0)
        raise CheckpointError(
            f"{path}: a {family or 'Stable Diffusion 1.x / 2.x'} checkpoint (no SDXL size conditioning"
            f"{f', {context[1]}-wide text context' if context else ''}), not SDXL. tuner does not train SD "
            "1.x / 2.x; use an SDXL checkpoint (base 1.0 or a fine-tune such as Pony or Illustrious)."
        )
    if shapes.get("input_blocks.0.0.weight", (0,))[0] == 384:
        raise CheckpointError(
            f"{path}: the SDXL refiner, which tuner does not train; use an SDXL base model."
        )


_unet_keys = diffusers_keys("UNet2DConditionModel", unet_key_to_original)


_vae_keys = diffusers_keys("AutoencoderKL", vae_key_to_original)


UNET_SPEC = SingleFileSpec("SDXL UNet", UNET_VARIANTS, _unet_keys, _UNET_MARKERS, refuse=check_not_sd1_or_sd2)
VAE_SPEC = SingleFileSpec("SDXL VAE", VAE_VARIANTS, _vae_keys, _VAE_MARKERS, _VAE_DIFFUSERS_MARKERS,
                          vae_key_to_original)  # fmt: skip
# CLIP files are identified in transformers' names (`_clip_g_entries` converts OpenCLIP's)
CLIP_L_SPEC = SingleFileSpec("CLIP ViT-L text encoder", CLIP_L_VARIANTS, model_keys("CLIPTextModel"),
                             (next(iter(CLIP_L_VARIANTS[0].signature)),))  # fmt: skip
CLIP_G_SPEC = SingleFileSpec("OpenCLIP ViT-bigG text encoder", CLIP_G_VARIANTS,
                             model_keys("CLIPTextModelWithProjection"), (next(iter(CLIP_G_VARIANTS[0].signature)),))  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Single files: one component of a bundled checkpoint, or a file of its own
# ---------------------------------------------------------------------------------------------------


def is_v_prediction(path: str | Path) -> bool:
    """Whether a single file carries the `v_pred` marker key (diffusers folders do not say)."""
    path = Path(path)
    return path.is_file() and V_PRED_MARKER in read_tensor_shapes(path)


def load_unet(path: str | Path, dtype: torch.dtype) -> UNet2DConditionModel:
    """Load the SDXL UNet from a diffusers folder or a single file (bundled or alone), in eval mode."""
    to_diffusers, bundled = lambda sd, _: unet_to_diffusers(sd), (UNET_PREFIX, "diffusion_model.")
    return load_component(
        path, dtype, "UNet2DConditionModel", "unet", UNET_SPEC, to_diffusers, bundled=bundled
    )


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKL:
    """Load the SDXL VAE from a diffusers folder or a single file (bundled, LDM or diffusers layout)."""
    to_diffusers = ldm_vae_to_diffusers  # FLUX.1's layout
    return load_component(path, dtype, "AutoencoderKL", "vae", VAE_SPEC, to_diffusers, bundled=(VAE_PREFIX,))


class TextEncoders(NamedTuple):
    """SDXL's two text encoders and their tokenizers, in eval mode."""

    clip_l: CLIPTextModel
    tokenizer: PreTrainedTokenizerBase
    clip_g: CLIPTextModelWithProjection
    tokenizer_2: PreTrainedTokenizerBase


def load_text_encoders(
    path: str | Path,
    path_2: str | Path | None,
    tokenizer: str | Path | None,
    tokenizer_2: str | Path | None,
    dtype: torch.dtype,
) -> TextEncoders:
    """CLIP-L from `path` and bigG from `path_2` (None: the same bundled file or diffusers root)."""
    clip_l, clip_g = load_clip_l(path, dtype), load_clip_g(path_2 or path, dtype)
    tokenizer_l, tokenizer_g = load_tokenizers(path, path_2, tokenizer, tokenizer_2)
    return TextEncoders(clip_l, tokenizer_l, clip_g, tokenizer_g)


def load_tokenizers(path: str | Path, path_2: str | Path | None, tokenizer: str | Path | None,
                    tokenizer_2: str | Path | None) -> tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase]:  # fmt: skip
    """Both tokenizers alone (what text-encoder training caches with): given, or beside the encoders'
    folders in a diffusers layout."""
    path_2 = path_2 or path
    found = [beside(p, sub, name) for p, sub, name in ((path, "text_encoder", "tokenizer"),
                                                                  (path_2, "text_encoder_2", "tokenizer_2"))]  # fmt: skip
    return (
        load_tokenizer(tokenizer or found[0], path, "CLIP ViT-L tokenizer (the tokenizer/ folder of SDXL)"),
        load_tokenizer(tokenizer_2 or found[1], path_2, "OpenCLIP bigG tokenizer (the tokenizer_2/ folder of SDXL)"),
    )  # fmt: skip


def load_clip_l(path: str | Path, dtype: torch.dtype) -> CLIPTextModel:
    """CLIP ViT-L from a diffusers folder or a single file (bundled, or ComfyUI's `clip_l.safetensors`)."""
    from transformers import CLIPTextModel

    folders = ("text_encoder", "tokenizer")
    return load_clip_encoder(path, dtype, CLIPTextModel, folders, CLIP_L_SPEC, clip_text_entries,
                             (CLIP_L_PREFIX,))[0]  # fmt: skip


def load_clip_g(path: str | Path, dtype: torch.dtype) -> CLIPTextModelWithProjection:
    """OpenCLIP ViT-bigG from a diffusers folder or a single file (bundled in OpenCLIP's layout, or
    ComfyUI's `clip_g.safetensors` in transformers')."""
    from transformers import CLIPTextModelWithProjection

    folders = ("text_encoder_2", "tokenizer_2")
    return load_clip_encoder(path, dtype, CLIPTextModelWithProjection, folders, CLIP_G_SPEC, _clip_g_entries,
                             (CLIP_G_PREFIX,))[0]  # fmt: skip


def _clip_g_entries(entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bigG's entries under CLIPTextModelWithProjection's names, from OpenCLIP's layout or transformers'."""
    if all(k in entries for k in _OPEN_CLIP_MARKERS):
        return clip_g_to_diffusers(entries)
    return clip_with_projection_entries(entries)


def warn_if_v_prediction(path: str | Path, prediction: str) -> None:
    """Warn when a file marked as v-prediction is trained as epsilon."""
    if prediction != "v" and is_v_prediction(path):
        warnings.warn(
            f"{path} carries the '{V_PRED_MARKER}' key: it is a v-prediction model, trained here as epsilon. "
            'Set timesteps.prediction = "v" (and usually timesteps.zero_terminal_snr = true).',
            stacklevel=2,
        )


# ---------------------------------------------------------------------------------------------------
# Inputs for the UNet
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_prompts(encoders: TextEncoders, captions: list[str]) -> list[dict[str, torch.Tensor]]:
    """Per caption {"hidden": [77, D_l + D_g], "pooled": [D_g]}, as StableDiffusionXLPipeline computes
    them: each encoder's penultimate hidden states over its tokens padded to 77, concatenated, and
    bigG's projected pooled output."""
    ids = token_ids(encoders.tokenizer, encoders.tokenizer_2, captions)
    hidden, pooled = encode_ids(encoders.clip_l, encoders.clip_g, ids["ids_l"], ids["ids_g"])
    return [{"hidden": h, "pooled": p} for h, p in zip(hidden, pooled)]


def token_ids(tokenizer: PreTrainedTokenizerBase, tokenizer_2: PreTrainedTokenizerBase,
              captions: list[str]) -> dict[str, torch.Tensor]:  # fmt: skip
    """Both encoders' token ids of `captions` ({"ids_l", "ids_g"}: [B, 77]), padded and truncated to 77."""
    return {
        name: tok(captions, padding="max_length", max_length=tok.model_max_length, truncation=True,
                  return_tensors="pt").input_ids
        for name, tok in (("ids_l", tokenizer), ("ids_g", tokenizer_2))
    }  # fmt: skip


def encode_ids(
    clip_l: CLIPTextModel, clip_g: CLIPTextModelWithProjection, ids_l: torch.Tensor, ids_g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [B, 77, D_l + D_g], pooled [B, D_g]) of token ids: the penultimate hidden states of both
    encoders concatenated, and bigG's projected pooled output. Differentiable (text-encoder training)."""
    out_l = clip_l(ids_l.to(clip_l.device), output_hidden_states=True)
    out_g = clip_g(ids_g.to(clip_g.device), output_hidden_states=True)
    return torch.cat([out_l.hidden_states[-2], out_g.hidden_states[-2]], dim=-1), out_g[0]


class TextEncoderPair(torch.nn.Module):
    """Both text encoders under one module, named as their adapters are: `te1.text_model.*` (CLIP-L) and
    `te2.text_model.*` (bigG), the names of kohya's files. transformers 5's CLIPTextModel has no
    `text_model` level of its own (CLIPTextModelWithProjection has), so CLIP-L is held one level down."""

    def __init__(self, clip_l: CLIPTextModel, clip_g: CLIPTextModelWithProjection) -> None:
        super().__init__()
        if hasattr(clip_l, "text_model"):  # transformers 4
            self.te1 = clip_l
        else:
            self.te1 = torch.nn.Module()
            self.te1.text_model = clip_l
        self.te2 = clip_g
        self.encoders = (clip_l, clip_g)  # a tuple: not registered twice


def time_ids(
    original_hw: tuple[int, int], crop_top_left: tuple[int, int], target_hw: tuple[int, int]
) -> torch.Tensor:
    """SDXL's size conditioning [6]: original (h, w), crop (top, left), target (h, w)."""
    return torch.tensor([*original_hw, *crop_top_left, *target_hw], dtype=torch.float32)


@torch.no_grad()
def encode_images(vae: AutoencoderKL, pixels: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, 4, H/8, W/8] of images [B, 3, H, W] in [-1, 1]: mean · scaling_factor."""
    if pixels.shape[-1] % 8 or pixels.shape[-2] % 8:
        raise ValueError(f"the SDXL VAE needs sides divisible by 8, got {tuple(pixels.shape)}")
    param = next(vae.parameters())
    return vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode() * vae.config.scaling_factor


@torch.no_grad()
def decode_latents(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in about [-1, 1] from normalized latents."""
    param = next(vae.parameters())
    return vae.decode(latents.to(param.device, param.dtype) / vae.config.scaling_factor).sample


def predict(
    model: UNet2DConditionModel,
    noisy: torch.Tensor,
    level: torch.Tensor,
    hidden: torch.Tensor,
    pooled: torch.Tensor,
    size_ids: torch.Tensor,
) -> torch.Tensor:
    """The UNet's output (noise or velocity) for latents `noisy` [B, 4, H, W] at noise levels `level`
    (0..999, [B]) with text `hidden` [B, 77, D], `pooled` [B, D_g] and `size_ids` [B, 6]."""
    dtype = noisy.dtype
    return model(
        noisy,
        level,
        encoder_hidden_states=hidden.to(dtype),
        added_cond_kwargs={"text_embeds": pooled.to(dtype), "time_ids": size_ids.to(noisy.device, dtype)},
        return_dict=False,
    )[0]


# ---------------------------------------------------------------------------------------------------
# The bundled checkpoint a full fine-tune saves
# ---------------------------------------------------------------------------------------------------


def bundle_companions(vae: str | Path, text_encoder: str | Path, text_encoder_2: str | Path | None,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:  # fmt: skip
    """The VAE's and both text encoders' tensors as a bundled checkpoint holds them (prefixed, original
    layouts). A part that comes from a bundled file is copied from it byte for byte; one from a
    diffusers folder or a file of its own is converted (in `dtype`)."""
    text_encoder_2 = text_encoder_2 or text_encoder
    parts: list[tuple[str | Path, str, Callable[[], dict[str, torch.Tensor]]]] = [
        (vae, VAE_PREFIX, lambda: vae_to_original(load_vae(vae, dtype).state_dict())),
        (text_encoder, CLIP_L_PREFIX,
         lambda: {f"text_model.{k}": v for k, v in load_clip_l(text_encoder, dtype).state_dict().items()}),
        (text_encoder_2, CLIP_G_PREFIX, lambda: clip_g_to_original(load_clip_g(text_encoder_2, dtype).state_dict())),
    ]  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for path, prefix, convert in parts:
        if Path(path).is_file() and any(k.startswith(prefix) for k in read_tensor_shapes(path)):
            out |= {k: v for k, v in load_tensors(path).items() if k.startswith(prefix)}
        else:
            out |= {prefix + k: v.contiguous() for k, v in convert().items()}
    return out


@dataclass(frozen=True)
class BundledLayout(SDXLLayout):
    """The SDXL UNet layout for a full fine-tune's file: the UNet under `model.diffusion_model.` beside the
    VAE and both text encoders (`companions()`, e.g. `bundle_companions`), as A1111, Forge and ComfyUI's
    checkpoint loader read it. Adapter names and loading are the UNet layout's."""

    companions: Callable[[], Mapping[str, torch.Tensor]] | None = None

    def to_original(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        unet = {UNET_PREFIX + k: v for k, v in super().to_original(state_dict).items()}
        return unet | dict(self.companions() if self.companions else {})
