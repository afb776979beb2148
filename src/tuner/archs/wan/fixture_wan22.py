"""Tiny random-weight Wan 2.2 A14B models (T2V and I2V): two tiny Wan experts, in both layouts users have.

The T2V experts are the tiny Wan 2.1 transformer (`tuner.archs.wan.fixture`) with different weights; the I2V
experts are its 36-channel image-to-video form without CLIP layers (`configs/wan/transformer/
tiny-i2v-A14B`), as the release has no image encoder. The VAE, text encoder and tokenizer are Wan 2.1's,
as in the releases.

    out_dir/
      diffusers/     what `WanPipeline` (T2V) / `WanImageToVideoPipeline` (I2V, no image_encoder)
                     `.from_pretrained(out_dir/"diffusers")` loads: transformer/ (high noise),
                     transformer_2/ (low noise), the release's boundary_ratio, vae/, text_encoder/, ...
      single/        the ComfyUI / official single files, named like the release's
        wan2.2_t2v_high_noise_tiny.safetensors  wan2.2_t2v_low_noise_tiny.safetensors  (I2V: wan2.2_i2v_...)
        wan_2.1_vae.safetensors  umt5_tiny.safetensors  tokenizer/
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel

from tuner.archs.wan.fixture import build_wan_components, wan21_files
from tuner.archs.wan.keys import transformer_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.weights import tiny_config, tiny_model
from tuner.registry import architecture

# per architecture: the experts' tiny variant, the release's file-name prefix, the diffusers pipeline
_KINDS = {
    "wan22_t2v": ("tiny", "wan2.2_t2v", WanPipeline),
    "wan22_i2v": ("tiny-i2v-A14B", "wan2.2_i2v", WanImageToVideoPipeline),
}


def expert_files(arch: str) -> tuple[str, str]:
    """The single files of the high- and the low-noise expert, named like the release's."""
    prefix = _KINDS[arch][1]
    return f"{prefix}_high_noise_tiny.safetensors", f"{prefix}_low_noise_tiny.safetensors"


def write_wan22_fixture(out_dir: str | Path, seed: int = 0, arch: str = "wan22_t2v") -> dict[str, Path]:
    """Write the tiny Wan 2.2 A14B model of `arch` (wan22_t2v or wan22_i2v) under `out_dir` in both
    layouts; returns the paths.

    Keys: root, diffusers, transformer_file (the high-noise expert, what `model.transformer` holds),
    transformer_2_file (the low-noise one), vae_file, text_encoder_file, tokenizer.
    """
    variant, _, pipeline = _KINDS[arch]
    config = tiny_config("wan", "transformer", variant)
    parts = build_wan_components(seed)  # its transformer: the T2V high-noise expert
    if variant != "tiny":
        parts["transformer"] = tiny_model(WanTransformer3DModel, config, seed + 4)
    parts["transformer_2"] = tiny_model(WanTransformer3DModel, config, seed + 3)
    extra = {"image_encoder": None, "image_processor": None} if pipeline is WanImageToVideoPipeline else {}
    high, low = expert_files(arch)
    single = {
        "transformer_file": (high, transformer_to_original(parts["transformer"].state_dict())),
        "transformer_2_file": (low, transformer_to_original(parts["transformer_2"].state_dict())),
    }
    pipe = pipeline(**parts, **extra, boundary_ratio=architecture(arch).boundary)
    return write_layouts(out_dir, arch, pipe, single | wan21_files(parts), tokenizer_folders(parts))


def _model_section(arch: str) -> str:
    # single files for the experts, the diffusers folder for the rest; the contract suite trains the
    # high-noise expert (model.transformer), the one it swaps for merged files
    high, low = expert_files(arch)
    return (
        model_section(arch, transformer=high, transformer_2=low, vae="diffusers", text_encoder="diffusers")
        + 'expert = "high"\n'
    )


T2V_FIXTURE = Fixture(write=write_wan22_fixture, model_section=_model_section("wan22_t2v"))
I2V_FIXTURE = Fixture(
    write=partial(write_wan22_fixture, arch="wan22_i2v"), model_section=_model_section("wan22_i2v")
)
