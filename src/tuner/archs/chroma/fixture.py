"""A tiny random-weight Chroma model, written in both layouts users have.

The transformer is built from the `tiny` config shipped with `tuner.archs.chroma.loaders` (2 heads of 32, one
double and one single block, rotary axes 8 + 12 + 12, an approximator of 2 layers of width 64); the
VAE, the T5 encoder (2 layers of width 64) and its tokenizer are the tiny FLUX.1 ones
(`tuner.archs.flux.fixture`), as Chroma uses FLUX.1's VAE and T5-XXL.

    out_dir/
      diffusers/                       what `ChromaPipeline.from_pretrained` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/                          the release's and ComfyUI's single files
        chroma-unlocked_tiny.safetensors   release keys (double_blocks.0.img_attn.qkv.weight,
                                           distilled_guidance_layer.layers.0.in_layer.weight, ...)
        ae.safetensors                 the LDM autoencoder layout
        t5xxl_tiny.safetensors         ComfyUI's T5 layout (shared.weight, no encoder.embed_tokens)
        tokenizer/

Both layouts hold the same float32 weights: the single files are the diffusers state dicts renamed by
tuner's own converters (`chroma_keys`, `flux_keys`).
"""

from __future__ import annotations

from pathlib import Path

from diffusers import ChromaPipeline, ChromaTransformer2DModel

from tuner.archs.chroma.keys import transformer_to_original
from tuner.archs.flux.fixture import T5_FILE, VAE_FILE, build_flux_components, ldm_vae_file
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import t5_file
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "chroma-unlocked_tiny.safetensors"


def build_chroma_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments
    of `ChromaPipeline` (transformer, vae, text_encoder, tokenizer, scheduler)."""
    flux = build_flux_components(seed)
    return {
        "transformer": tiny_model(ChromaTransformer2DModel, tiny_config("chroma", "transformer"), seed + 4),
        "vae": flux["vae"],
        "text_encoder": flux["text_encoder_2"],
        "tokenizer": flux["tokenizer_2"],
        "scheduler": flux["scheduler"],
    }


def write_chroma_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Chroma model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file (T5),
    tokenizer (the single-file layout's tokenizer folder)."""
    parts = build_chroma_components(seed)
    single = {
        "transformer_file": (TRANSFORMER_FILE, transformer_to_original(parts["transformer"].state_dict())),
        "vae_file": (VAE_FILE, ldm_vae_file(parts["vae"])),
        "text_encoder_file": (T5_FILE, t5_file(parts["text_encoder"])),  # ComfyUI's: `shared.weight` only
    }
    return write_layouts(out_dir, "chroma", ChromaPipeline(**parts), single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_chroma_fixture,
    # every part from its single file, as most Chroma users hold them
    model_section=model_section("chroma", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=T5_FILE),
)
