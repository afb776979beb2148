"""A tiny random-weight HunyuanVideo 1.5 text-to-video model, written in both layouts users have.

The models are built from the `tiny` configs shipped with `tuner.archs.hunyuan_video15.loaders` (transformer:
2 heads of 32, one double block and one refiner block; VAE: widths 32-64 with the real 16× spatial / 4×
temporal compression and the real 32 latent channels; ByT5: one layer of width 64) and Qwen-Image's tiny
Qwen2.5-VL (2 layers of width 64, of which the pipeline uses the language model). The Qwen tokenizer is
learned from the system message, and ByT5's is byte-level (it needs no files).

    out_dir/
      diffusers/                      what `HunyuanVideo15Pipeline.from_pretrained` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  text_encoder_2/  tokenizer_2/
        scheduler/  guider/
      single/                         Tencent's and ComfyUI's single files
        hunyuanvideo1.5_480p_t2v_tiny.safetensors   ComfyUI's: fused q/k/v (double_blocks.0.img_attn_qkv...)
        hunyuanvideo1.5_480p_t2v_tencent_tiny.safetensors   Tencent's: separate (double_blocks.0.img_attn_q...)
        hunyuanvideo15_vae_tiny.safetensors         Tencent's VAE names (encoder.down.0.block.0...)
        qwen_2.5_vl_tiny.safetensors                ComfyUI's Qwen2.5-VL (model.layers..., visual..., lm_head)
        byt5_small_glyphxl_tiny.safetensors         transformers' T5EncoderModel names
        tokenizer/  tokenizer_2/

All layouts hold the same float32 weights: the single files are the diffusers state dicts renamed by
tuner's own converters. The I2V fixture writes its transformer in both single-file layouts too
(`..._i2v_tiny` / `..._i2v_tencent_tiny`); the training configs read ComfyUI's.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from transformers import ByT5Tokenizer, SiglipImageProcessorPil, SiglipVisionModel, T5EncoderModel

from tuner.archs.hunyuan_video15.keys import TENCENT_LAYOUT, transformer_to_original
from tuner.archs.hunyuan_video15.loaders import QWEN_CHAT_TEMPLATE, SYSTEM_MESSAGE, vae_key_to_original
from tuner.archs.qwen_image.fixture import qwen_vl_file, tiny_qwen_vl
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import t5_file, vision_tower_file
from tuner.fixtures.tokenizers import build_qwen2_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "hunyuanvideo1.5_480p_t2v_tiny.safetensors"
VAE_FILE = "hunyuanvideo15_vae_tiny.safetensors"
QWEN_FILE = "qwen_2.5_vl_tiny.safetensors"
BYT5_FILE = "byt5_small_glyphxl_tiny.safetensors"
I2V_TRANSFORMER_FILE = "hunyuanvideo1.5_480p_i2v_tiny.safetensors"
TENCENT_FILES = {False: "hunyuanvideo1.5_480p_t2v_tencent_tiny.safetensors",
                 True: "hunyuanvideo1.5_480p_i2v_tencent_tiny.safetensors"}  # fmt: skip
SIGLIP_FILE = "sigclip_vision_tiny.safetensors"
SHIFT = 5.0  # the 480p releases' scheduler shift


def build_hunyuan_video15_components(seed: int = 0, i2v: bool = False) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: the arguments of `HunyuanVideo15Pipeline` (`i2v`: of `HunyuanVideo15ImageToVideoPipeline`,
    with the I2V transformer, its own weights, and the SigLIP encoder), and `qwen_full` (the whole
    Qwen2.5-VL model whose language model is `text_encoder`, as ComfyUI's file holds it).
    """
    family = "hunyuan_video15"
    qwen = tiny_qwen_vl(seed + 2)
    tokenizer = build_qwen2_tokenizer([SYSTEM_MESSAGE, "system\nuser\nassistant\n"])
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    assert len(tokenizer) <= qwen.config.text_config.vocab_size, "the tiny vocabulary outgrew the tiny config"
    image = {}
    if i2v:
        siglip = tiny_config(family, "siglip")
        image = {
            "image_encoder": tiny_model(SiglipVisionModel, siglip, seed + 4),
            "feature_extractor": SiglipImageProcessorPil.from_pretrained(siglip),
        }
    transformer = tiny_config(family, "transformer", "tiny_i2v" if i2v else "tiny")
    return {
        **image,
        # I2V: other weights, same shapes
        "transformer": tiny_model(HunyuanVideo15Transformer3DModel, transformer, seed + (10 if i2v else 0)),
        "vae": tiny_model(AutoencoderKLHunyuanVideo15, tiny_config(family, "vae"), seed + 1),
        "text_encoder": qwen.model.language_model,
        "tokenizer": tokenizer,
        "text_encoder_2": tiny_model(T5EncoderModel, tiny_config(family, "byt5"), seed + 3),
        "tokenizer_2": ByT5Tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        "guider": ClassifierFreeGuidance(guidance_scale=6.0),
        "qwen_full": qwen,
    }


def write_hunyuan_video15_fixture(out_dir: str | Path, seed: int = 0, i2v: bool = False) -> dict[str, Path]:
    """Write the tiny HunyuanVideo 1.5 model (`i2v`: the image-to-video one) under `out_dir` in both
    layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file (ComfyUI's layout), tencent_transformer_file
    (Tencent's), vae_file, text_encoder_file (Qwen2.5-VL), text_encoder_2_file (ByT5), tokenizer,
    tokenizer_2 (the single-file layout's tokenizer folders);
    I2V adds image_encoder_file (SigLIP).
    """
    parts = build_hunyuan_video15_components(seed, i2v)
    qwen = parts.pop("qwen_full")
    transformer = parts["transformer"].state_dict()
    single = {
        "transformer_file": (
            I2V_TRANSFORMER_FILE if i2v else TRANSFORMER_FILE,
            transformer_to_original(transformer),
        ),
        "tencent_transformer_file": (TENCENT_FILES[i2v], TENCENT_LAYOUT.to_original(transformer)),
        "vae_file": (VAE_FILE, {vae_key_to_original(k): v for k, v in parts["vae"].state_dict().items()}),
        "text_encoder_file": (QWEN_FILE, qwen_vl_file(qwen)),
        "text_encoder_2_file": (BYT5_FILE, t5_file(parts["text_encoder_2"])),
    }
    if i2v:  # ComfyUI's SigLIP file: transformers 4 names (`vision_model.*`)
        single["image_encoder_file"] = (SIGLIP_FILE, vision_tower_file(parts["image_encoder"]))
    pipeline = (HunyuanVideo15ImageToVideoPipeline if i2v else HunyuanVideo15Pipeline)(**parts)
    label = "hunyuan_video15_i2v" if i2v else "hunyuan_video15"
    return write_layouts(out_dir, label, pipeline, single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_hunyuan_video15_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=model_section(
        "hunyuan_video15",
        transformer=TRANSFORMER_FILE,
        vae=VAE_FILE,
        text_encoder=QWEN_FILE,
        text_encoder_2=BYT5_FILE,
    ),
)

I2V_FIXTURE = Fixture(
    write=partial(write_hunyuan_video15_fixture, i2v=True),
    # the transformer and SigLIP from their single files, the rest from the diffusers folder
    model_section=model_section(
        "hunyuan_video15_i2v",
        transformer=I2V_TRANSFORMER_FILE,
        image_encoder=SIGLIP_FILE,
        vae="diffusers",
        text_encoder="diffusers",
    ),
)
