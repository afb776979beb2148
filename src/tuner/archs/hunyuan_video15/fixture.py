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
        hunyuanvideo1.5_480p_t2v_tiny.safetensors   Tencent keys (double_blocks.0.img_attn_q.weight, ...)
        hunyuanvideo15_vae_tiny.safetensors         Tencent's VAE names (encoder.down.0.block.0...)
        qwen_2.5_vl_tiny.safetensors                ComfyUI's Qwen2.5-VL (model.layers..., visual..., lm_head)
        byt5_small_glyphxl_tiny.safetensors         transformers' T5EncoderModel names
        tokenizer/  tokenizer_2/

Both layouts hold the same float32 weights: the single files are the diffusers state dicts renamed by
tuner's own converters.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    SiglipImageProcessorPil,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
)

from tuner.archs.hunyuan_video15.keys import transformer_to_original
from tuner.archs.hunyuan_video15.loaders import (
    BYT5_VARIANTS,
    QWEN_CHAT_TEMPLATE,
    SYSTEM_MESSAGE,
    TRANSFORMER_VARIANTS,
    VAE_VARIANTS,
    vae_key_to_original,
)
from tuner.archs.hunyuan_video15.siglip import VARIANTS as SIGLIP_VARIANTS
from tuner.archs.qwen_image.text import VARIANTS as QWEN_VARIANTS
from tuner.archs.qwen_image.text import original_key
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_qwen2_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors
from tuner.models.identify import Variant

TRANSFORMER_FILE = "hunyuanvideo1.5_480p_t2v_tiny.safetensors"
VAE_FILE = "hunyuanvideo15_vae_tiny.safetensors"
QWEN_FILE = "qwen_2.5_vl_tiny.safetensors"
BYT5_FILE = "byt5_small_glyphxl_tiny.safetensors"
I2V_TRANSFORMER_FILE = "hunyuanvideo1.5_480p_i2v_tiny.safetensors"
SIGLIP_FILE = "sigclip_vision_tiny.safetensors"
SHIFT = 5.0  # the 480p releases' scheduler shift


def _tiny(variants: tuple[Variant, ...]) -> Path:
    return next(v.config_dir for v in variants if v.name == "tiny")


