"""A tiny random-weight Wan 2.2 TI2V-5B, written in both layouts users have.

The transformer is the tiny Wan network on 48 latent channels (`configs/wan/transformer/tiny-ti2v`);
the VAE is a tiny Wan 2.2 VAE (`configs/wan/vae/tiny-2.2`: base width 16, decoder width 32, with the
real 2×2 pixel patching, 16× spatial / 4× temporal compression and 48 latent channels); the text
encoder and tokenizer are the tiny UMT5 of `tuner.archs.wan.fixture`, as the release shares Wan 2.1's.

    out_dir/
      diffusers/     what `WanPipeline.from_pretrained(out_dir/"diffusers")` loads (expand_timesteps on,
                     as in Wan-AI/Wan2.2-TI2V-5B-Diffusers)
      single/        the ComfyUI / official single files
        wan2.2_ti2v_tiny.safetensors   official transformer keys
        wan2.2_vae.safetensors         original Wan 2.2 VAE keys (encoder.downsamples.0.downsamples.0...)
        umt5_tiny.safetensors  tokenizer/
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

from tuner.archs.wan.fixture import TEXT_ENCODER_FILE, build_wan_components
from tuner.archs.wan.keys import transformer_to_original, vae22_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import t5_file
from tuner.fixtures.weights import tiny_config, tiny_model
from tuner.io import save_safetensors

TRANSFORMER_FILE = "wan2.2_ti2v_tiny.safetensors"
VAE_FILE = "wan2.2_vae.safetensors"


def build_ti2v_components(seed: int = 0) -> dict:
    """The tiny TI2V pipeline's components (eval mode, float32), deterministic given `seed`."""
    parts = build_wan_components(seed)  # text encoder, tokenizer and scheduler are Wan 2.1's
    parts["transformer"] = tiny_model(
        WanTransformer3DModel, tiny_config("wan", "transformer", "tiny-ti2v"), seed + 4
    )
    parts["vae"] = tiny_model(AutoencoderKLWan, tiny_config("wan", "vae", "tiny-2.2"), seed + 5)
    parts["scheduler"].register_to_config(flow_shift=5.0)  # the TI2V-5B release samples at shift 5
    return parts


def write_wan22_ti2v_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Wan 2.2 TI2V-5B under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers, transformer_file, vae_file, text_encoder_file, tokenizer.
    """
    parts = build_ti2v_components(seed)
    transformer = transformer_to_original(parts["transformer"].state_dict())
    single = {
        "transformer_file": (TRANSFORMER_FILE, aligned_file(transformer)),
        "vae_file": (VAE_FILE, vae22_to_original(parts["vae"].state_dict())),
        "text_encoder_file": (TEXT_ENCODER_FILE, t5_file(parts["text_encoder"])),
    }
    pipeline = WanPipeline(**parts, expand_timesteps=True)
    return write_layouts(out_dir, "wan22_ti2v", pipeline, single, tokenizer_folders(parts))


def aligned_file(tensors: dict[str, torch.Tensor]) -> Callable[[Path], None]:
    """A `write_layouts` single file that saves `tensors` with the tensor data starting 64-byte aligned
    (the header padded through its metadata).

    Loaded single files keep their weights in the memory-mapped file, at the header's offset, while
    memory settings (block swap) copy the weights they place. On the CPU a matmul on weights that are
    8 bytes off a 16-byte boundary takes another kernel path and differs in the last bit, and the
    contract suite compares block swap bit for bit; aligned data keeps both on one path.
    """

    def save(path: Path) -> None:
        for pad in range(0, 64, 1):
            save_safetensors(tensors, path, metadata={"format": "pt", "padding": " " * pad})
            with open(path, "rb") as f:
                if (8 + struct.unpack("<Q", f.read(8))[0]) % 64 == 0:
                    return
        raise AssertionError(f"{path}: no padding aligns the tensor data")

    return save


FIXTURE = Fixture(
    write=write_wan22_ti2v_fixture,
    # the single files for the transformer and the VAE (the layouts only tuner converts), the diffusers
    # folder for the text encoder
    model_section=model_section(
        "wan22_ti2v", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder="diffusers"
    ),
)
