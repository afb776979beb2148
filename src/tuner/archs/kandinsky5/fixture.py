"""A tiny random-weight Kandinsky 5 Lite text-to-video model, written in both layouts users have.

The models are built from the `tiny` configs shipped with tuner (transformer: 2 heads of 32, one text
and two visual blocks, `visual_cond` as the Lite release; VAE: HunyuanVideo's tiny one; Qwen2.5-VL:
Qwen-Image's tiny one; CLIP: FLUX.1's tiny one), so loaders recognise them like real checkpoints. The
Qwen tokenizer is learned from the prompt template, whose prefix it cuts into the pipeline's 128 tokens.

    out_dir/
      diffusers/                      what `Kandinsky5T2VPipeline.from_pretrained` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  text_encoder_2/  tokenizer_2/
        scheduler/
      single/                         the release's and ComfyUI's single files
        kandinsky5lite_t2v_sft_5s_tiny.safetensors   release keys = diffusers keys
        hunyuan_video_vae_tiny.safetensors           ComfyUI's VAE file (diffusers names)
        qwen_2.5_vl_tiny.safetensors                 original Qwen2.5-VL keys (model.layers..., visual..., lm_head)
        clip_l.safetensors                           ComfyUI's CLIP layout (text_model.encoder.layers.0...)
        tokenizer/  tokenizer_2/

Both layouts hold the same float32 weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5T2VPipeline,
    Kandinsky5Transformer3DModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from tuner.archs.flux.loaders import CLIP_VARIANTS
from tuner.archs.hunyuan_video.loaders import VAE_VARIANTS
from tuner.archs.kandinsky5.loaders import PROMPT_TEMPLATE, SAMPLE_SHIFT, TRANSFORMER_VARIANTS
from tuner.archs.qwen_image.text import VARIANTS as QWEN_VARIANTS
from tuner.archs.qwen_image.text import original_key
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_clip_tokenizer, build_qwen2_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors

TRANSFORMER_FILE = "kandinsky5lite_t2v_sft_5s_tiny.safetensors"
VAE_FILE = "hunyuan_video_vae_tiny.safetensors"
QWEN_FILE = "qwen_2.5_vl_tiny.safetensors"
CLIP_FILE = "clip_l.safetensors"


def _tiny(variants) -> Path:
    return next(v.config_dir for v in variants if v.name == "tiny")


# Words of the template that are more than one token in Qwen's vocabulary (the template's "scren" typo,
# "dynamism"): learned split, so the template's prefix is the pipeline's CROP_START (128) tokens.
_SPLIT_WORDS = (("scren", "scr en"), ("dynamism", "dynam ism"))


def _tokenizer_corpus() -> str:
    text = PROMPT_TEMPLATE.replace("{}", "\n")
    for word, pieces in _SPLIT_WORDS:
        text = text.replace(word, pieces)
    return text


def build_kandinsky5_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments
    of `Kandinsky5T2VPipeline`."""
    with torch.random.fork_rng(devices=[]):  # constructors draw from the global generator
        transformer = Kandinsky5Transformer3DModel.from_config(
            Kandinsky5Transformer3DModel.load_config(_tiny(TRANSFORMER_VARIANTS))
        )
        vae = AutoencoderKLHunyuanVideo.from_config(
            AutoencoderKLHunyuanVideo.load_config(_tiny(VAE_VARIANTS))
        )
        config = Qwen2_5_VLConfig.from_pretrained(_tiny(QWEN_VARIANTS))
        qwen = Qwen2_5_VLForConditionalGeneration(config)
        clip = CLIPTextModel(CLIPTextConfig.from_pretrained(_tiny(CLIP_VARIANTS)))
    fill_random_(transformer, seed)
    fill_random_(vae, seed + 1)
    fill_random_(qwen, seed + 2)
    fill_random_(clip, seed + 3)
    tokenizer = build_qwen2_tokenizer([_tokenizer_corpus()])
    assert len(tokenizer) <= config.text_config.vocab_size, "the tiny vocabulary outgrew the tiny config"
    return {
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "text_encoder": qwen.eval(),
        "tokenizer": tokenizer,
        "text_encoder_2": clip.eval(),
        "tokenizer_2": build_clip_tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=SAMPLE_SHIFT),  # the Lite T2V release's
    }


def write_kandinsky5_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Kandinsky 5 model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file (Qwen),
    text_encoder_2_file (CLIP), tokenizer, tokenizer_2 (the single-file layout's tokenizer folders).
    """
    out = Path(out_dir)
    parts = build_kandinsky5_components(seed)

    def write(staging: Path) -> None:
        Kandinsky5T2VPipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        _write_single_files(staging / "single", parts)

    publish_layouts(out, "kandinsky5", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "transformer_file": single / TRANSFORMER_FILE,
        "vae_file": single / VAE_FILE,
        "text_encoder_file": single / QWEN_FILE,
        "text_encoder_2_file": single / CLIP_FILE,
        "tokenizer": single / "tokenizer",
        "tokenizer_2": single / "tokenizer_2",
    }


def _write_single_files(folder: Path, parts: dict) -> None:
    folder.mkdir(parents=True)
    save_safetensors(parts["transformer"].state_dict(), folder / TRANSFORMER_FILE)
    save_safetensors(parts["vae"].state_dict(), folder / VAE_FILE)
    qwen = parts["text_encoder"].state_dict()
    save_safetensors(
        {(k if k == "lm_head.weight" else original_key(k)): v for k, v in qwen.items()}, folder / QWEN_FILE
    )
    save_safetensors(
        {f"text_model.{k}": v for k, v in parts["text_encoder_2"].state_dict().items()}, folder / CLIP_FILE
    )
    parts["tokenizer"].save_pretrained(folder / "tokenizer")
    parts["tokenizer_2"].save_pretrained(folder / "tokenizer_2")


FIXTURE = Fixture(
    write=write_kandinsky5_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=f"""\
architecture = "kandinsky5"
transformer = "{{root}}/single/{TRANSFORMER_FILE}"
vae = "{{root}}/single/{VAE_FILE}"
text_encoder = "{{root}}/single/{QWEN_FILE}"
tokenizer = "{{root}}/single/tokenizer"
text_encoder_2 = "{{root}}/single/{CLIP_FILE}"
tokenizer_2 = "{{root}}/single/tokenizer_2"
""",
)