def build_hunyuan_video15_components(seed: int = 0, i2v: bool = False) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: the arguments of `HunyuanVideo15Pipeline` (`i2v`: of `HunyuanVideo15ImageToVideoPipeline`,
    with the I2V transformer, its own weights, and the SigLIP encoder), and `qwen_full` (the whole
    Qwen2.5-VL model whose language model is `text_encoder`, as ComfyUI's file holds it).
    """
    config_dir = TRANSFORMER_VARIANTS[1].config_dir.parent / ("tiny_i2v" if i2v else "tiny")
    with torch.random.fork_rng(devices=[]):  # constructors draw from the global generator
        transformer = HunyuanVideo15Transformer3DModel.from_config(
            HunyuanVideo15Transformer3DModel.load_config(config_dir)
        )
        vae = AutoencoderKLHunyuanVideo15.from_config(
            AutoencoderKLHunyuanVideo15.load_config(_tiny(VAE_VARIANTS))
        )
        config = Qwen2_5_VLConfig.from_pretrained(_tiny(QWEN_VARIANTS))
        qwen = Qwen2_5_VLForConditionalGeneration(config)
        byt5 = T5EncoderModel(T5Config.from_pretrained(_tiny(BYT5_VARIANTS)))
    fill_random_(transformer, seed + (10 if i2v else 0))  # I2V: other weights, same shapes
    fill_random_(vae, seed + 1)
    fill_random_(qwen, seed + 2)
    fill_random_(byt5, seed + 3)
    tokenizer = build_qwen2_tokenizer([SYSTEM_MESSAGE, "system\nuser\nassistant\n"])
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    assert len(tokenizer) <= config.text_config.vocab_size, "the tiny vocabulary outgrew the tiny config"
    image = {}
    if i2v:
        with torch.random.fork_rng(devices=[]):
            siglip = SiglipVisionModel(SiglipVisionConfig.from_pretrained(_tiny(SIGLIP_VARIANTS)))
        fill_random_(siglip, seed + 4)
        processor = SiglipImageProcessorPil.from_pretrained(_tiny(SIGLIP_VARIANTS))
        image = {"image_encoder": siglip.eval(), "feature_extractor": processor}
    return {
        **image,
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "text_encoder": qwen.model.language_model.eval(),
        "tokenizer": tokenizer,
        "text_encoder_2": byt5.eval(),
        "tokenizer_2": ByT5Tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        "guider": ClassifierFreeGuidance(guidance_scale=6.0),
        "qwen_full": qwen.eval(),
    }


def write_hunyuan_video15_fixture(out_dir: str | Path, seed: int = 0, i2v: bool = False) -> dict[str, Path]:
    """Write the tiny HunyuanVideo 1.5 model (`i2v`: the image-to-video one) under `out_dir` in both
    layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file (Qwen2.5-VL),
    text_encoder_2_file (ByT5), tokenizer, tokenizer_2 (the single-file layout's tokenizer folders);
    I2V adds image_encoder_file (SigLIP).
    """
    out = Path(out_dir)
    parts = build_hunyuan_video15_components(seed, i2v)
    pipeline_cls = HunyuanVideo15ImageToVideoPipeline if i2v else HunyuanVideo15Pipeline

    def write(staging: Path) -> None:
        pipeline = {k: v for k, v in parts.items() if k != "qwen_full"}
        pipeline_cls(**pipeline).save_pretrained(staging / "diffusers", safe_serialization=True)
        write_single_files(staging / "single", parts, i2v)

    publish_layouts(out, "hunyuan_video15_i2v" if i2v else "hunyuan_video15", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        **({"image_encoder_file": single / SIGLIP_FILE} if i2v else {}),
        "transformer_file": single / (I2V_TRANSFORMER_FILE if i2v else TRANSFORMER_FILE),
        "vae_file": single / VAE_FILE,
        "text_encoder_file": single / QWEN_FILE,
        "text_encoder_2_file": single / BYT5_FILE,
        "tokenizer": single / "tokenizer",
        "tokenizer_2": single / "tokenizer_2",
    }


def write_single_files(folder: Path, parts: dict, i2v: bool = False) -> None:
    folder.mkdir(parents=True)
    name = I2V_TRANSFORMER_FILE if i2v else TRANSFORMER_FILE
    save_safetensors(transformer_to_original(parts["transformer"].state_dict()), folder / name)
    if i2v:  # ComfyUI's SigLIP file: transformers 4 names (`vision_model.*`)
        siglip = parts["image_encoder"].state_dict()
        save_safetensors({f"vision_model.{k.removeprefix('vision_model.')}": v for k, v in siglip.items()},
                         folder / SIGLIP_FILE)  # fmt: skip
    save_safetensors(
        {vae_key_to_original(k): v for k, v in parts["vae"].state_dict().items()}, folder / VAE_FILE
    )
    qwen = parts["qwen_full"].state_dict()
    save_safetensors(
        {(k if k == "lm_head.weight" else original_key(k)): v for k, v in qwen.items()}, folder / QWEN_FILE
    )
    byt5 = parts["text_encoder_2"].state_dict()
    byt5.pop("encoder.embed_tokens.weight")  # tied to `shared.weight`; files store it once
    save_safetensors(byt5, folder / BYT5_FILE)
    parts["tokenizer"].save_pretrained(folder / "tokenizer")
    parts["tokenizer_2"].save_pretrained(folder / "tokenizer_2")


FIXTURE = Fixture(
    write=write_hunyuan_video15_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=f"""\
architecture = "hunyuan_video15"
transformer = "{{root}}/single/{TRANSFORMER_FILE}"
vae = "{{root}}/single/{VAE_FILE}"
text_encoder = "{{root}}/single/{QWEN_FILE}"
tokenizer = "{{root}}/single/tokenizer"
text_encoder_2 = "{{root}}/single/{BYT5_FILE}"
tokenizer_2 = "{{root}}/single/tokenizer_2"
""",
)

I2V_FIXTURE = Fixture(
    write=partial(write_hunyuan_video15_fixture, i2v=True),
    # the transformer and SigLIP from their single files, the rest from the diffusers folder
    model_section=f"""\
architecture = "hunyuan_video15_i2v"
transformer = "{{root}}/single/{I2V_TRANSFORMER_FILE}"
image_encoder = "{{root}}/single/{SIGLIP_FILE}"
vae = "{{root}}/diffusers"
text_encoder = "{{root}}/diffusers"
""",
)
