"""A tiny random-weight Stable Diffusion 3.5 Medium, written in both layouts users have.

The models are built from the `tiny` configs shipped with `tuner.archs.sd3.loaders` (transformer: 2 heads of
32, two joint blocks, Medium's extra `attn2` in block 0 and q/k RMSNorms, the last block pre-only as in
the release; VAE: widths 32-64 with the real 8× compression and 16 channels; CLIP-L: 2 layers of width
32 with an identity projection, as the release's; bigG: 2 layers of width 64; T5: 2 layers of width 128,
wider than the two CLIPs together, so the pipeline's zero-padding of CLIP features is exercised).

    out_dir/
      diffusers/                         what `StableDiffusion3Pipeline.from_pretrained` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  text_encoder_2/  tokenizer_2/
        text_encoder_3/  tokenizer_3/  scheduler/
      single/                            Stability AI's and ComfyUI's single files
        sd3.5_medium_tiny.safetensors    the release's layout, `model.diffusion_model.joint_blocks.0...`
                                         (the release also bundles the VAE as `first_stage_model.*`;
                                         `write_bundled_file` writes that form, the fixture keeps the
                                         transformer alone, as ComfyUI's diffusion_models/ files are)
        clip_l.safetensors  clip_g.safetensors  t5xxl_tiny.safetensors   ComfyUI's text-encoder files
        tokenizer/  tokenizer_2/  tokenizer_3/

Both layouts hold the same float32 weights: the single files are the diffusers state dicts renamed by
tuner's own converters (`tuner.archs.sd3.keys`, `tuner.archs.flux.keys` for the VAE).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextModelWithProjection, T5EncoderModel

from tuner.archs.flux.fixture import ldm_vae_file
from tuner.archs.sd3 import loaders as sd3
from tuner.archs.sd3.keys import transformer_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import prefixed, t5_file
from tuner.fixtures.tokenizers import build_clip_tokenizer, build_t5_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model
from tuner.io import save_safetensors

TRANSFORMER_FILE = "sd3.5_medium_tiny.safetensors"
CLIP_L_FILE = "clip_l.safetensors"
CLIP_G_FILE = "clip_g.safetensors"
T5_FILE = "t5xxl_tiny.safetensors"


def build_sd3_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`; keys are the
    arguments of `StableDiffusion3Pipeline`."""
    clip_l = tiny_model(CLIPTextModelWithProjection, tiny_config("sd3", "clip_l"), seed + 2)
    with torch.no_grad():  # the release's CLIP-L pools unprojected
        clip_l.text_projection.weight.copy_(torch.eye(clip_l.text_projection.weight.shape[0]))
    tokenizer_2 = build_clip_tokenizer()
    tokenizer_2.pad_token = "!"  # the release's bigG tokenizer pads with "!", CLIP-L's with the end token
    return {
        "transformer": tiny_model(SD3Transformer2DModel, tiny_config("sd3", "transformer"), seed),
        "vae": tiny_model(AutoencoderKL, tiny_config("sd3", "vae"), seed + 1),
        "text_encoder": clip_l,
        "tokenizer": build_clip_tokenizer(),
        "text_encoder_2": tiny_model(CLIPTextModelWithProjection, tiny_config("sd3", "clip_g"), seed + 3),
        "tokenizer_2": tokenizer_2,
        "text_encoder_3": tiny_model(T5EncoderModel, tiny_config("sd3", "t5"), seed + 4),
        "tokenizer_3": build_t5_tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD 3.5's scheduler config
    }


def write_sd3_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny SD 3.5 Medium under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, text_encoder_file
    (CLIP-L), text_encoder_2_file (bigG), text_encoder_3_file (T5), tokenizer, tokenizer_2, tokenizer_3.
    """
    parts = build_sd3_components(seed)
    transformer = transformer_to_original(parts["transformer"].state_dict())
    single = {
        "transformer_file": (TRANSFORMER_FILE, prefixed("model.diffusion_model.", transformer)),
        # ComfyUI's CLIP files: transformers' CLIPTextModelWithProjection names (CLIP-L's projection unused)
        "text_encoder_file": (CLIP_L_FILE, parts["text_encoder"].state_dict()),
        "text_encoder_2_file": (CLIP_G_FILE, parts["text_encoder_2"].state_dict()),
        "text_encoder_3_file": (T5_FILE, t5_file(parts["text_encoder_3"])),
    }
    return write_layouts(out_dir, "sd3", StableDiffusion3Pipeline(**parts), single, tokenizer_folders(parts))


def write_bundled_file(parts: dict, path: Path, text_encoders: bool = True) -> None:
    """The release's all-in-one form: the transformer under `model.diffusion_model.`, the VAE under
    `first_stage_model.` (LDM names) and, with `text_encoders`, the three encoders under
    `text_encoders.{clip_l,clip_g,t5xxl}.transformer.` (as ComfyUI's `*_incl_clips_t5xxl*` files)."""
    transformer = transformer_to_original(parts["transformer"].state_dict())
    bundle = prefixed("model.diffusion_model.", transformer) | prefixed(
        sd3.VAE_PREFIX, ldm_vae_file(parts["vae"])
    )
    if text_encoders:
        bundle |= prefixed(sd3.CLIP_L_PREFIX, parts["text_encoder"].state_dict())
        bundle |= prefixed(sd3.CLIP_G_PREFIX, parts["text_encoder_2"].state_dict())
        bundle |= prefixed(sd3.T5_PREFIX, t5_file(parts["text_encoder_3"]))
    save_safetensors(bundle, path)


FIXTURE = Fixture(
    write=write_sd3_fixture,
    # the transformer and text encoders from their single files, as ComfyUI users hold them; the VAE
    # from the diffusers folder
    model_section=model_section(
        "sd3",
        transformer=TRANSFORMER_FILE,
        vae="diffusers",
        text_encoder=CLIP_L_FILE,
        text_encoder_2=CLIP_G_FILE,
        text_encoder_3=T5_FILE,
    ),
)
