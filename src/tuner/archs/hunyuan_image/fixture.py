"""A tiny random-weight HunyuanImage 2.1 model (base, or `distilled`), written in the layouts users have.

The models are built from the `tiny` configs in `configs/` (transformer: 2 heads of 32, one double, one
single and one refiner block, 2D rotary axes 16 + 16; `tiny_distilled` adds the guidance and MeanFlow
embedders; VAE: widths 32-128 with the real 32× compression and 64 channels), HunyuanVideo 1.5's tiny
ByT5 (one layer of width 64) and Qwen-Image's tiny Qwen2.5-VL (2 layers of width 64). The Qwen tokenizer
is learned from the prompt template, so the template drops as many tokens (34) as with the real one;
ByT5's is byte-level (it needs no files).

    out_dir/
      diffusers/                          what `HunyuanImagePipeline.from_pretrained` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  text_encoder_2/  tokenizer_2/
        scheduler/  guider/
      single/                             the release's and ComfyUI's single files
        hunyuanimage2.1_tiny.safetensors  fused q/k/v and linear1 (double_blocks.0.img_attn_qkv, ...)
        hunyuan_image_2.1_vae_tiny.safetensors   Tencent's VAE names (encoder.down.0.block.0...)
        qwen_2.5_vl_tiny.safetensors      ComfyUI's Qwen2.5-VL (model.layers..., visual..., lm_head)
        byt5_small_glyphxl_tiny.safetensors   transformers' T5EncoderModel names
        tokenizer/  tokenizer_2/

All layouts hold the same float32 weights: the single files are the diffusers state dicts renamed by
tuner's own converters. The distilled fixture names its transformer `hunyuanimage2.1_distilled_tiny`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from diffusers import (
    AutoencoderKLHunyuanImage,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanImagePipeline,
    HunyuanImageTransformer2DModel,
)
from transformers import ByT5Tokenizer, T5EncoderModel

from tuner.archs.hunyuan_image.keys import HUNYUAN_IMAGE_LAYOUT
from tuner.archs.hunyuan_image.loaders import vae_to_original
from tuner.archs.hunyuan_image.text import TEMPLATE
from tuner.archs.qwen_image.fixture import qwen_vl_file, tiny_qwen_vl
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import t5_file
from tuner.fixtures.tokenizers import build_qwen2_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILES = {
    False: "hunyuanimage2.1_tiny.safetensors",
    True: "hunyuanimage2.1_distilled_tiny.safetensors",
}
VAE_FILE = "hunyuan_image_2.1_vae_tiny.safetensors"
QWEN_FILE = "qwen_2.5_vl_tiny.safetensors"
BYT5_FILE = "byt5_small_glyphxl_tiny.safetensors"
SHIFT = 5.0  # the base model's sampling shift (ComfyUI's workflow; the distilled samples at 4)
GUIDANCE = 3.5  # the base model's guidance scale


def build_hunyuan_image_components(seed: int = 0, distilled: bool = False) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments of
    `HunyuanImagePipeline`, its guider plain CFG (the release's mixes in APG: `AdaptiveProjectedMixGuidance`)."""
    family = "hunyuan_image"
    qwen = tiny_qwen_vl(seed + 2)
    tokenizer = build_qwen2_tokenizer([TEMPLATE.replace("{}", "\n"), "system\nuser\n"])
    assert len(tokenizer) <= qwen.config.text_config.vocab_size, "the tiny vocabulary outgrew the tiny config"
    transformer = tiny_config(family, "transformer", "tiny_distilled" if distilled else "tiny")
    return {
        "transformer": tiny_model(
            HunyuanImageTransformer2DModel, transformer, seed + (10 if distilled else 0)
        ),
        "vae": tiny_model(AutoencoderKLHunyuanImage, tiny_config(family, "vae"), seed + 1),
        "text_encoder": qwen,
        "tokenizer": tokenizer,
        "text_encoder_2": tiny_model(T5EncoderModel, tiny_config("hunyuan_video15", "byt5"), seed + 3),
        "tokenizer_2": ByT5Tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=4.0 if distilled else SHIFT),
        "guider": None if distilled else ClassifierFreeGuidance(guidance_scale=GUIDANCE),
    }


def write_hunyuan_image_fixture(
    out_dir: str | Path, seed: int = 0, distilled: bool = False
) -> dict[str, Path]:
    """Write the tiny HunyuanImage 2.1 model (`distilled`: the distilled one) under `out_dir` in both
    layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file (Qwen2.5-VL),
    text_encoder_2_file (ByT5), tokenizer, tokenizer_2 (the single-file layout's tokenizer folders).
    """
    parts = build_hunyuan_image_components(seed, distilled)
    single = {
        "transformer_file": (
            TRANSFORMER_FILES[distilled],
            HUNYUAN_IMAGE_LAYOUT.to_original(parts["transformer"].state_dict()),
        ),
        "vae_file": (VAE_FILE, vae_to_original(parts["vae"].state_dict())),
        "text_encoder_file": (QWEN_FILE, qwen_vl_file(parts["text_encoder"])),
        "text_encoder_2_file": (BYT5_FILE, t5_file(parts["text_encoder_2"])),
    }
    label = "hunyuan_image_distilled" if distilled else "hunyuan_image"
    return write_layouts(out_dir, label, HunyuanImagePipeline(**parts), single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_hunyuan_image_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=model_section(
        "hunyuan_image",
        transformer=TRANSFORMER_FILES[False],
        vae=VAE_FILE,
        text_encoder=QWEN_FILE,
        text_encoder_2=BYT5_FILE,
    ),
)

DISTILLED_FIXTURE = Fixture(
    write=partial(write_hunyuan_image_fixture, distilled=True),
    model_section=model_section(
        "hunyuan_image", transformer=TRANSFORMER_FILES[True], vae="diffusers", text_encoder="diffusers"
    ),
)
"""The distilled model (the models test reads it; the contract suite trains the base)."""
