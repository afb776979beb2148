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
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from tuner.archs.flux.keys import vae_to_original
from tuner.archs.sd3 import loaders as sd3
from tuner.archs.sd3.keys import transformer_to_original
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_clip_tokenizer, build_t5_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors
from tuner.models.identify import Variant

TRANSFORMER_FILE = "sd3.5_medium_tiny.safetensors"
CLIP_L_FILE = "clip_l.safetensors"
CLIP_G_FILE = "clip_g.safetensors"
T5_FILE = "t5xxl_tiny.safetensors"


def _tiny(variants: tuple[Variant, ...]) -> Path:
    return next(v.config_dir for v in variants if v.name == "tiny")


def build_sd3_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`; keys are the
    arguments of `StableDiffusion3Pipeline`."""
    with torch.random.fork_rng(devices=[]):  # constructors draw from the global generator
        transformer = SD3Transformer2DModel.from_config(
            SD3Transformer2DModel.load_config(_tiny(sd3.TRANSFORMER_VARIANTS))
        )
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(_tiny(sd3.VAE_VARIANTS)))
        clip_l = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(_tiny(sd3.CLIP_L_VARIANTS)))
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(_tiny(sd3.CLIP_G_VARIANTS)))
        t5 = T5EncoderModel(T5Config.from_pretrained(_tiny(sd3.T5_VARIANTS)))
    for i, model in enumerate((transformer, vae, clip_l, clip_g, t5)):
        fill_random_(model, seed + i)
    with torch.no_grad():  # the release's CLIP-L pools unprojected
        clip_l.text_projection.weight.copy_(torch.eye(clip_l.text_projection.weight.shape[0]))
    tokenizer_2 = build_clip_tokenizer()
    tokenizer_2.pad_token = "!"  # the release's bigG tokenizer pads with "!", CLIP-L's with the end token
    return {
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "text_encoder": clip_l.eval(),
        "tokenizer": build_clip_tokenizer(),
        "text_encoder_2": clip_g.eval(),
        "tokenizer_2": tokenizer_2,
        "text_encoder_3": t5.eval(),
        "tokenizer_3": build_t5_tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD 3.5's scheduler config
    }


def write_sd3_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny SD 3.5 Medium under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, text_encoder_file
    (CLIP-L), text_encoder_2_file (bigG), text_encoder_3_file (T5), tokenizer, tokenizer_2, tokenizer_3.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = build_sd3_components(seed)

    def write(staging: Path) -> None:
        StableDiffusion3Pipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        write_single_files(staging / "single", parts)

    publish_layouts(out, "sd3", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "transformer_file": single / TRANSFORMER_FILE,
        "text_encoder_file": single / CLIP_L_FILE,
        "text_encoder_2_file": single / CLIP_G_FILE,
        "text_encoder_3_file": single / T5_FILE,
        **{name: single / name for name in ("tokenizer", "tokenizer_2", "tokenizer_3")},
    }


def write_single_files(folder: Path, parts: dict) -> None:
    folder.mkdir(parents=True)
    transformer = transformer_to_original(parts["transformer"].state_dict())
    save_safetensors(
        {f"model.diffusion_model.{k}": v for k, v in transformer.items()}, folder / TRANSFORMER_FILE
    )
    # ComfyUI's CLIP files: transformers' CLIPTextModelWithProjection names (CLIP-L's projection unused)
    save_safetensors(parts["text_encoder"].state_dict(), folder / CLIP_L_FILE)
    save_safetensors(parts["text_encoder_2"].state_dict(), folder / CLIP_G_FILE)
    save_safetensors(_t5_file_state(parts), folder / T5_FILE)
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        parts[name].save_pretrained(folder / name)


def _t5_file_state(parts: dict) -> dict[str, torch.Tensor]:
    """T5 as single files hold it: the tied embedding once, as `shared.weight`."""
    t5 = parts["text_encoder_3"].state_dict()
    t5.pop("encoder.embed_tokens.weight")
    return t5


def write_bundled_file(parts: dict, path: Path, text_encoders: bool = True) -> None:
    """The release's all-in-one form: the transformer under `model.diffusion_model.`, the VAE under
    `first_stage_model.` (LDM names) and, with `text_encoders`, the three encoders under
    `text_encoders.{clip_l,clip_g,t5xxl}.transformer.` (as ComfyUI's `*_incl_clips_t5xxl*` files)."""
    transformer = transformer_to_original(parts["transformer"].state_dict())
    bundle = {f"model.diffusion_model.{k}": v for k, v in transformer.items()}
    bundle.update({f"{sd3.VAE_PREFIX}{k}": v for k, v in vae_to_original(parts["vae"].state_dict()).items()})
    if text_encoders:
        encoders = ((sd3.CLIP_L_PREFIX, parts["text_encoder"].state_dict()),
                    (sd3.CLIP_G_PREFIX, parts["text_encoder_2"].state_dict()), (sd3.T5_PREFIX, _t5_file_state(parts)))  # fmt: skip
        for prefix, state in encoders:
            bundle.update({f"{prefix}{k}": v for k, v in state.items()})
    save_safetensors(bundle, path)


FIXTURE = Fixture(
    write=write_sd3_fixture,
    # the transformer and text encoders from their single files, as ComfyUI users hold them; the VAE
    # from the diffusers folder
    model_section=f"""\
architecture = "sd3"
transformer = "{{root}}/single/{TRANSFORMER_FILE}"
vae = "{{root}}/diffusers"
text_encoder = "{{root}}/single/{CLIP_L_FILE}"
tokenizer = "{{root}}/single/tokenizer"
text_encoder_2 = "{{root}}/single/{CLIP_G_FILE}"
tokenizer_2 = "{{root}}/single/tokenizer_2"
text_encoder_3 = "{{root}}/single/{T5_FILE}"
tokenizer_3 = "{{root}}/single/tokenizer_3"
""",
)
