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

from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5T2VPipeline,
    Kandinsky5Transformer3DModel,
)
from transformers import CLIPTextModel

from tuner.archs.kandinsky5.loaders import PROMPT_TEMPLATE, SAMPLE_SHIFT
from tuner.archs.qwen_image.fixture import qwen_vl_file, tiny_qwen_vl
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import clip_text_file
from tuner.fixtures.tokenizers import build_clip_tokenizer, build_qwen2_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "kandinsky5lite_t2v_sft_5s_tiny.safetensors"
VAE_FILE = "hunyuan_video_vae_tiny.safetensors"
QWEN_FILE = "qwen_2.5_vl_tiny.safetensors"
CLIP_FILE = "clip_l.safetensors"

# Words of the template that are more than one token in Qwen's vocabulary (the template's "scren" typo,
# "dynamism"): learned split, so the template's prefix is the pipeline's CROP_START (128) tokens.
_SPLIT_WORDS = (("scren", "scr en"), ("dynamism", "dynam ism"))


def template_tokenizer(template: str, split_words: tuple[tuple[str, str], ...]):
    """A tiny Qwen2 tokenizer learned from a prompt template, the `split_words` (word, pieces) learned
    as their pieces so that the template's prefix is as many tokens as the pipeline crops."""
    text = template.replace("{}", "\n")
    for word, pieces in split_words:
        text = text.replace(word, pieces)
    return build_qwen2_tokenizer([text])


def build_kandinsky5_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments
    of `Kandinsky5T2VPipeline`."""
    qwen = tiny_qwen_vl(seed + 2)
    tokenizer = template_tokenizer(PROMPT_TEMPLATE, _SPLIT_WORDS)
    assert len(tokenizer) <= qwen.config.text_config.vocab_size, "the tiny vocabulary outgrew the tiny config"
    return {
        "transformer": tiny_model(
            Kandinsky5Transformer3DModel, tiny_config("kandinsky5", "transformer"), seed
        ),
        "vae": tiny_model(AutoencoderKLHunyuanVideo, tiny_config("hunyuan_video", "vae"), seed + 1),
        "text_encoder": qwen,
        "tokenizer": tokenizer,
        "text_encoder_2": tiny_model(CLIPTextModel, tiny_config("flux", "clip"), seed + 3),
        "tokenizer_2": build_clip_tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=SAMPLE_SHIFT),  # the Lite T2V release's
    }


def write_kandinsky5_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Kandinsky 5 model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file (Qwen),
    text_encoder_2_file (CLIP), tokenizer, tokenizer_2 (the single-file layout's tokenizer folders).
    """
    parts = build_kandinsky5_components(seed)
    single = {
        "transformer_file": (TRANSFORMER_FILE, parts["transformer"].state_dict()),
        "vae_file": (VAE_FILE, parts["vae"].state_dict()),
        "text_encoder_file": (QWEN_FILE, qwen_vl_file(parts["text_encoder"])),
        "text_encoder_2_file": (CLIP_FILE, clip_text_file(parts["text_encoder_2"])),
    }
    return write_layouts(
        out_dir, "kandinsky5", Kandinsky5T2VPipeline(**parts), single, tokenizer_folders(parts)
    )


FIXTURE = Fixture(
    write=write_kandinsky5_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=model_section(
        "kandinsky5",
        transformer=TRANSFORMER_FILE,
        vae=VAE_FILE,
        text_encoder=QWEN_FILE,
        text_encoder_2=CLIP_FILE,
    ),
)
