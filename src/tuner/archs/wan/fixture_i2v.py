"""Tiny random-weight Wan 2.1 I2V and FLF2V models with a tiny CLIP vision encoder, in both layouts.

The transformers are the tiny Wan network (`tuner.archs.wan.fixture`) with 36 input channels and the image
cross-attention over a tiny CLIP (`configs/clip_vision/tiny`: 32×32 images in 8×8 patches, 17 tokens of
width 32, 2 layers); FLF2V adds the position embedding over two frames' tokens. VAE, UMT5 and tokenizer
are Wan 2.1's tiny ones.

    out_dir/
      diffusers/     what `WanImageToVideoPipeline.from_pretrained(out_dir/"diffusers")` loads:
                     transformer/ vae/ text_encoder/ tokenizer/ scheduler/ image_encoder/ image_processor/
                     (image_encoder/ holds `vision_model.*` keys, as the releases saved by transformers 4)
      single/        the official / ComfyUI single files
        wan2.1_i2v_tiny.safetensors (or wan2.1_flf2v_tiny)   official transformer keys (img_emb.*, k_img)
        clip_vision_h_tiny.safetensors   ComfyUI's clip_vision layout (vision_model.*, visual_projection)
        wan_2.1_vae.safetensors  umt5_tiny.safetensors  tokenizer/
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
from transformers import CLIPImageProcessorPil, CLIPVisionModel

from tuner.archs.wan.fixture import build_wan_components, wan21_files
from tuner.archs.wan.keys import transformer_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import vision_tower_file
from tuner.fixtures.weights import tiny_config, tiny_model
from tuner.io import save_safetensors
from tuner.models import clip_vision

CLIP_FILE = "clip_vision_h_tiny.safetensors"
_FILES = {"tiny-i2v": "wan2.1_i2v_tiny.safetensors", "tiny-flf2v": "wan2.1_flf2v_tiny.safetensors"}


def build_components(variant: str, seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32): `WanImageToVideoPipeline`'s arguments."""
    parts = build_wan_components(seed)
    clip_dir = next(v.config_dir for v in clip_vision.VARIANTS if v.name == "tiny")
    parts["transformer"] = tiny_model(
        WanTransformer3DModel, tiny_config("wan", "transformer", variant), seed + 4
    )
    parts["image_encoder"] = tiny_model(CLIPVisionModel, clip_dir, seed + 5)
    parts["image_processor"] = CLIPImageProcessorPil.from_pretrained(clip_dir, local_files_only=True)
    return parts


def write_fixture(out_dir: str | Path, seed: int = 0, variant: str = "tiny-i2v") -> dict[str, Path]:
    """Write the tiny I2V (or with `variant="tiny-flf2v"` FLF2V) model under `out_dir`; returns the paths.

    Keys: root, diffusers, transformer_file, image_encoder_file, vae_file, text_encoder_file, tokenizer.
    """
    parts = build_components(variant, seed)
    vision = vision_tower_file(parts["image_encoder"])

    def diffusers(folder: Path) -> None:
        WanImageToVideoPipeline(**parts).save_pretrained(folder, safe_serialization=True)
        save_safetensors(vision, folder / "image_encoder" / "model.safetensors")

    config = parts["image_encoder"].config
    unused = torch.randn(
        config.projection_dim, config.hidden_size, generator=torch.Generator().manual_seed(seed + 6)
    )
    single = {
        "transformer_file": (_FILES[variant], transformer_to_original(parts["transformer"].state_dict())),
        "image_encoder_file": (CLIP_FILE, {**vision, "visual_projection.weight": unused}),
    }
    return write_layouts(out_dir, variant, diffusers, single | wan21_files(parts), tokenizer_folders(parts))


def _model_section(architecture: str, transformer_file: str) -> str:
    # single files for the transformer and the CLIP encoder, the diffusers folder for the rest
    return model_section(
        architecture,
        transformer=transformer_file,
        image_encoder=CLIP_FILE,
        vae="diffusers",
        text_encoder="diffusers",
    )


I2V_FIXTURE = Fixture(write=write_fixture, model_section=_model_section("wan_i2v", _FILES["tiny-i2v"]))
FLF2V_FIXTURE = Fixture(
    write=partial(write_fixture, variant="tiny-flf2v"),
    model_section=_model_section("wan_flf2v", _FILES["tiny-flf2v"]),
)
ONE_FRAME_FIXTURE = Fixture(write=write_fixture, model_section=_model_section("wan_1f", _FILES["tiny-i2v"]))
