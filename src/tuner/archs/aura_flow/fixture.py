"""A tiny random-weight AuraFlow model, written in both layouts users have.

The models are built from the `tiny` configs shipped in `configs/` (transformer: 2 heads of 32, one joint
block and two single-stream blocks, a 16² position table; Pile-T5: a UMT5 encoder of 2 layers of width
64) and SDXL's tiny VAE (`tuner.archs.sdxl`: the real 8x compression and 4 channels), so loaders recognise
them like real checkpoints. The tokenizer is a T5 Unigram over the caption words.

    out_dir/
      diffusers/                      what `AuraFlowPipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/
        aura_flow_0.3_tiny.safetensors  fal's release keys (double_layers.0.attn.w1q.weight, ...)
        sdxl_vae.safetensors            the SDXL VAE in the LDM layout
        pile_t5xl_tiny.safetensors      transformers' UMT5 keys, the embedding once as `shared.weight`
        tokenizer/

Both layouts hold the same float32 weights.
"""

from __future__ import annotations

from pathlib import Path

from diffusers import (
    AuraFlowPipeline,
    AuraFlowTransformer2DModel,
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
)
from transformers import UMT5EncoderModel

from tuner.archs.aura_flow.keys import AURA_FLOW_LAYOUT
from tuner.archs.flux.fixture import ldm_vae_file
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import t5_file
from tuner.fixtures.tokenizers import build_t5_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "aura_flow_0.3_tiny.safetensors"
VAE_FILE = "sdxl_vae.safetensors"
TEXT_ENCODER_FILE = "pile_t5xl_tiny.safetensors"

SCHEDULER_SHIFT = 1.73
"""AuraFlow's scheduler (`fal/AuraFlow-v0.3` `scheduler/`: FlowMatchEulerDiscreteScheduler, shift 1.73)."""


def build_aura_flow_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments of
    `AuraFlowPipeline` (tokenizer, text_encoder, vae, transformer, scheduler)."""
    return {
        "tokenizer": build_t5_tokenizer(),
        "text_encoder": tiny_model(UMT5EncoderModel, tiny_config("aura_flow", "text_encoder"), seed + 2),
        "vae": tiny_model(AutoencoderKL, tiny_config("sdxl", "vae"), seed + 1),
        "transformer": tiny_model(AuraFlowTransformer2DModel, tiny_config("aura_flow", "transformer"), seed),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_SHIFT),
    }


def write_aura_flow_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny AuraFlow under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file, tokenizer (the
    single-file layout's tokenizer folder). Existing `diffusers/` and `single/` folders under `out_dir` are
    replaced only once the new ones are complete.
    """
    parts = build_aura_flow_components(seed)
    single = {
        "transformer_file": (
            TRANSFORMER_FILE,
            AURA_FLOW_LAYOUT.to_original(parts["transformer"].state_dict()),
        ),
        "vae_file": (VAE_FILE, ldm_vae_file(parts["vae"])),
        "text_encoder_file": (TEXT_ENCODER_FILE, t5_file(parts["text_encoder"])),
    }
    pipe = AuraFlowPipeline(**parts)
    return write_layouts(out_dir, "aura_flow", pipe, single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_aura_flow_fixture,
    # every part as a single file (the tokenizer from its folder), as ComfyUI users hold them
    model_section=model_section(
        "aura_flow", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=TEXT_ENCODER_FILE
    ),
)
