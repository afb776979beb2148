"""The Wan 2.2 VAE (TI2V-5B's), and telling it apart from Wan 2.1's.

It is diffusers' `AutoencoderKLWan` with `is_residual=True`: pixels are first folded 2×2 into 12
channels (`patch_size` 2), the encoder's levels add an averaging shortcut, and the latents have 48
channels at 16× spatial and 4× temporal compression (Wan 2.1's: 16 channels, 8×). Latents are
normalized per channel with the config's own `latents_mean` / `latents_std` (48 values each, the
release's), exactly as for 2.1, so `tuner.archs.wan.loaders.encode_video` / `decode_latents` serve both.

Layouts users have: a diffusers folder (`Wan-AI/Wan2.2-TI2V-5B-Diffusers/vae`), or the original single
file (`Wan2.2_VAE.pth`, ComfyUI's `wan2.2_vae.safetensors`), whose key names are the release's
(`tuner.archs.wan.keys.vae22_key_to_original`). diffusers' own single-file converter only knows the 2.1
layout, so the original file is renamed here and loaded into a model built from the shipped config.

A VAE is of generation "2.1" or "2.2" by its latent channels (16 or 48): `vae_generation` reads that
from a folder's config or a file's header, so a VAE of the wrong generation is refused by name before
anything is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.wan.keys import vae22_key_to_original
from tuner.errors import CheckpointError
from tuner.models.component import diffusers_keys
from tuner.models.identify import SingleFileSpec, Variant, identify_single_file
from tuner.models.loading import (
    assert_materialized,
    cast_like_from_pretrained_,
    load_diffusers_folder,
    load_tensors,
    normalize_shapes,
    normalize_state_dict,
    read_folder_config,
    read_shapes_of,
    resolve_folder,
)

# diffusers is imported where a model is built: importing it costs seconds (see tuner.archs.wan.loaders)
if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan

CONFIGS = Path(__file__).parent / "configs" / "vae"

VAE22_VARIANTS = (
    Variant(
        "wan2.2",
        CONFIGS / "wan2.2",
        {"encoder.conv1.weight": (160, 12, 3, 3, 3), "decoder.conv1.weight": (1024, 48, 3, 3, 3)},
    ),
    Variant(  # the test fixture (tuner.archs.wan.fixture_ti2v): base width 16, decoder width 32
        "tiny-2.2",
        CONFIGS / "tiny-2.2",
        {"encoder.conv1.weight": (16, 12, 3, 3, 3), "decoder.conv1.weight": (128, 48, 3, 3, 3)},
    ),
)


_vae22_keys = diffusers_keys("AutoencoderKLWan", vae22_key_to_original)


VAE22_SPEC = SingleFileSpec(
    what="Wan 2.2 VAE",
    variants=VAE22_VARIANTS,
    expected_keys=_vae22_keys,
    original_markers=(
        "decoder.upsamples.0.upsamples.0.residual.2.weight",
        "decoder.middle.0.residual.0.gamma",
    ),
    diffusers_markers=("decoder.up_blocks.0.resnets.0.conv1.weight", "post_quant_conv.weight"),
    to_original=vae22_key_to_original,
)

# Latent channels of each generation, and what its VAE files are called, for messages.
GENERATIONS = {
    "2.1": (16, "the Wan 2.1 VAE (Wan2.1_VAE.pth / ComfyUI's wan_2.1_vae.safetensors)"),
    "2.2": (48, "the Wan 2.2 VAE (Wan2.2_VAE.pth / ComfyUI's wan2.2_vae.safetensors)"),
}
# Which architectures use which generation (the Wan 2.2 A14B models use Wan 2.1's VAE).
_USED_BY = {"2.1": "wan, wan22_t2v", "2.2": "wan22_ti2v"}


def vae_generation(path: str | Path) -> str | None:
    """ "2.1" or "2.2" for a Wan VAE folder or file, from its config or header only; None when the
    latent channel count says neither (the loader then reports what the file is)."""
    folder = resolve_folder(path, "vae")
    if folder is not None:
        channels = read_folder_config(folder).get("z_dim", 16)
    else:
        shapes = normalize_shapes(read_shapes_of(path))
        conv = shapes.get("conv2.weight", shapes.get("post_quant_conv.weight"))
        if conv is None:
            return None
        channels = conv[0]
    return next((g for g, (c, _) in GENERATIONS.items() if c == channels), None)


def check_vae_generation(path: str | Path, generation: str, architecture: str) -> None:
    """CheckpointError naming the file and the VAE to use when `path` is a VAE of the other generation."""
    found = vae_generation(path)
    if found is None or found == generation:
        return
    channels, what = GENERATIONS[found]
    raise CheckpointError(
        f"{path}: this is {what}, with {channels}-channel latents, the VAE of {_USED_BY[found]}; "
        f"architecture {architecture!r} needs {GENERATIONS[generation][1]}. Set model.vae to it."
    )


def load_vae22(path: str | Path, dtype: torch.dtype) -> AutoencoderKLWan:
    """The Wan 2.2 VAE from a diffusers folder or an original single file (.safetensors or .pth)."""
    from diffusers import AutoencoderKLWan

    folder = resolve_folder(path, "vae")
    if folder is not None:
        return load_diffusers_folder(AutoencoderKLWan, folder, dtype, "AutoencoderKLWan")
    variant = identify_single_file(path, VAE22_SPEC)
    state_dict = normalize_state_dict(load_tensors(path), dtype)
    config = AutoencoderKLWan.load_config(variant.config_dir)
    with torch.device("meta"):
        model = AutoencoderKLWan.from_config(config)
    to_original = {vae22_key_to_original(k): k for k in model.state_dict()}
    # a diffusers-layout single file already has the model's names
    renamed = {to_original.get(k, k): v for k, v in state_dict.items()}
    try:
        model.load_state_dict(renamed, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: cannot be loaded as a Wan 2.2 VAE: {e}") from None
    assert_materialized(model, path)
    cast_like_from_pretrained_(model, dtype)
    return model.eval()
