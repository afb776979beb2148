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

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from tuner.archs.flux.keys import transformer_to_original, vae_to_original
from tuner.archs.flux.loaders import CLIP_VARIANTS, T5_VARIANTS, TRANSFORMER_VARIANTS, VAE_VARIANTS
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_clip_tokenizer, build_t5_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors
from tuner.models.identify import Variant

DEV_FILE = "flux1-dev_tiny.safetensors"
KONTEXT_FILE = "flux1-kontext-dev_tiny.safetensors"
VAE_FILE = "ae.safetensors"
CLIP_FILE = "clip_l.safetensors"
T5_FILE = "t5xxl_tiny.safetensors"


def _tiny(variants: tuple[Variant, ...]) -> Path:
    return next(v.config_dir for v in variants if v.name == "tiny")


def build_flux_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: the arguments of `FluxPipeline` (transformer, vae, text_encoder, tokenizer, text_encoder_2,
    tokenizer_2, scheduler).
    """
    # Constructors draw initial weights from the global generator; keep the caller's stream untouched.
    with torch.random.fork_rng(devices=[]):
        transformer = FluxTransformer2DModel.from_config(
            FluxTransformer2DModel.load_config(_tiny(TRANSFORMER_VARIANTS))
        )
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(_tiny(VAE_VARIANTS)))
        clip = CLIPTextModel(CLIPTextConfig.from_pretrained(_tiny(CLIP_VARIANTS)))
        t5 = T5EncoderModel(T5Config.from_pretrained(_tiny(T5_VARIANTS)))
    fill_random_(transformer, seed)
    fill_random_(vae, seed + 1)
    fill_random_(clip, seed + 2)
    fill_random_(t5, seed + 3)
    # FLUX.1-dev's scheduler: flow-matching Euler with the resolution-dependent shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )  # fmt: skip
    t5_tokenizer = build_t5_tokenizer()
    t5_tokenizer.model_max_length = 512
    return {
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "text_encoder": clip.eval(),
        "tokenizer": build_clip_tokenizer(),
        "text_encoder_2": t5.eval(),
        "tokenizer_2": t5_tokenizer,
        "scheduler": scheduler,
    }


def write_flux_fixture(out_dir: str | Path, seed: int = 0, kontext: bool = False) -> dict[str, Path]:
    """Write the tiny FLUX.1-dev (or Kontext) model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file (CLIP),
    text_encoder_2_file (T5), tokenizer, tokenizer_2 (the single-file layout's tokenizer folders).
    Existing `diffusers/` and `single/` folders under `out_dir` are replaced only once the new ones are
    complete.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = build_flux_components(seed)
    pipeline = FluxKontextPipeline if kontext else FluxPipeline
    transformer_file = KONTEXT_FILE if kontext else DEV_FILE

    def write(staging: Path) -> None:
        pipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        write_single_files(staging / "single", parts, transformer_file)

    publish_layouts(out, "flux", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "transformer_file": single / transformer_file,
        "vae_file": single / VAE_FILE,
        "text_encoder_file": single / CLIP_FILE,
        "text_encoder_2_file": single / T5_FILE,
        "tokenizer": single / "tokenizer",
        "tokenizer_2": single / "tokenizer_2",
    }


def write_flux_kontext_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """`write_flux_fixture` for FLUX.1 Kontext (FluxKontextPipeline folder, Kontext file name)."""
    return write_flux_fixture(out_dir, seed, kontext=True)


def write_single_files(folder: Path, parts: dict, transformer_file: str) -> None:
    folder.mkdir(parents=True)
    save_safetensors(transformer_to_original(parts["transformer"].state_dict()), folder / transformer_file)
    levels = len(parts["vae"].config.block_out_channels)
    save_safetensors(vae_to_original(parts["vae"].state_dict(), levels), folder / VAE_FILE)
    # ComfyUI's CLIP files keep transformers 4's `text_model.` prefix.
    clip = {f"text_model.{k}": v for k, v in parts["text_encoder"].state_dict().items()}
    save_safetensors(clip, folder / CLIP_FILE)
    # ComfyUI's T5 files hold `shared.weight` only; the encoder's embedding is tied to it.
    t5 = parts["text_encoder_2"].state_dict()
    t5.pop("encoder.embed_tokens.weight")
    save_safetensors(t5, folder / T5_FILE)
    parts["tokenizer"].save_pretrained(folder / "tokenizer")
    parts["tokenizer_2"].save_pretrained(folder / "tokenizer_2")


FIXTURE = Fixture(
    write=write_flux_fixture,
    # every part from its single file, as most FLUX.1 users hold them
    model_section=f"""\
architecture = "flux"
transformer = "{{root}}/single/{DEV_FILE}"
vae = "{{root}}/single/{VAE_FILE}"
text_encoder = "{{root}}/single/{CLIP_FILE}"
tokenizer = "{{root}}/single/tokenizer"
text_encoder_2 = "{{root}}/single/{T5_FILE}"
tokenizer_2 = "{{root}}/single/tokenizer_2"
""",
)

KONTEXT_FIXTURE = Fixture(
    write=write_flux_kontext_fixture,
    # the BFL single file for the transformer, the diffusers folder for the rest (T5 found beside CLIP)
    model_section=f"""\
architecture = "flux_kontext"
transformer = "{{root}}/single/{KONTEXT_FILE}"
vae = "{{root}}/diffusers"
text_encoder = "{{root}}/diffusers"
""",
)
