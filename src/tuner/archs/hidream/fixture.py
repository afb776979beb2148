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

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline
from diffusers import HiDreamImageTransformer2DModel as Transformer
from transformers import CLIPTextModelWithProjection, LlamaForCausalLM, T5EncoderModel

from tuner.archs.flux.fixture import ldm_vae_file
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import t5_file
from tuner.fixtures.tokenizers import build_clip_tokenizer, build_llama3_tokenizer, build_t5_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "hidream_i1_full_tiny.safetensors"
VAE_FILE = "ae.safetensors"
CLIP_L_FILE = "clip_l_hidream.safetensors"
CLIP_G_FILE = "clip_g_hidream.safetensors"
T5_FILE = "t5xxl_tiny.safetensors"
LLAMA_FILE = "llama_3.1_8b_instruct_tiny.safetensors"


def build_hidream_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`; keys are the
    arguments of `HiDreamImagePipeline`."""
    t5_tokenizer = build_t5_tokenizer()
    t5_tokenizer.model_max_length = 512
    return {
        "transformer": tiny_model(Transformer, tiny_config("hidream", "transformer"), seed),
        "vae": tiny_model(AutoencoderKL, tiny_config("flux", "vae"), seed + 1),
        "text_encoder": tiny_model(CLIPTextModelWithProjection, tiny_config("hidream", "clip_l"), seed + 2),
        "tokenizer": build_clip_tokenizer(),
        "text_encoder_2": tiny_model(CLIPTextModelWithProjection, tiny_config("hidream", "clip_g"), seed + 3),
        "tokenizer_2": build_clip_tokenizer(),
        "text_encoder_3": tiny_model(T5EncoderModel, tiny_config("flux", "t5"), seed + 4),
        "tokenizer_3": t5_tokenizer,
        "text_encoder_4": tiny_model(LlamaForCausalLM, tiny_config("hidream", "llama"), seed + 5),
        "tokenizer_4": build_llama3_tokenizer(),
        # HiDream-I1-Full's scheduler: flow-matching Euler with a fixed shift of 3
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
    }


def write_hidream_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny HiDream-I1 under `out_dir` in both layouts; returns the paths of its parts."""
    parts = build_hidream_components(seed)
    single = {
        "transformer_file": (TRANSFORMER_FILE, parts["transformer"].state_dict()),
        "vae_file": (VAE_FILE, ldm_vae_file(parts["vae"])),
        # ComfyUI's HiDream CLIP files hold CLIPTextModelWithProjection's own keys
        "text_encoder_file": (CLIP_L_FILE, parts["text_encoder"].state_dict()),
        "text_encoder_2_file": (CLIP_G_FILE, parts["text_encoder_2"].state_dict()),
        "text_encoder_3_file": (T5_FILE, t5_file(parts["text_encoder_3"])),
        "text_encoder_4_file": (LLAMA_FILE, parts["text_encoder_4"].state_dict()),
    }
    return write_layouts(out_dir, "hidream", HiDreamImagePipeline(**parts), single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_hidream_fixture,
    # every part from its single file, as ComfyUI users hold them
    model_section=model_section(
        "hidream",
        transformer=TRANSFORMER_FILE,
        vae=VAE_FILE,
        text_encoder=CLIP_L_FILE,
        text_encoder_2=CLIP_G_FILE,
        text_encoder_3=T5_FILE,
        text_encoder_4=LLAMA_FILE,
    ),
)
