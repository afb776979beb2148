"""A tiny random-weight SDXL, written in both layouts users have.

The models are built from the `tiny` configs shipped with `tuner.archs.sdxl.loaders` (UNet: SDXL's block
structure, three levels of widths 32-64 with attention on the lower two, one transformer block each,
text context 32 + 64; VAE: widths 32-64 with the real 8× compression and 4 latent channels; CLIP-L: 2
layers of width 32; bigG: 2 layers of width 64 with a projection), so loaders recognise them like real
checkpoints.

    out_dir/
      diffusers/                     what `StableDiffusionXLPipeline.from_pretrained` loads
        model_index.json  unet/  vae/  text_encoder/  tokenizer/  text_encoder_2/  tokenizer_2/  scheduler/
      single/
        sd_xl_tiny.safetensors       the bundled A1111 / ComfyUI checkpoint: model.diffusion_model.*
                                     (original UNet names), first_stage_model.* (LDM VAE),
                                     conditioner.embedders.0.transformer.text_model.* (CLIP-L),
                                     conditioner.embedders.1.model.* (OpenCLIP bigG)
        sd_xl_tiny_unet.safetensors  the UNet alone (model.diffusion_model.*), as ComfyUI's
                                     `models/diffusion_models/` holds it and full fine-tunes save it
        tokenizer/  tokenizer_2/

Both layouts hold the same float32 weights: the single file is the diffusers state dicts renamed by
tuner's own converters (`tuner.archs.sdxl.keys`, `tuner.archs.flux.keys` for the VAE).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from tuner.archs.flux.keys import vae_to_original
from tuner.archs.sdxl.keys import clip_g_to_original, unet_to_original
from tuner.archs.sdxl.loaders import (
    CLIP_G_PREFIX,
    CLIP_G_VARIANTS,
    CLIP_L_PREFIX,
    CLIP_L_VARIANTS,
    UNET_PREFIX,
    UNET_VARIANTS,
    VAE_PREFIX,
    VAE_VARIANTS,
)
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_clip_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors
from tuner.models.identify import Variant

BUNDLED_FILE = "sd_xl_tiny.safetensors"
UNET_FILE = "sd_xl_tiny_unet.safetensors"


def _tiny(variants: tuple[Variant, ...]) -> Path:
    return next(v.config_dir for v in variants if v.name == "tiny")


def sdxl_scheduler() -> EulerDiscreteScheduler:
    """SDXL base's scheduler config: scaled-linear betas 0.00085-0.012, leading spacing, epsilon."""
    return EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", steps_offset=1, timestep_spacing="leading",
    )  # fmt: skip


def build_sdxl_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`; the keys are
    `StableDiffusionXLPipeline`'s arguments."""
    with torch.random.fork_rng(devices=[]):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(_tiny(UNET_VARIANTS)))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(_tiny(VAE_VARIANTS)))
        clip_l = CLIPTextModel(CLIPTextConfig.from_pretrained(_tiny(CLIP_L_VARIANTS)))
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(_tiny(CLIP_G_VARIANTS)))
    fill_random_(unet, seed)
    fill_random_(vae, seed + 1)
    fill_random_(clip_l, seed + 2)
    fill_random_(clip_g, seed + 3)
    # Random attention modules each add a unit-size update to the UNet's stream, which a trained SDXL's
    # do not; halved, the stream is not all attention output, and fp8 rounding (whose per-layer error
    # then adds up over 11 attention modules) stays near what it costs the real model.
    with torch.no_grad():
        for name, module in unet.named_modules():
            if name.endswith("proj_out") and ".attentions." in name:
                module.weight.mul_(0.5)
    return {
        "unet": unet.eval(),
        "vae": vae.eval(),
        "text_encoder": clip_l.eval(),
        "tokenizer": build_clip_tokenizer(),
        "text_encoder_2": clip_g.eval(),
        "tokenizer_2": build_clip_tokenizer(),
        "scheduler": sdxl_scheduler(),
    }


def bundled_state_dict(parts: dict) -> dict[str, torch.Tensor]:
    """The four models as one A1111 / ComfyUI checkpoint (original layouts, prefixed)."""
    tensors = {UNET_PREFIX + k: v for k, v in unet_to_original(parts["unet"].state_dict()).items()}
    tensors |= {VAE_PREFIX + k: v for k, v in vae_to_original(parts["vae"].state_dict()).items()}
    tensors |= {f"{CLIP_L_PREFIX}text_model.{k}": v for k, v in parts["text_encoder"].state_dict().items()}
    clip_g = clip_g_to_original(parts["text_encoder_2"].state_dict())
    tensors |= {CLIP_G_PREFIX + k: v for k, v in clip_g.items()}
    tensors[f"{CLIP_G_PREFIX}logit_scale"] = torch.tensor(4.6052)  # OpenCLIP's; not part of the text tower
    return tensors


def write_sdxl_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny SDXL under `out_dir` in both layouts; returns the paths (root, diffusers,
    bundled_file, transformer_file = the UNet alone, tokenizer, tokenizer_2)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = build_sdxl_components(seed)

    def write(staging: Path) -> None:
        StableDiffusionXLPipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        single = staging / "single"
        single.mkdir(parents=True)
        bundled = bundled_state_dict(parts)
        save_safetensors(bundled, single / BUNDLED_FILE)
        save_safetensors({k: v for k, v in bundled.items() if k.startswith(UNET_PREFIX)}, single / UNET_FILE)
        parts["tokenizer"].save_pretrained(single / "tokenizer")
        parts["tokenizer_2"].save_pretrained(single / "tokenizer_2")

    publish_layouts(out, "sdxl", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "bundled_file": single / BUNDLED_FILE,
        "transformer_file": single / UNET_FILE,
        "tokenizer": single / "tokenizer",
        "tokenizer_2": single / "tokenizer_2",
    }


FIXTURE = Fixture(
    write=write_sdxl_fixture,
    # every model from the one bundled file, as most SDXL users hold them
    model_section=f"""\
architecture = "sdxl"
transformer = "{{root}}/single/{BUNDLED_FILE}"
vae = "{{root}}/single/{BUNDLED_FILE}"
text_encoder = "{{root}}/single/{BUNDLED_FILE}"
tokenizer = "{{root}}/single/tokenizer"
text_encoder_2 = "{{root}}/single/{BUNDLED_FILE}"
tokenizer_2 = "{{root}}/single/tokenizer_2"
""",
)
