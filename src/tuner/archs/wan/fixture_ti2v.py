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

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

from tuner.archs.wan.fixture import build_wan_components, fixture_paths, write_text_encoder_files
from tuner.archs.wan.keys import transformer_to_original, vae22_to_original
from tuner.archs.wan.loaders import TRANSFORMER_VARIANTS
from tuner.archs.wan.wan22_vae import VAE22_VARIANTS
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors

TRANSFORMER_FILE = "wan2.2_ti2v_tiny.safetensors"
VAE_FILE = "wan2.2_vae.safetensors"


def build_ti2v_components(seed: int = 0) -> dict:
    """The tiny TI2V pipeline's components (eval mode, float32), deterministic given `seed`."""
    parts = build_wan_components(seed)  # text encoder, tokenizer and scheduler are Wan 2.1's
    with torch.random.fork_rng(devices=[]):
        config = next(v.config_dir for v in TRANSFORMER_VARIANTS if v.name == "tiny-ti2v")
        transformer = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(config))
        vae_config = next(v.config_dir for v in VAE22_VARIANTS if v.name == "tiny-2.2")
        vae = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(vae_config))
    parts["transformer"] = fill_random_(transformer, seed + 4).eval()
    parts["vae"] = fill_random_(vae, seed + 5).eval()
    parts["scheduler"].register_to_config(flow_shift=5.0)  # the TI2V-5B release samples at shift 5
    return parts


def write_wan22_ti2v_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Wan 2.2 TI2V-5B under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers, transformer_file, vae_file, text_encoder_file, tokenizer.
    """
    out = Path(out_dir)
    parts = build_ti2v_components(seed)

    def write(staging: Path) -> None:
        WanPipeline(**parts, expand_timesteps=True).save_pretrained(
            staging / "diffusers", safe_serialization=True
        )
        single = staging / "single"
        single.mkdir(parents=True)
        _save_aligned(transformer_to_original(parts["transformer"].state_dict()), single / TRANSFORMER_FILE)
        save_safetensors(vae22_to_original(parts["vae"].state_dict()), single / VAE_FILE)
        write_text_encoder_files(single, parts)

    publish_layouts(out, "wan22_ti2v", write)
    return fixture_paths(out, TRANSFORMER_FILE, VAE_FILE)


def _save_aligned(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Save with the tensor data starting 64-byte aligned (the header padded through its metadata).

    Loaded single files keep their weights in the memory-mapped file, at the header's offset, while
    memory settings (block swap) copy the weights they place. On the CPU a matmul on weights that are
    8 bytes off a 16-byte boundary takes another kernel path and differs in the last bit, and the
    contract suite compares block swap bit for bit; aligned data keeps both on one path.
    """
    import struct

    for pad in range(0, 64, 1):
        save_safetensors(tensors, path, metadata={"format": "pt", "padding": " " * pad})
        with open(path, "rb") as f:
            if (8 + struct.unpack("<Q", f.read(8))[0]) % 64 == 0:
                return
    raise AssertionError(f"{path}: no padding aligns the tensor data")


FIXTURE = Fixture(
    write=write_wan22_ti2v_fixture,
    # the single files for the transformer and the VAE (the layouts only tuner converts), the diffusers
    # folder for the text encoder
    model_section=f"""\
architecture = "wan22_ti2v"
transformer = "{{root}}/single/{TRANSFORMER_FILE}"
vae = "{{root}}/single/{VAE_FILE}"
text_encoder = "{{root}}/diffusers"
""",
)
