"""A tiny random-weight HunyuanVideo text-to-video model, written in both layouts users have.

The models are built from the `tiny` configs shipped with `tuner.archs.hunyuan_video.loaders` (transformer: 2
heads of 32, one double, one single and one refiner block; VAE: widths 32-64 with the real 4× temporal /
8× spatial compression and 16 latent channels; Llama: 3 layers of width 64; CLIP: FLUX.1's tiny CLIP), so
loaders recognise them like real checkpoints. The Llama tokenizer is learned from the prompt template, so
the template's first 95 tokens are what the real tokenizer gives (the pipeline's crop).

    out_dir/
      diffusers/                      what `HunyuanVideoPipeline.from_pretrained` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  text_encoder_2/  tokenizer_2/
        scheduler/
      single/                         Tencent's and ComfyUI's single files
        hunyuan_video_t2v_tiny.safetensors   Tencent keys (double_blocks.0.img_attn_qkv.weight, ...)
        hunyuan_video_vae_tiny.safetensors   ComfyUI's VAE file (diffusers names)
        llava_llama3_tiny.safetensors        ComfyUI's layout (LlamaForCausalLM: model.layers..., lm_head)
        clip_l.safetensors                   ComfyUI's CLIP layout (text_model.encoder.layers.0...)
        tokenizer/  tokenizer_2/

Both layouts hold the same float32 weights: the single files are the diffusers state dicts renamed by
tuner's own converter (`tuner.archs.hunyuan_video.keys`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
)
from transformers import CLIPTextModel, LlamaModel

from tuner.archs.hunyuan_video.keys import transformer_to_original
from tuner.archs.hunyuan_video.loaders import PROMPT_TEMPLATE
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import clip_text_file, prefixed
from tuner.fixtures.tokenizers import build_clip_tokenizer, build_llama3_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "hunyuan_video_t2v_tiny.safetensors"
VAE_FILE = "hunyuan_video_vae_tiny.safetensors"
LLAMA_FILE = "llava_llama3_tiny.safetensors"
CLIP_FILE = "clip_l.safetensors"


def build_hunyuan_video_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: the arguments of `HunyuanVideoPipeline` (transformer, vae, text_encoder, tokenizer,
    text_encoder_2, tokenizer_2, scheduler).
    """
    llama = tiny_model(LlamaModel, tiny_config("hunyuan_video", "llama"), seed + 2)
    tokenizer = build_llama3_tokenizer([PROMPT_TEMPLATE])
    assert len(tokenizer) <= llama.config.vocab_size, "the tiny Llama's vocabulary is too small"
    return {
        "transformer": tiny_model(
            HunyuanVideoTransformer3DModel, tiny_config("hunyuan_video", "transformer"), seed
        ),
        "vae": tiny_model(AutoencoderKLHunyuanVideo, tiny_config("hunyuan_video", "vae"), seed + 1),
        "text_encoder": llama,
        "tokenizer": tokenizer,
        "text_encoder_2": tiny_model(CLIPTextModel, tiny_config("flux", "clip"), seed + 3),
        "tokenizer_2": build_clip_tokenizer(),
        # HunyuanVideo's release: flow-matching Euler with shift 7
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
    }


def single_files(parts: dict, seed: int) -> dict[str, tuple[str, dict]]:
    """The single files, as `write_layouts` takes them (FramePack's fixture writes them too)."""
    # ComfyUI's Llama file is a LlamaForCausalLM state dict: the model under `model.`, plus an lm_head
    llama = prefixed("model.", parts["text_encoder"].state_dict())
    embed = llama["model.embed_tokens.weight"]
    llama["lm_head.weight"] = torch.randn(embed.shape, generator=torch.Generator().manual_seed(seed))
    return {
        "transformer_file": (TRANSFORMER_FILE, transformer_to_original(parts["transformer"].state_dict())),
        "vae_file": (VAE_FILE, parts["vae"].state_dict()),
        "text_encoder_file": (LLAMA_FILE, llama),
        "text_encoder_2_file": (CLIP_FILE, clip_text_file(parts["text_encoder_2"])),
    }


def write_hunyuan_video_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny HunyuanVideo model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file (Llama),
    text_encoder_2_file (CLIP), tokenizer, tokenizer_2 (the single-file layout's tokenizer folders).
    """
    parts = build_hunyuan_video_components(seed)
    pipeline = HunyuanVideoPipeline(**parts)
    return write_layouts(
        out_dir, "hunyuan_video", pipeline, single_files(parts, seed), tokenizer_folders(parts)
    )


FIXTURE = Fixture(
    write=write_hunyuan_video_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=model_section(
        "hunyuan_video",
        transformer=TRANSFORMER_FILE,
        vae=VAE_FILE,
        text_encoder=LLAMA_FILE,
        text_encoder_2=CLIP_FILE,
    ),
)
