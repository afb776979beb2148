"""Tiny random-weight HiDream-I1 models, written in both layouts users have.

The models are built from the `tiny` configs shipped with `tuner.archs.hidream.loaders` /
`tuner.archs.hidream.text` (transformer: 2 heads of 32, one double- and one single-stream block, 4
routed experts with 2 active, rotary axes 8 + 12 + 12, non-square latents padded to 16×16 tokens; CLIP-L
and CLIP-G: width 32, 248 positions; T5: FLUX.1's tiny T5; Llama: 2 layers of width 64; VAE: FLUX.1's
tiny one), so loaders recognise them like real checkpoints.

    out_dir/
      diffusers/                          what `HiDreamImagePipeline.from_pretrained` loads (with the
        model_index.json  transformer/  vae/  text_encoder/ ... text_encoder_4/  tokenizer_4/  scheduler/
      single/                             ComfyUI's single files
        hidream_i1_full_tiny.safetensors  the transformer (the release's names are diffusers')
        ae.safetensors                    the FLUX.1 VAE, LDM layout
        clip_l_hidream.safetensors  clip_g_hidream.safetensors   `text_model.*` + `text_projection`
        t5xxl_tiny.safetensors            `shared.weight`, no encoder.embed_tokens
        llama_3.1_8b_instruct_tiny.safetensors   LlamaForCausalLM's keys (`model.*`, `lm_head.weight`)
        tokenizer/  tokenizer_2/  tokenizer_3/  tokenizer_4/
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline
from diffusers import HiDreamImageTransformer2DModel as Transformer
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5EncoderModel,
)

from tuner.archs.flux.keys import vae_to_original
from tuner.archs.flux.loaders import T5_VARIANTS, VAE_VARIANTS
from tuner.archs.hidream.loaders import TRANSFORMER_VARIANTS
from tuner.archs.hidream.text import CLIP_G_VARIANTS, CLIP_L_VARIANTS, LLAMA_VARIANTS
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_clip_tokenizer, build_llama3_tokenizer, build_t5_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors
from tuner.models.identify import Variant

TRANSFORMER_FILE = "hidream_i1_full_tiny.safetensors"
VAE_FILE = "ae.safetensors"
CLIP_L_FILE = "clip_l_hidream.safetensors"
CLIP_G_FILE = "clip_g_hidream.safetensors"
T5_FILE = "t5xxl_tiny.safetensors"
LLAMA_FILE = "llama_3.1_8b_instruct_tiny.safetensors"


def _tiny(variants: tuple[Variant, ...]) -> Path:
    return next(v.config_dir for v in variants if v.name == "tiny")


def build_hidream_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`; keys are the
    arguments of `HiDreamImagePipeline`."""
    with torch.random.fork_rng(devices=[]):  # constructors draw from the global generator
        transformer = Transformer.from_config(Transformer.load_config(_tiny(TRANSFORMER_VARIANTS)))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(_tiny(VAE_VARIANTS)))
        clip_l = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(_tiny(CLIP_L_VARIANTS)))
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(_tiny(CLIP_G_VARIANTS)))
        t5 = T5EncoderModel(T5Config.from_pretrained(_tiny(T5_VARIANTS)))
        llama = LlamaForCausalLM(LlamaConfig.from_pretrained(_tiny(LLAMA_VARIANTS)))
    for offset, model in enumerate((transformer, vae, clip_l, clip_g, t5, llama)):
        fill_random_(model, seed + offset)
    t5_tokenizer = build_t5_tokenizer()
    t5_tokenizer.model_max_length = 512
    # HiDream-I1-Full's scheduler: flow-matching Euler with a fixed shift of 3
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)
    return {
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "text_encoder": clip_l.eval(),
        "tokenizer": build_clip_tokenizer(),
        "text_encoder_2": clip_g.eval(),
        "tokenizer_2": build_clip_tokenizer(),
        "text_encoder_3": t5.eval(),
        "tokenizer_3": t5_tokenizer,
        "text_encoder_4": llama.eval(),
        "tokenizer_4": build_llama3_tokenizer(),
        "scheduler": scheduler,
    }


def write_hidream_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny HiDream-I1 under `out_dir` in both layouts; returns the paths of its parts."""
    out = Path(out_dir)
    parts = build_hidream_components(seed)

    def write(staging: Path) -> None:
        HiDreamImagePipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        write_single_files(staging / "single", parts)

    publish_layouts(out, "hidream", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "transformer_file": single / TRANSFORMER_FILE,
        "vae_file": single / VAE_FILE,
        "text_encoder_file": single / CLIP_L_FILE,
        "text_encoder_2_file": single / CLIP_G_FILE,
        "text_encoder_3_file": single / T5_FILE,
        "text_encoder_4_file": single / LLAMA_FILE,
        **{f"tokenizer{s}": single / f"tokenizer{s}" for s in ("", "_2", "_3", "_4")},
    }


def write_single_files(folder: Path, parts: dict) -> None:
    folder.mkdir(parents=True)
    save_safetensors(parts["transformer"].state_dict(), folder / TRANSFORMER_FILE)
    levels = len(parts["vae"].config.block_out_channels)
    save_safetensors(vae_to_original(parts["vae"].state_dict(), levels), folder / VAE_FILE)
    # ComfyUI's HiDream CLIP files hold CLIPTextModelWithProjection's own keys
    save_safetensors(parts["text_encoder"].state_dict(), folder / CLIP_L_FILE)
    save_safetensors(parts["text_encoder_2"].state_dict(), folder / CLIP_G_FILE)
    t5 = parts["text_encoder_3"].state_dict()
    t5.pop("encoder.embed_tokens.weight")  # tied to `shared.weight`, which ComfyUI's files hold
    save_safetensors(t5, folder / T5_FILE)
    save_safetensors(parts["text_encoder_4"].state_dict(), folder / LLAMA_FILE)
    for suffix in ("", "_2", "_3", "_4"):
        parts[f"tokenizer{suffix}"].save_pretrained(folder / f"tokenizer{suffix}")


FIXTURE = Fixture(
    write=write_hidream_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=f"""\
architecture = "hidream"
transformer = "{{root}}/single/{TRANSFORMER_FILE}"
vae = "{{root}}/single/{VAE_FILE}"
text_encoder = "{{root}}/single/{CLIP_L_FILE}"
tokenizer = "{{root}}/single/tokenizer"
text_encoder_2 = "{{root}}/single/{CLIP_G_FILE}"
tokenizer_2 = "{{root}}/single/tokenizer_2"
text_encoder_3 = "{{root}}/single/{T5_FILE}"
tokenizer_3 = "{{root}}/single/tokenizer_3"
text_encoder_4 = "{{root}}/single/{LLAMA_FILE}"
tokenizer_4 = "{{root}}/single/tokenizer_4"
""",
)
