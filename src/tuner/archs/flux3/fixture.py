"""A tiny random-weight FLUX.3 model, written in both layouts users have.

The models are built from the `tiny` configs shipped in `configs/` (transformer: 2 heads of 32, one
per-mode block per mode and 2 joint blocks, text width 8 x 16; Qwen3-VL: a language model of 32 layers of
width 16, so `LAYERS` (4, 8, ..., 32) are all there, with a one-block vision tower) and FLUX.2's tiny VAE
(`tuner.archs.flux2.fixture`: the real 8x compression, 32 channels, BatchNorm statistics away from 0 / 1),
so loaders recognise them like real checkpoints. The tokenizer is a Qwen2 byte-level BPE with Qwen3-VL's
chat template for a text message.

    out_dir/
      diffusers/                        the FLUX.3 repository's component folders (diffusers ships a
        transformer/  vae/  text_encoder/  tokenizer/  scheduler/      modular pipeline only)
      single/                           the release's single files
        flux3_klein_base_tiny.safetensors   BFL's keys (content_mode_blocks.image.0.q_proj, ...)
        flux2-vae.safetensors               the LDM layout (encoder.down.0..., bn.running_mean)
        qwen3vl_tiny.safetensors            Hugging Face Qwen3-VL keys (model.language_model..., model.visual...)
        tokenizer/

Both layouts hold the same float32 weights.
"""

from __future__ import annotations

from pathlib import Path

from diffusers import FlowMatchEulerDiscreteScheduler, Flux3Transformer2DModel

from tuner.archs.flux2.fixture import VAE_FILE, flux2_vae_file, tiny_flux2_vae
from tuner.archs.flux3.keys import FLUX3_LAYOUT
from tuner.archs.krea2.fixture import tiny_qwen3_vl
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import prefixed
from tuner.fixtures.tokenizers import build_qwen2_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "flux3_klein_base_tiny.safetensors"
TEXT_ENCODER_FILE = "qwen3vl_tiny.safetensors"

SCHEDULER_SHIFT = 6.93
"""FLUX.3's constant flow shift (`Flux3SetTimestepsStep`'s scheduler config)."""

# Qwen3-VL's chat template, reduced to messages whose content is a string, and the generation prompt
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_flux3_components(seed: int = 0) -> dict:
    """The tiny model's components (eval mode, float32), deterministic given `seed`: what the modular FLUX.3
    pipeline takes (transformer, vae, text_encoder, tokenizer, scheduler)."""
    text_encoder = tiny_qwen3_vl(seed + 2, family="flux3")
    tokenizer = build_qwen2_tokenizer(["user\nassistant\n"])
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) <= text_encoder.config.text_config.vocab_size, (
        "the tiny vocabulary outgrew the config"
    )
    return {
        "transformer": tiny_model(Flux3Transformer2DModel, tiny_config("flux3", "transformer"), seed),
        "vae": tiny_flux2_vae(seed + 1, seed + 3),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_SHIFT),
    }


def write_flux3_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny FLUX.3 under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (the component folders' root), transformer_file, vae_file, text_encoder_file,
    tokenizer (the single-file layout's tokenizer folder). Existing `diffusers/` and `single/` folders under
    `out_dir` are replaced only once the new ones are complete.
    """
    parts = build_flux3_components(seed)
    single = {
        "transformer_file": (TRANSFORMER_FILE, FLUX3_LAYOUT.to_original(parts["transformer"].state_dict())),
        "vae_file": (VAE_FILE, flux2_vae_file(parts["vae"])),
        "text_encoder_file": (TEXT_ENCODER_FILE, prefixed("model.", parts["text_encoder"].state_dict())),
    }

    def write_components(folder: Path) -> None:
        for name, part in parts.items():
            part.save_pretrained(folder / name)

    return write_layouts(out_dir, "flux3", write_components, single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_flux3_fixture,
    # every part as a single file (the tokenizer from its folder)
    model_section=model_section(
        "flux3", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=TEXT_ENCODER_FILE
    ),
)
