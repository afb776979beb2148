"""A tiny random-weight OmniGen2, written in the layouts users have.

Built from the `tiny` transformer config shipped in `configs/` (4 query heads and 2 key/value heads of 32,
rotary axes 8 + 12 + 12, one refiner block of each kind, 2 layers, text width 64), FLUX.1's tiny VAE (the
real 8× compression and 16 latent channels) and Qwen-Image's tiny Qwen2.5-VL (2 layers of width 64, a
2-block vision tower), so loaders recognise them like real checkpoints. The Qwen2 tokenizer is learned
offline from OmniGen2's chat template and caption words.

    out_dir/
      diffusers/                        the release's folder layout (`OmniGen2/OmniGen2`)
        model_index.json  transformer/  vae/  mllm/ (Qwen2_5_VLForConditionalGeneration)  processor/
      single/
        omnigen2_tiny.safetensors       the transformer: the release's keys, as ComfyUI's file holds them
        ae.safetensors                  the FLUX.1 VAE in the LDM layout
        qwen_2.5_vl_tiny.safetensors    ComfyUI's Qwen2.5-VL layout (model.layers..., visual..., lm_head)
        tokenizer/

Both layouts hold the same float32 weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusers import AutoencoderKL

from tuner.archs.flux.fixture import ldm_vae_file
from tuner.archs.omnigen2.loaders import PROMPT_TEMPLATE
from tuner.archs.omnigen2.model import OmniGen2Transformer2DModel
from tuner.archs.qwen_image.fixture import qwen_vl_file, tiny_qwen_vl
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.tokenizers import build_qwen2_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "omnigen2_tiny.safetensors"
VAE_FILE = "ae.safetensors"
TEXT_ENCODER_FILE = "qwen_2.5_vl_tiny.safetensors"

# the components of the release's model_index.json that tuner reads (its scheduler is the release's own
# class, which tuner does not use)
MODEL_INDEX = {
    "_class_name": "OmniGen2Pipeline",
    "mllm": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "processor": ["transformers", "Qwen2_5_VLProcessor"],
    "transformer": ["omnigen2", "OmniGen2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def build_omnigen2_components(seed: int = 0) -> dict:
    """The tiny model's parts (eval mode, float32), deterministic given `seed`: transformer, vae,
    text_encoder (the full Qwen2.5-VL, as the release's `mllm/` holds it) and tokenizer."""
    text_encoder = tiny_qwen_vl(seed + 2)
    tokenizer = build_qwen2_tokenizer([PROMPT_TEMPLATE.replace("{}", "\n")])
    assert len(tokenizer) <= text_encoder.config.text_config.vocab_size, (
        "the tiny vocabulary outgrew the config"
    )
    return {
        "transformer": tiny_model(OmniGen2Transformer2DModel, tiny_config("omnigen2", "transformer"), seed),
        "vae": tiny_model(AutoencoderKL, tiny_config("flux", "vae"), seed + 1),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
    }


def write_omnigen2_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny OmniGen2 under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (the release-style folder), transformer_file, vae_file, text_encoder_file,
    tokenizer (the single-file layout's tokenizer folder).
    """
    parts = build_omnigen2_components(seed)

    def release_folder(folder: Path) -> None:
        parts["transformer"].save_pretrained(folder / "transformer", safe_serialization=True)
        parts["vae"].save_pretrained(folder / "vae", safe_serialization=True)
        parts["text_encoder"].save_pretrained(folder / "mllm", safe_serialization=True)
        parts["tokenizer"].save_pretrained(folder / "processor")
        (folder / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2) + "\n")

    single = {
        "transformer_file": (TRANSFORMER_FILE, parts["transformer"].state_dict()),
        "vae_file": (VAE_FILE, ldm_vae_file(parts["vae"])),
        "text_encoder_file": (TEXT_ENCODER_FILE, qwen_vl_file(parts["text_encoder"])),
    }
    return write_layouts(out_dir, "omnigen2", release_folder, single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_omnigen2_fixture,
    # every part as a ComfyUI single file (the tokenizer from its folder)
    model_section=model_section(
        "omnigen2", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=TEXT_ENCODER_FILE
    ),
)
