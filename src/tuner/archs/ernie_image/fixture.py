"""A tiny random-weight ERNIE-Image model, written in both layouts users have.

The models are built from the `tiny` configs shipped in `configs/` (transformer: 2 heads of 32, 2 blocks,
text width 32; Ministral 3: a language model of 3 layers of width 32, so `hidden_states[-2]` is a layer's
output, with a one-layer Pixtral vision tower as the release's `Mistral3Model` has) and FLUX.2's tiny VAE
(`tuner.archs.flux2.fixture`: the real 8x compression, 32 channels, BatchNorm statistics away from 0 / 1),
so loaders recognise them like real checkpoints. The tokenizer is a Mistral-style byte-level BPE learned
from the caption words that puts `<s>` before every prompt, as Ministral 3's does.

    out_dir/
      diffusers/                        what `ErnieImagePipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/                           the ComfyUI single-file layout
        ernie-image_tiny.safetensors    the release's keys (diffusers' names: layers.0.self_attention.to_q...)
        flux2-vae.safetensors           the LDM layout (encoder.down.0..., bn.running_mean)
        ministral-3-3b_tiny.safetensors Hugging Face's Mistral3 keys (model.language_model..., model.vision_tower...)
        tokenizer/

Both layouts hold the same float32 weights.
"""

from __future__ import annotations

from pathlib import Path

from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler
from tokenizers import processors
from transformers import Ministral3Config, Mistral3Model

from tuner.archs.flux2.fixture import VAE_FILE, flux2_vae_file, tiny_flux2_vae, tiny_mistral3_config
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import prefixed
from tuner.fixtures.tokenizers import build_mistral_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "ernie-image_tiny.safetensors"
TEXT_ENCODER_FILE = "ministral-3-3b_tiny.safetensors"

SCHEDULER_SHIFT = 3.0
"""ERNIE-Image's flow shift (ComfyUI's `ErnieImage` sampling settings; the release's scheduler config)."""


def tiny_ministral3(seed: int) -> Mistral3Model:
    """The tiny Ministral 3 (`configs/text_encoder/tiny` as its language model) with a one-layer Pixtral
    vision tower, filled with `seed`."""
    text = Ministral3Config.from_pretrained(tiny_config("ernie_image", "text_encoder"))
    return tiny_model(Mistral3Model, tiny_mistral3_config(text), seed)


def _ministral3_tokenizer(vocab_size: int):
    """`build_mistral_tokenizer` with Ministral 3's BOS before every encoded text."""
    tokenizer = build_mistral_tokenizer(vocab_size=vocab_size)
    bos = ("<s>", tokenizer.convert_tokens_to_ids("<s>"))
    tokenizer.backend_tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[bos]),
    ])  # fmt: skip
    return tokenizer


def build_ernie_image_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments of
    `ErnieImagePipeline` (transformer, vae, text_encoder, tokenizer, scheduler)."""
    text_encoder = tiny_ministral3(seed + 2)
    tokenizer = _ministral3_tokenizer(text_encoder.config.text_config.vocab_size)
    return {
        "transformer": tiny_model(
            ErnieImageTransformer2DModel, tiny_config("ernie_image", "transformer"), seed
        ),
        "vae": tiny_flux2_vae(seed + 1, seed + 3),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_SHIFT),
    }


def write_ernie_image_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny ERNIE-Image under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file, tokenizer (the
    single-file layout's tokenizer folder). Existing `diffusers/` and `single/` folders under `out_dir` are
    replaced only once the new ones are complete.
    """
    parts = build_ernie_image_components(seed)
    single = {
        "transformer_file": (TRANSFORMER_FILE, parts["transformer"].state_dict()),
        "vae_file": (VAE_FILE, flux2_vae_file(parts["vae"])),
        "text_encoder_file": (TEXT_ENCODER_FILE, prefixed("model.", parts["text_encoder"].state_dict())),
    }
    pipe = ErnieImagePipeline(**parts)
    return write_layouts(out_dir, "ernie_image", pipe, single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_ernie_image_fixture,
    # every part as a ComfyUI single file (the tokenizer from its folder)
    model_section=model_section(
        "ernie_image", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=TEXT_ENCODER_FILE
    ),
)
