"""Tiny random-weight FLUX.1 models (dev and Kontext), written in both layouts users have.

The models are built from the `tiny` configs shipped with `tuner.archs.flux.loaders` (transformer: 2 heads of
32, one double and one single block, rotary axes 8 + 12 + 12; VAE: widths 32-64 with the real 8×
compression and 16 latent channels; CLIP: 2 layers of width 32; T5: 2 layers of width 64), so loaders
recognise them like real checkpoints. Kontext is the same network under its own file and pipeline.

    out_dir/
      diffusers/                     what `FluxPipeline` (or `FluxKontextPipeline`).from_pretrained loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  text_encoder_2/  tokenizer_2/
        scheduler/
      single/                        BFL's and ComfyUI's single files
        flux1-dev_tiny.safetensors   BFL keys (double_blocks.0.img_attn.qkv.weight, ...); Kontext:
                                     flux1-kontext-dev_tiny.safetensors
        ae.safetensors               the LDM autoencoder layout (encoder.down.0.block.0.conv1.weight, ...)
        clip_l.safetensors           ComfyUI's CLIP layout (text_model.encoder.layers.0...)
        t5xxl_tiny.safetensors       ComfyUI's T5 layout (shared.weight, no encoder.embed_tokens)
        tokenizer/  tokenizer_2/

Both layouts hold the same float32 weights: the single files are the diffusers state dicts renamed by
tuner's own converters (`tuner.archs.flux.keys`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
)
from transformers import CLIPTextModel, T5EncoderModel

from tuner.archs.flux.keys import transformer_to_original, vae_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import clip_text_file, t5_file
from tuner.fixtures.tokenizers import build_clip_tokenizer, build_t5_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

DEV_FILE = "flux1-dev_tiny.safetensors"
KONTEXT_FILE = "flux1-kontext-dev_tiny.safetensors"
VAE_FILE = "ae.safetensors"
CLIP_FILE = "clip_l.safetensors"
T5_FILE = "t5xxl_tiny.safetensors"


def build_flux_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: the arguments of `FluxPipeline` (transformer, vae, text_encoder, tokenizer, text_encoder_2,
    tokenizer_2, scheduler).
    """
    t5_tokenizer = build_t5_tokenizer()
    t5_tokenizer.model_max_length = 512
    return {
        "transformer": tiny_model(FluxTransformer2DModel, tiny_config("flux", "transformer"), seed),
        "vae": tiny_model(AutoencoderKL, tiny_config("flux", "vae"), seed + 1),
        "text_encoder": tiny_model(CLIPTextModel, tiny_config("flux", "clip"), seed + 2),
        "tokenizer": build_clip_tokenizer(),
        "text_encoder_2": tiny_model(T5EncoderModel, tiny_config("flux", "t5"), seed + 3),
        "tokenizer_2": t5_tokenizer,
        # FLUX.1-dev's scheduler: flow-matching Euler with the resolution-dependent shift.
        "scheduler": FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        ),
    }


def ldm_vae_file(vae: AutoencoderKL) -> dict:
    """A FLUX.1-style `AutoencoderKL` in the original LDM layout, as `ae.safetensors` holds it."""
    return vae_to_original(vae.state_dict(), len(vae.config.block_out_channels))


def write_flux_fixture(out_dir: str | Path, seed: int = 0, kontext: bool = False) -> dict[str, Path]:
    """Write the tiny FLUX.1-dev (or Kontext) model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file (CLIP),
    text_encoder_2_file (T5), tokenizer, tokenizer_2 (the single-file layout's tokenizer folders).
    Existing `diffusers/` and `single/` folders under `out_dir` are replaced only once the new ones are
    complete.
    """
    parts = build_flux_components(seed)
    single = {
        "transformer_file": (
            KONTEXT_FILE if kontext else DEV_FILE,
            transformer_to_original(parts["transformer"].state_dict()),
        ),
        "vae_file": (VAE_FILE, ldm_vae_file(parts["vae"])),
        "text_encoder_file": (CLIP_FILE, clip_text_file(parts["text_encoder"])),
        "text_encoder_2_file": (T5_FILE, t5_file(parts["text_encoder_2"])),
    }
    pipeline = (FluxKontextPipeline if kontext else FluxPipeline)(**parts)
    return write_layouts(out_dir, "flux", pipeline, single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_flux_fixture,
    # every part from its single file, as most FLUX.1 users hold them
    model_section=model_section(
        "flux", transformer=DEV_FILE, vae=VAE_FILE, text_encoder=CLIP_FILE, text_encoder_2=T5_FILE
    ),
)

KONTEXT_FIXTURE = Fixture(
    write=partial(write_flux_fixture, kontext=True),
    # the BFL single file for the transformer, the diffusers folder for the rest (T5 found beside CLIP)
    model_section=model_section(
        "flux_kontext", transformer=KONTEXT_FILE, vae="diffusers", text_encoder="diffusers"
    ),
)
