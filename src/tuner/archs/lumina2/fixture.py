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

from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    Lumina2Pipeline,
    Lumina2Transformer2DModel,
)
from transformers import Gemma2Model

from tuner.archs.flux.fixture import ldm_vae_file
from tuner.archs.lumina2.keys import transformer_to_original
from tuner.archs.lumina2.loaders import SYSTEM_PROMPT
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import prefixed
from tuner.fixtures.tokenizers import build_gemma_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "lumina_2_model_tiny.safetensors"
ALL_IN_ONE_FILE = "lumina_2_tiny.safetensors"
VAE_FILE = "ae.safetensors"
TEXT_ENCODER_FILE = "gemma_2_2b_tiny.safetensors"


def build_lumina2_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: the arguments of `Lumina2Pipeline` (transformer, vae, text_encoder, tokenizer, scheduler).
    """
    tokenizer = build_gemma_tokenizer([SYSTEM_PROMPT, "<Prompt Start>"])
    tokenizer.padding_side = "right"
    return {
        "transformer": tiny_model(Lumina2Transformer2DModel, tiny_config("lumina2", "transformer"), seed),
        "vae": tiny_model(AutoencoderKL, tiny_config("flux", "vae"), seed + 1),
        "text_encoder": tiny_model(Gemma2Model, tiny_config("lumina2", "text_encoder"), seed + 2),
        "tokenizer": tokenizer,
        # Lumina-Image-2.0's scheduler: flow-matching Euler with a static shift of 6
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=6.0),
    }


def write_lumina2_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Lumina 2 model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, all_in_one_file, vae_file,
    text_encoder_file, tokenizer (the single-file layout's tokenizer folder).
    """
    parts = build_lumina2_components(seed)
    transformer = transformer_to_original(parts["transformer"].state_dict())  # norm_final included
    vae = ldm_vae_file(parts["vae"])
    gemma = prefixed("model.", parts["text_encoder"].state_dict())
    all_in_one = (
        prefixed("model.diffusion_model.", transformer)
        | prefixed("first_stage_model.", vae)
        | prefixed("text_encoders.gemma2_2b.", gemma)
    )
    single = {
        "transformer_file": (TRANSFORMER_FILE, transformer),
        "all_in_one_file": (ALL_IN_ONE_FILE, all_in_one),
        "vae_file": (VAE_FILE, vae),
        "text_encoder_file": (TEXT_ENCODER_FILE, gemma),
    }
    return write_layouts(out_dir, "lumina2", Lumina2Pipeline(**parts), single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_lumina2_fixture,
    # the release's single files, as ComfyUI users hold them
    model_section=model_section(
        "lumina2", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=TEXT_ENCODER_FILE
    ),
)
