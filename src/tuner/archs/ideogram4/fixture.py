"""A tiny random-weight Ideogram 4 model, written in both layouts users have.

The models are built from the `tiny` configs shipped in `configs/` (transformer: 2 heads of 32, 2 blocks,
text features 13 x 32; Qwen3-VL: a language model of 36 layers of width 32, so the pipeline's layer 35
exists, and a one-block vision tower) and FLUX.2's tiny VAE (`tuner.archs.flux2`: the real 8x compression,
32 channels, BatchNorm statistics drawn away from 0 / 1), so loaders recognise them like real
checkpoints. The tokenizer is a byte-level BPE with a chat template that writes Qwen3-VL's turn for one
user text message (`tuner.archs.ideogram4.text`). The diffusers pipeline's unconditional transformer is
the conditional one (the fixture has one transformer).

    out_dir/
      diffusers/                    what `Ideogram4Pipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  unconditional_transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/                       the ComfyUI single-file layout
        ideogram4_tiny.safetensors  the release's keys (layers.0.attention.qkv.weight, ...)
        flux2-vae.safetensors       the FLUX.2 VAE's LDM keys
        qwen3vl_tiny.safetensors    Hugging Face Qwen3-VL keys (model.language_model..., model.visual...)
        tokenizer/

Both layouts hold the same float32 weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline, Ideogram4Transformer2DModel
from transformers import Qwen3VLConfig, Qwen3VLModel, Qwen3VLTextConfig

from tuner.archs.flux2.fixture import build_flux2_components
from tuner.archs.flux2.keys import vae_to_original
from tuner.archs.ideogram4.keys import IDEOGRAM4_LAYOUT
from tuner.archs.ideogram4.text import PREFIX, SUFFIX
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.tokenizers import build_qwen2_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "ideogram4_tiny.safetensors"
VAE_FILE = "flux2-vae.safetensors"
TEXT_ENCODER_FILE = "qwen3vl_tiny.safetensors"

# Qwen3-VL's chat template, reduced to a user message of text parts and the generation prompt
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- for part in message['content'] %}{{- part['text'] }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                    num_position_embeddings=64, deepstack_visual_indexes=[0])  # fmt: skip


def build_ideogram4_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments of
    `Ideogram4Pipeline` (its unconditional transformer is the conditional one)."""
    text = Qwen3VLTextConfig.from_pretrained(tiny_config("ideogram4", "text_encoder"))
    config = Qwen3VLConfig(text_config=text.to_dict(), vision_config=_TINY_VISION, tie_word_embeddings=False)
    text_encoder = tiny_model(Qwen3VLModel, config, seed + 2)
    tokenizer = build_qwen2_tokenizer([PREFIX, SUFFIX])
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) <= text.vocab_size, "the tiny vocabulary outgrew the tiny config"
    transformer = _quiet_gates_(
        tiny_model(Ideogram4Transformer2DModel, tiny_config("ideogram4", "transformer"), seed)
    )
    return {
        "transformer": transformer,
        "unconditional_transformer": transformer,
        "vae": build_flux2_components(seed)["vae"],
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0),
    }


@torch.no_grad()
def _quiet_gates_(transformer: Ideogram4Transformer2DModel) -> Ideogram4Transformer2DModel:
    """Scale the blocks' modulation by 1/4: a trained model's gates are small, a random one's let each block
    replace the residual stream, and fp8 rounding then compounds past the contract suite's bound."""
    for name, param in transformer.named_parameters():
        if ".adaln_modulation." in name:
            param.mul_(0.25)
    return transformer


def write_ideogram4_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Ideogram 4 model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file, tokenizer.
    """
    parts = build_ideogram4_components(seed)
    vae = {k: v for k, v in parts["vae"].state_dict().items() if k != "bn.num_batches_tracked"}
    single = {
        "transformer_file": (
            TRANSFORMER_FILE,
            IDEOGRAM4_LAYOUT.to_original(parts["transformer"].state_dict()),
        ),
        "vae_file": (VAE_FILE, vae_to_original(vae, len(parts["vae"].config.block_out_channels))),
        "text_encoder_file": (
            TEXT_ENCODER_FILE,
            {f"model.{k}": v for k, v in parts["text_encoder"].state_dict().items()},
        ),
    }
    return write_layouts(out_dir, "ideogram4", Ideogram4Pipeline(**parts), single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_ideogram4_fixture,
    # every part as a ComfyUI single file (the tokenizer from its folder)
    model_section=model_section(
        "ideogram4", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=TEXT_ENCODER_FILE
    ),
)
