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
from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

from tuner.archs.wan.fixture import VAE_FILE, build_wan_components, fixture_paths, write_single_files
from tuner.archs.wan.keys import transformer_to_original
from tuner.archs.wan.loaders import TRANSFORMER_VARIANTS
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors
from tuner.models import clip_vision

CLIP_FILE = "clip_vision_h_tiny.safetensors"
_FILES = {"tiny-i2v": "wan2.1_i2v_tiny.safetensors", "tiny-flf2v": "wan2.1_flf2v_tiny.safetensors"}


def _config_dir(name: str) -> Path:
    return next(v.config_dir for v in TRANSFORMER_VARIANTS if v.name == name)


def build_components(variant: str, seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32): `WanImageToVideoPipeline`'s arguments."""
    parts = build_wan_components(seed)
    clip_dir = next(v.config_dir for v in clip_vision.VARIANTS if v.name == "tiny")
    with torch.random.fork_rng(devices=[]):
        transformer = WanTransformer3DModel.from_config(
            WanTransformer3DModel.load_config(_config_dir(variant))
        )
        image_encoder = CLIPVisionModel(CLIPVisionConfig.from_pretrained(clip_dir))
    parts["transformer"] = fill_random_(transformer, seed + 4).eval()
    parts["image_encoder"] = fill_random_(image_encoder, seed + 5).eval()
    parts["image_processor"] = CLIPImageProcessorPil.from_pretrained(clip_dir, local_files_only=True)
    return parts


def _vision_keys(image_encoder: CLIPVisionModel) -> dict[str, torch.Tensor]:
    """The vision tower's weights under transformers 4's names (`vision_model.*`), as the releases hold them."""
    return {
        "vision_model." + k.removeprefix("vision_model."): v for k, v in image_encoder.state_dict().items()
    }


def write_fixture(out_dir: str | Path, seed: int = 0, variant: str = "tiny-i2v") -> dict[str, Path]:
    """Write the tiny I2V (or with `variant="tiny-flf2v"` FLF2V) model under `out_dir`; returns the paths.

    Keys: root, diffusers, transformer_file, image_encoder_file, vae_file, text_encoder_file, tokenizer.
    """
    out = Path(out_dir)
    parts = build_components(variant, seed)
    transformer_file = _FILES[variant]

    def write(staging: Path) -> None:
        diffusers = staging / "diffusers"
        WanImageToVideoPipeline(**parts).save_pretrained(diffusers, safe_serialization=True)
        vision = _vision_keys(parts["image_encoder"])
        save_safetensors(vision, diffusers / "image_encoder" / "model.safetensors")
        single = staging / "single"
        write_single_files(single, parts)
        (single / "wan2.1_t2v_tiny.safetensors").unlink()
        save_safetensors(
            transformer_to_original(parts["transformer"].state_dict()), single / transformer_file
        )
        width, projection = (
            parts["image_encoder"].config.hidden_size,
            parts["image_encoder"].config.projection_dim,
        )
        unused = torch.randn(projection, width, generator=torch.Generator().manual_seed(seed + 6))
        save_safetensors({**vision, "visual_projection.weight": unused}, single / CLIP_FILE)

    publish_layouts(out, variant, write)
    return {
        **fixture_paths(out, transformer_file, VAE_FILE),
        "image_encoder_file": out / "single" / CLIP_FILE,
    }


def _model_section(architecture: str, transformer_file: str) -> str:
    # single files for the transformer and the CLIP encoder, the diffusers folder for the rest
    return f"""\
architecture = "{architecture}"
transformer = "{{root}}/single/{transformer_file}"
image_encoder = "{{root}}/single/{CLIP_FILE}"
vae = "{{root}}/diffusers"
text_encoder = "{{root}}/diffusers"
"""


I2V_FIXTURE = Fixture(write=write_fixture, model_section=_model_section("wan_i2v", _FILES["tiny-i2v"]))
FLF2V_FIXTURE = Fixture(
    write=partial(write_fixture, variant="tiny-flf2v"),
    model_section=_model_section("wan_flf2v", _FILES["tiny-flf2v"]),
)
