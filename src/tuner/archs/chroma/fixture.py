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

import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel

from tuner.archs.chroma.keys import transformer_to_original
from tuner.archs.chroma.loaders import TRANSFORMER_VARIANTS
from tuner.archs.flux.fixture import T5_FILE, VAE_FILE, build_flux_components
from tuner.archs.flux.keys import vae_to_original
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors

TRANSFORMER_FILE = "chroma-unlocked_tiny.safetensors"


def build_chroma_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments
    of `ChromaPipeline` (transformer, vae, text_encoder, tokenizer, scheduler)."""
    flux = build_flux_components(seed)
    config = next(v.config_dir for v in TRANSFORMER_VARIANTS if v.name == "tiny")
    with torch.random.fork_rng(devices=[]):  # keep the caller's random stream untouched
        transformer = ChromaTransformer2DModel.from_config(ChromaTransformer2DModel.load_config(config))
    fill_random_(transformer, seed + 4)
    return {
        "transformer": transformer.eval(),
        "vae": flux["vae"],
        "text_encoder": flux["text_encoder_2"],
        "tokenizer": flux["tokenizer_2"],
        "scheduler": flux["scheduler"],
    }


def write_chroma_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Chroma model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file (T5),
    tokenizer (the single-file layout's tokenizer folder)."""
    out = Path(out_dir)
    parts = build_chroma_components(seed)

    def write(staging: Path) -> None:
        ChromaPipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        single = staging / "single"
        single.mkdir(parents=True)
        save_safetensors(
            transformer_to_original(parts["transformer"].state_dict()), single / TRANSFORMER_FILE
        )
        levels = len(parts["vae"].config.block_out_channels)
        save_safetensors(vae_to_original(parts["vae"].state_dict(), levels), single / VAE_FILE)
        t5 = parts["text_encoder"].state_dict()
        t5.pop("encoder.embed_tokens.weight")  # ComfyUI's T5 files hold the tied `shared.weight` only
        save_safetensors(t5, single / T5_FILE)
        parts["tokenizer"].save_pretrained(single / "tokenizer")

    publish_layouts(out, "chroma", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "transformer_file": single / TRANSFORMER_FILE,
        "vae_file": single / VAE_FILE,
        "text_encoder_file": single / T5_FILE,
        "tokenizer": single / "tokenizer",
    }


FIXTURE = Fixture(
    write=write_chroma_fixture,
    # every part from its single file, as most Chroma users hold them
    model_section=f"""\
architecture = "chroma"
transformer = "{{root}}/single/{TRANSFORMER_FILE}"
vae = "{{root}}/single/{VAE_FILE}"
text_encoder = "{{root}}/single/{T5_FILE}"
tokenizer = "{{root}}/single/tokenizer"
""",
)
