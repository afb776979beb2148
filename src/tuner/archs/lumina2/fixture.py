"""A tiny random-weight Lumina Image 2.0 model, written in both layouts users have.

The models are built from the `tiny` configs shipped with `tuner.archs.lumina2.loaders` (transformer: 3 query
heads and 1 key/value head of 32, the release's 3 : 1 : 1 split of `qkv`; one refiner block of each
kind and 2 layers; Gemma 2: 2 layers of width 64) and FLUX.1's tiny VAE (the real 8× compression and
16 latent channels), so loaders recognise them like real checkpoints. The Gemma tokenizer is built
offline from the system prompt and caption words (`tuner.fixtures.tokenizers.build_gemma_tokenizer`).

    out_dir/
      diffusers/                         what `Lumina2Pipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/
        lumina_2_model_tiny.safetensors  Alpha-VLLM's keys (layers.0.attention.qkv.weight, ...; with the
                                         unused norm_final.weight of the release)
        lumina_2_tiny.safetensors        ComfyUI's all-in-one layout: the transformer under
                                         `model.diffusion_model.`, the VAE under `first_stage_model.`, Gemma
                                         under `text_encoders.gemma2_2b.`
        ae.safetensors                   the FLUX.1 VAE in the LDM layout
        gemma_2_2b_tiny.safetensors      ComfyUI's Gemma layout (model.layers.0..., model.norm.weight)
        tokenizer/

Both layouts hold the same float32 weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    Lumina2Pipeline,
    Lumina2Transformer2DModel,
)
from transformers import Gemma2Config, Gemma2Model

from tuner.archs.flux.keys import vae_to_original
from tuner.archs.flux.loaders import VAE_VARIANTS
from tuner.archs.lumina2.keys import transformer_to_original
from tuner.archs.lumina2.loaders import SYSTEM_PROMPT, TEXT_ENCODER_VARIANTS, TRANSFORMER_VARIANTS
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_gemma_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors

TRANSFORMER_FILE = "lumina_2_model_tiny.safetensors"
ALL_IN_ONE_FILE = "lumina_2_tiny.safetensors"
VAE_FILE = "ae.safetensors"
TEXT_ENCODER_FILE = "gemma_2_2b_tiny.safetensors"


def _tiny(variants) -> Path:
    return next(v.config_dir for v in variants if v.name == "tiny")


def build_lumina2_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: the arguments of `Lumina2Pipeline` (transformer, vae, text_encoder, tokenizer, scheduler).
    """
    with torch.random.fork_rng(devices=[]):  # constructors draw from the global generator
        transformer = Lumina2Transformer2DModel.from_config(
            Lumina2Transformer2DModel.load_config(_tiny(TRANSFORMER_VARIANTS))
        )
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(_tiny(VAE_VARIANTS)))
        gemma = Gemma2Model(Gemma2Config.from_pretrained(_tiny(TEXT_ENCODER_VARIANTS)))
    fill_random_(transformer, seed)
    fill_random_(vae, seed + 1)
    fill_random_(gemma, seed + 2)
    tokenizer = build_gemma_tokenizer([SYSTEM_PROMPT, "<Prompt Start>"])
    tokenizer.padding_side = "right"
    return {
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "text_encoder": gemma.eval(),
        "tokenizer": tokenizer,
        # Lumina-Image-2.0's scheduler: flow-matching Euler with a static shift of 6
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=6.0),
    }


def write_lumina2_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Lumina 2 model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, all_in_one_file, vae_file,
    text_encoder_file, tokenizer (the single-file layout's tokenizer folder).
    """
    out = Path(out_dir)
    parts = build_lumina2_components(seed)

    def write(staging: Path) -> None:
        Lumina2Pipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        write_single_files(staging / "single", parts)

    publish_layouts(out, "lumina2", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "transformer_file": single / TRANSFORMER_FILE,
        "all_in_one_file": single / ALL_IN_ONE_FILE,
        "vae_file": single / VAE_FILE,
        "text_encoder_file": single / TEXT_ENCODER_FILE,
        "tokenizer": single / "tokenizer",
    }


def write_single_files(folder: Path, parts: dict) -> None:
    folder.mkdir(parents=True)
    transformer = transformer_to_original(parts["transformer"].state_dict())  # norm_final included
    save_safetensors(transformer, folder / TRANSFORMER_FILE)
    levels = len(parts["vae"].config.block_out_channels)
    vae = vae_to_original(parts["vae"].state_dict(), levels)
    save_safetensors(vae, folder / VAE_FILE)
    gemma = {f"model.{k}": v for k, v in parts["text_encoder"].state_dict().items()}
    save_safetensors(gemma, folder / TEXT_ENCODER_FILE)
    save_safetensors(
        {
            **{f"model.diffusion_model.{k}": v for k, v in transformer.items()},
            **{f"first_stage_model.{k}": v for k, v in vae.items()},
            **{f"text_encoders.gemma2_2b.{k}": v for k, v in gemma.items()},
        },
        folder / ALL_IN_ONE_FILE,
    )
    parts["tokenizer"].save_pretrained(folder / "tokenizer")


FIXTURE = Fixture(
    write=write_lumina2_fixture,
    # the release's single files, as ComfyUI users hold them
    model_section=f"""\
architecture = "lumina2"
transformer = "{{root}}/single/{TRANSFORMER_FILE}"
vae = "{{root}}/single/{VAE_FILE}"
text_encoder = "{{root}}/single/{TEXT_ENCODER_FILE}"
tokenizer = "{{root}}/single/tokenizer"
""",
)
