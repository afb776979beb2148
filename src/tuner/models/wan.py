"""Wan 2.1 text-to-video: loading its three models and turning captions and videos into model inputs.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder (`.../transformer` or the pipeline root), the official single file
  (`blocks.0.self_attn.q.weight`, `head.modulation`, ...; with or without ComfyUI's
  `model.diffusion_model.` prefix; ComfyUI's scaled-fp8 files are dequantized), or the official release
  folder (`config.json` of class `WanModel` next to `diffusion_pytorch_model*.safetensors` shards);
* VAE: a diffusers folder, or the original single file (`Wan2.1_VAE.pth`, ComfyUI's
  `wan_2.1_vae.safetensors`);
* text encoder: a diffusers folder, or ComfyUI's `umt5_xxl_*.safetensors`, which is the transformers
  T5 encoder layout (`shared.weight`, `encoder.block.0.layer.0.SelfAttention.q.weight`, ...) minus the
  tied `encoder.embed_tokens.weight`. A single file carries no tokenizer: pass `tokenizer_path`.

Single files are recognised from tensor shapes (`tuner.models.identify`; the configs ship in
`configs/wan/`). Wan 2.2 A14B experts have the 2.1 14B shapes and load as `t2v-14B`; other Wan 2.2
models are reported as unknown variants. Not supported: the official Wan T5 file
(`models_t5_umt5-xxl-enc-bf16.pth`, Wan's own module names) and sharded single files without a folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.errors import CheckpointError
from tuner.models.identify import (
    SingleFileSpec,
    Variant,
    apply_aliases,
    diffusers_meta_keys,
    identify_single_file,
)
from tuner.models.loading import (
    load_diffusers_folder,
    load_diffusers_single_file,
    load_tensors,
    load_tensors_of,
    load_tokenizer,
    normalize_state_dict,
    read_folder_config,
    resolve_folder,
)
from tuner.models.wan_keys import (
    diffusers_module_name,
    original_module_name,
    transformer_to_original,
    vae_key_to_original,
    vae_to_original,
)

# diffusers and transformers are imported where a model is built: importing them costs seconds (every
# diffusers model class, torch._dynamo), which a command that loads no model should not pay.
if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import PreTrainedTokenizerBase, UMT5EncoderModel

__all__ = [
    "TRANSFORMER_VARIANTS",
    "VAE_VARIANTS",
    "TEXT_ENCODER_VARIANTS",
    "load_transformer",
    "load_vae",
    "load_text_encoder",
    "encode_prompts",
    "encode_video",
    "decode_latents",
    "original_module_name",
    "diffusers_module_name",
    "transformer_to_original",
    "vae_to_original",
]

CONFIGS = Path(__file__).parent / "configs" / "wan"

# ---------------------------------------------------------------------------------------------------
# Known variants. Signatures use original-layout names; `None` means the tensor must be absent (it pins
# the number of blocks and tells text-to-video from image-to-video).
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = (
    Variant(
        "t2v-1.3B",
        CONFIGS / "transformer" / "t2v-1.3B",
        {
            "patch_embedding.weight": (1536, 16, 1, 2, 2),
            "text_embedding.0.weight": (1536, 4096),
            "blocks.29.ffn.0.weight": (8960, 1536),
            "blocks.30.ffn.0.weight": None,
            "blocks.0.cross_attn.k_img.weight": None,
        },
    ),
    Variant(
        "t2v-14B",
        CONFIGS / "transformer" / "t2v-14B",
        {
            "patch_embedding.weight": (5120, 16, 1, 2, 2),
            "text_embedding.0.weight": (5120, 4096),
            "blocks.39.ffn.0.weight": (13824, 5120),
            "blocks.40.ffn.0.weight": None,
            "blocks.0.cross_attn.k_img.weight": None,
        },
    ),
    Variant(
        "i2v-14B",
        CONFIGS / "transformer" / "i2v-14B",
        {
            "patch_embedding.weight": (5120, 36, 1, 2, 2),
            "text_embedding.0.weight": (5120, 4096),
            "blocks.39.ffn.0.weight": (13824, 5120),
            "blocks.40.ffn.0.weight": None,
            "blocks.0.cross_attn.k_img.weight": (5120, 5120),
            "img_emb.proj.1.weight": (1280, 1280),
            "img_emb.emb_pos": None,  # present only in first-last-frame models
        },
    ),
    Variant(  # the test fixture (tuner.fixtures.wan): 2 heads of 32, 2 blocks
        "tiny",
        CONFIGS / "transformer" / "tiny",
        {
            "patch_embedding.weight": (64, 16, 1, 2, 2),
            "text_embedding.0.weight": (64, 64),
            "blocks.1.ffn.0.weight": (128, 64),
            "blocks.2.ffn.0.weight": None,
            "blocks.0.cross_attn.k_img.weight": None,
        },
    ),
)

VAE_VARIANTS = (
    Variant(
        "wan2.1",
        CONFIGS / "vae" / "wan2.1",
        {"encoder.conv1.weight": (96, 3, 3, 3, 3), "decoder.conv1.weight": (384, 16, 3, 3, 3)},
    ),
    Variant(
        "tiny",
        CONFIGS / "vae" / "tiny",
        {"encoder.conv1.weight": (16, 3, 3, 3, 3), "decoder.conv1.weight": (64, 16, 3, 3, 3)},
    ),
)

TEXT_ENCODER_VARIANTS = (
    Variant(
        "umt5-xxl",
        CONFIGS / "text_encoder" / "umt5-xxl",
        {
            "shared.weight": (256384, 4096),
            "encoder.block.23.layer.1.DenseReluDense.wi_0.weight": (10240, 4096),
            "encoder.block.24.layer.1.DenseReluDense.wi_0.weight": None,
        },
    ),
    Variant(
        "tiny",
        CONFIGS / "text_encoder" / "tiny",
        {
            "shared.weight": (512, 64),
            "encoder.block.1.layer.1.DenseReluDense.wi_0.weight": (128, 64),
            "encoder.block.2.layer.1.DenseReluDense.wi_0.weight": None,
        },
    ),
)


# The encoder's embedding is tied to `shared`; ComfyUI's files store only `shared.weight`.
_TIED_EMBEDDING = {"encoder.embed_tokens.weight": "shared.weight"}


def _transformer_keys(variant: Variant) -> list[str]:
    from diffusers import WanTransformer3DModel

    return [original_module_name(k) for k in diffusers_meta_keys(WanTransformer3DModel, variant.config_dir)]


def _vae_keys(variant: Variant) -> list[str]:
    from diffusers import AutoencoderKLWan

    return [vae_key_to_original(k) for k in diffusers_meta_keys(AutoencoderKLWan, variant.config_dir)]


def _text_encoder_keys(variant: Variant) -> list[str]:
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        model = UMT5EncoderModel(UMT5Config.from_pretrained(variant.config_dir))
    return list(apply_aliases(model.state_dict(), _TIED_EMBEDDING))


TRANSFORMER_SPEC = SingleFileSpec(
    what="Wan 2.1 transformer",
    variants=TRANSFORMER_VARIANTS,
    expected_keys=_transformer_keys,
    original_markers=("head.modulation", "blocks.0.self_attn.q.weight"),
    diffusers_markers=("scale_shift_table", "blocks.0.attn1.to_q.weight"),
    to_original=original_module_name,
)
VAE_SPEC = SingleFileSpec(
    what="Wan 2.1 VAE",
    variants=VAE_VARIANTS,
    expected_keys=_vae_keys,
    original_markers=("encoder.conv1.weight", "decoder.conv1.weight", "encoder.middle.1.to_qkv.weight"),
    diffusers_markers=("encoder.conv_in.weight", "decoder.conv_in.weight", "quant_conv.weight"),
    to_original=vae_key_to_original,
)
TEXT_ENCODER_SPEC = SingleFileSpec(
    what="UMT5 text encoder",
    variants=TEXT_ENCODER_VARIANTS,
    expected_keys=_text_encoder_keys,
    original_markers=("shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight"),
    aliases=_TIED_EMBEDDING,
)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype) -> WanTransformer3DModel:
    """Load the Wan 2.1 transformer from a diffusers folder or a single file, in eval mode."""
    from diffusers import WanTransformer3DModel

    folder = resolve_folder(path, "transformer")
    if folder is None:
        files = [Path(path)]
    elif read_folder_config(folder).get("_class_name") == "WanModel":
        # The official release folder (Wan-AI/Wan2.1-T2V-*): original keys, sharded for 14B.
        files = sorted(folder.glob("diffusion_pytorch_model*.safetensors"))
    else:
        return load_diffusers_folder(WanTransformer3DModel, folder, dtype, "WanTransformer3DModel")
    variant = identify_single_file(files, TRANSFORMER_SPEC)
    state_dict = normalize_state_dict(load_tensors_of(files), dtype)
    return load_diffusers_single_file(
        WanTransformer3DModel, state_dict, variant.config_dir, dtype, files[0] if folder is None else folder
    )


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKLWan:
    """Load the Wan 2.1 VAE from a diffusers folder or an original single file (.safetensors or .pth)."""
    from diffusers import AutoencoderKLWan

    folder = resolve_folder(path, "vae")
    if folder is not None:
        return load_diffusers_folder(AutoencoderKLWan, folder, dtype, "AutoencoderKLWan")
    variant = identify_single_file(path, VAE_SPEC)
    state_dict = normalize_state_dict(load_tensors(path), dtype)
    return load_diffusers_single_file(AutoencoderKLWan, state_dict, variant.config_dir, dtype, Path(path))


def load_text_encoder(
    path: str | Path, tokenizer_path: str | Path | None, dtype: torch.dtype
) -> tuple[UMT5EncoderModel, PreTrainedTokenizerBase]:
    """Load the UMT5 encoder and its tokenizer, in eval mode.

    `tokenizer_path` may be None when `path` is a diffusers pipeline root or its `text_encoder` folder
    (the sibling `tokenizer/` folder is used); a single file needs it.
    """
    from transformers import UMT5Config, UMT5EncoderModel

    folder = resolve_folder(path, "text_encoder")
    if folder is not None:
        if read_folder_config(folder).get("model_type") != "umt5":
            raise CheckpointError(
                f"{folder}: config.json does not describe a UMT5 encoder (model_type 'umt5')."
            )
        try:
            model = UMT5EncoderModel.from_pretrained(folder, dtype=dtype, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{folder}: cannot be loaded as a UMT5 encoder: {e}") from None
        if tokenizer_path is None and (folder.parent / "tokenizer").is_dir():
            tokenizer_path = folder.parent / "tokenizer"
    else:
        variant = identify_single_file(path, TEXT_ENCODER_SPEC)
        state_dict = apply_aliases(normalize_state_dict(load_tensors(path), dtype), _TIED_EMBEDDING)
        config = UMT5Config.from_pretrained(variant.config_dir)
        model = UMT5EncoderModel.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype)
    what = "UMT5 tokenizer (the tokenizer/ folder of a Wan 2.1 diffusers release, or google/umt5-xxl)"
    return model.eval(), load_tokenizer(tokenizer_path, path, what)


# ---------------------------------------------------------------------------------------------------
# Inputs for the transformer
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_prompts(
    text_encoder: UMT5EncoderModel,
    tokenizer: PreTrainedTokenizerBase,
    captions: list[str],
    max_length: int = 512,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """UMT5 embeddings of each caption at its true token length (with `</s>`): one [L, D] tensor each.

    Tokens are padded to `max_length` and masked, as WanPipeline does, so the kept rows are the ones the
    pipeline computes. The official model and WanPipeline feed the transformer these rows followed by
    zeros up to 512 tokens; whoever batches them must pad the same way. Whitespace is collapsed first,
    as in both (diffusers additionally runs ftfy and html unescaping, which is left out here).
    """
    device = torch.device(device) if device is not None else text_encoder.device
    tokens = tokenizer(
        [" ".join(c.split()) for c in captions],
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mask = tokens.attention_mask.to(device)
    hidden = text_encoder(tokens.input_ids.to(device), attention_mask=mask).last_hidden_state
    return [h[:n] for h, n in zip(hidden, mask.sum(dim=1).tolist())]


def _latent_stats(vae: AutoencoderKLWan, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, 1/std) of the latent channels, shaped to broadcast over [B, C, F, H, W]."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, inv_std


@torch.no_grad()
def encode_video(vae: AutoencoderKLWan, pixels: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, 16, 1 + (F-1)/4, H/8, W/8] of videos [B, 3, F, H, W] in [-1, 1].

    Uses the mean of the latent distribution (`latent_dist.mode()`; no sampling, so caching is
    deterministic) and normalizes per channel with the VAE config's `latents_mean` / `latents_std`, the
    statistics WanPipeline undoes before decoding.
    """
    frames, height, width = pixels.shape[2:]
    if (frames - 1) % 4 or height % 8 or width % 8:
        raise ValueError(f"Wan VAE needs 1 + 4k frames and sides divisible by 8, got {tuple(pixels.shape)}")
    param = next(vae.parameters())
    latents = vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode()
    mean, inv_std = _latent_stats(vae, latents)
    return (latents - mean) * inv_std


@torch.no_grad()
def decode_latents(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """Videos [B, 3, F, H, W] in about [-1, 1] from normalized latents (the inverse of `encode_video`)."""
    param = next(vae.parameters())
    latents = latents.to(param.device, param.dtype)
    mean, inv_std = _latent_stats(vae, latents)
    return vae.decode(latents / inv_std + mean).sample
