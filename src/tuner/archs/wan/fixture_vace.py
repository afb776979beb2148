"""A tiny random-weight Wan 2.1 VACE model, written in both layouts users have.

The tiny Wan network (`tuner.archs.wan.fixture`) with the control branch (`configs/wan/transformer/
tiny-vace`: VACE blocks beside both blocks, 96 control channels); VAE, UMT5 and tokenizer are Wan 2.1's
tiny ones.

    out_dir/
      diffusers/     what `WanVACEPipeline.from_pretrained(out_dir/"diffusers")` loads
      single/        the official / ComfyUI single files
        wan2.1_vace_tiny.safetensors   official keys (vace_blocks.0.before_proj.weight, vace_patch_embedding, ...)
        wan_2.1_vae.safetensors  umt5_tiny.safetensors  tokenizer/
"""

from __future__ import annotations

from pathlib import Path

from diffusers import WanVACEPipeline, WanVACETransformer3DModel

from tuner.archs.wan.fixture import build_wan_components, wan21_files
from tuner.archs.wan.keys import transformer_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "wan2.1_vace_tiny.safetensors"


def build_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32): `WanVACEPipeline`'s arguments."""
    parts = build_wan_components(seed)
    parts["transformer"] = tiny_model(
        WanVACETransformer3DModel, tiny_config("wan", "transformer", "tiny-vace"), seed + 7
    )
    return parts


def write_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny VACE model under `out_dir`; returns the paths (keys as `write_wan_fixture`'s)."""
    parts = build_components(seed)
    single = {
        "transformer_file": (TRANSFORMER_FILE, transformer_to_original(parts["transformer"].state_dict()))
    }
    return write_layouts(out_dir, "tiny-vace", WanVACEPipeline(**parts), single | wan21_files(parts),
                         tokenizer_folders(parts))  # fmt: skip


FIXTURE = Fixture(
    write=write_fixture,
    model_section=model_section(
        "wan_vace", transformer=TRANSFORMER_FILE, vae="diffusers", text_encoder="diffusers"
    ),
)
