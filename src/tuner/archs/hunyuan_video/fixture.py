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
from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

from tuner.archs.flux.loaders import CLIP_VARIANTS
from tuner.archs.hunyuan_video.keys import transformer_to_original
from tuner.archs.hunyuan_video.loaders import (
    LLAMA_VARIANTS,
    PROMPT_TEMPLATE,
    TRANSFORMER_VARIANTS,
    VAE_VARIANTS,
)
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_clip_tokenizer, build_llama3_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors
from tuner.models.identify import Variant

TRANSFORMER_FILE = "hunyuan_video_t2v_tiny.safetensors"
VAE_FILE = "hunyuan_video_vae_tiny.safetensors"
LLAMA_FILE = "llava_llama3_tiny.safetensors"
CLIP_FILE = "clip_l.safetensors"


def _tiny(variants: tuple[Variant, ...]) -> Path:
    return next(v.config_dir for v in variants if v.name == "tiny")


def build_hunyuan_video_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: the arguments of `HunyuanVideoPipeline` (transformer, vae, text_encoder, tokenizer,
    text_encoder_2, tokenizer_2, scheduler).
    """
    with torch.random.fork_rng(devices=[]):  # constructors draw from the global generator
        transformer = HunyuanVideoTransformer3DModel.from_config(
            HunyuanVideoTransformer3DModel.load_config(_tiny(TRANSFORMER_VARIANTS))
        )
        vae = AutoencoderKLHunyuanVideo.from_config(
            AutoencoderKLHunyuanVideo.load_config(_tiny(VAE_VARIANTS))
        )
        llama = LlamaModel(LlamaConfig.from_pretrained(_tiny(LLAMA_VARIANTS)))
        clip = CLIPTextModel(CLIPTextConfig.from_pretrained(_tiny(CLIP_VARIANTS)))
    fill_random_(transformer, seed)
    fill_random_(vae, seed + 1)
    fill_random_(llama, seed + 2)
    fill_random_(clip, seed + 3)
    tokenizer = build_llama3_tokenizer([PROMPT_TEMPLATE])
    assert len(tokenizer) <= llama.config.vocab_size, "the tiny Llama's vocabulary is too small"
    return {
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "text_encoder": llama.eval(),
        "tokenizer": tokenizer,
        "text_encoder_2": clip.eval(),
        "tokenizer_2": build_clip_tokenizer(),
        # HunyuanVideo's release: flow-matching Euler with shift 7
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
    }


def write_hunyuan_video_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny HunyuanVideo model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file (Llama),
    text_encoder_2_file (CLIP), tokenizer, tokenizer_2 (the single-file layout's tokenizer folders).
    """
    out = Path(out_dir)
    parts = build_hunyuan_video_components(seed)

    def write(staging: Path) -> None:
        HunyuanVideoPipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        write_single_files(staging / "single", parts, seed)

    publish_layouts(out, "hunyuan_video", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "transformer_file": single / TRANSFORMER_FILE,
        "vae_file": single / VAE_FILE,
        "text_encoder_file": single / LLAMA_FILE,
        "text_encoder_2_file": single / CLIP_FILE,
        "tokenizer": single / "tokenizer",
        "tokenizer_2": single / "tokenizer_2",
    }


def write_single_files(folder: Path, parts: dict, seed: int) -> None:
    folder.mkdir(parents=True)
    save_safetensors(transformer_to_original(parts["transformer"].state_dict()), folder / TRANSFORMER_FILE)
    save_safetensors(parts["vae"].state_dict(), folder / VAE_FILE)
    # ComfyUI's Llama file is a LlamaForCausalLM state dict: the model under `model.`, plus an lm_head
    llama = {f"model.{k}": v for k, v in parts["text_encoder"].state_dict().items()}
    embed = llama["model.embed_tokens.weight"]
    llama["lm_head.weight"] = torch.randn(embed.shape, generator=torch.Generator().manual_seed(seed))
    save_safetensors(llama, folder / LLAMA_FILE)
    clip = {f"text_model.{k}": v for k, v in parts["text_encoder_2"].state_dict().items()}
    save_safetensors(clip, folder / CLIP_FILE)
    parts["tokenizer"].save_pretrained(folder / "tokenizer")
    parts["tokenizer_2"].save_pretrained(folder / "tokenizer_2")


FIXTURE = Fixture(
    write=write_hunyuan_video_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=f"""\
architecture = "hunyuan_video"
transformer = "{{root}}/single/{TRANSFORMER_FILE}"
vae = "{{root}}/single/{VAE_FILE}"
text_encoder = "{{root}}/single/{LLAMA_FILE}"
tokenizer = "{{root}}/single/tokenizer"
text_encoder_2 = "{{root}}/single/{CLIP_FILE}"
tokenizer_2 = "{{root}}/single/tokenizer_2"
""",
)
