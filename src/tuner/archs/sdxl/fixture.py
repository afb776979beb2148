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
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from tuner.archs.flux.fixture import ldm_vae_file
from tuner.archs.sdxl.keys import clip_g_to_original, unet_to_original
from tuner.archs.sdxl.loaders import CLIP_G_PREFIX, CLIP_L_PREFIX, UNET_PREFIX, VAE_PREFIX
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import clip_text_file, prefixed
from tuner.fixtures.tokenizers import build_clip_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

BUNDLED_FILE = "sd_xl_tiny.safetensors"
UNET_FILE = "sd_xl_tiny_unet.safetensors"


def sdxl_scheduler() -> EulerDiscreteScheduler:
    """SDXL base's scheduler config: scaled-linear betas 0.00085-0.012, leading spacing, epsilon."""
    return EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", steps_offset=1, timestep_spacing="leading",
    )  # fmt: skip


def build_sdxl_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`; the keys are
    `StableDiffusionXLPipeline`'s arguments."""
    unet = tiny_model(UNet2DConditionModel, tiny_config("sdxl", "transformer"), seed)
    # Random attention modules each add a unit-size update to the UNet's stream, which a trained SDXL's
    # do not; halved, the stream is not all attention output, and fp8 rounding (whose per-layer error
    # then adds up over 11 attention modules) stays near what it costs the real model.
    with torch.no_grad():
        for name, module in unet.named_modules():
            if name.endswith("proj_out") and ".attentions." in name:
                module.weight.mul_(0.5)
    return {
        "unet": unet,
        "vae": tiny_model(AutoencoderKL, tiny_config("sdxl", "vae"), seed + 1),
        "text_encoder": tiny_model(CLIPTextModel, tiny_config("sdxl", "clip_l"), seed + 2),
        "tokenizer": build_clip_tokenizer(),
        "text_encoder_2": tiny_model(CLIPTextModelWithProjection, tiny_config("sdxl", "clip_g"), seed + 3),
        "tokenizer_2": build_clip_tokenizer(),
        "scheduler": sdxl_scheduler(),
    }


def bundled_state_dict(parts: dict) -> dict[str, torch.Tensor]:
    """The four models as one A1111 / ComfyUI checkpoint (original layouts, prefixed)."""
    tensors = prefixed(UNET_PREFIX, unet_to_original(parts["unet"].state_dict()))
    tensors |= prefixed(VAE_PREFIX, ldm_vae_file(parts["vae"]))
    tensors |= prefixed(CLIP_L_PREFIX, clip_text_file(parts["text_encoder"]))
    clip_g = clip_g_to_original(parts["text_encoder_2"].state_dict())
    tensors |= prefixed(CLIP_G_PREFIX, clip_g)
    tensors[f"{CLIP_G_PREFIX}logit_scale"] = torch.tensor(4.6052)  # OpenCLIP's; not part of the text tower
    return tensors


def write_sdxl_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny SDXL under `out_dir` in both layouts; returns the paths (root, diffusers,
    bundled_file, transformer_file = the UNet alone, tokenizer, tokenizer_2)."""
    parts = build_sdxl_components(seed)
    bundled = bundled_state_dict(parts)
    single = {
        "bundled_file": (BUNDLED_FILE, bundled),
        "transformer_file": (UNET_FILE, {k: v for k, v in bundled.items() if k.startswith(UNET_PREFIX)}),
    }
    return write_layouts(
        out_dir, "sdxl", StableDiffusionXLPipeline(**parts), single, tokenizer_folders(parts)
    )


FIXTURE = Fixture(
    write=write_sdxl_fixture,
    # every model from the one bundled file, as most SDXL users hold them
    model_section=model_section(
        "sdxl",
        transformer=BUNDLED_FILE,
        vae=BUNDLED_FILE,
        text_encoder=BUNDLED_FILE,
        text_encoder_2=BUNDLED_FILE,
    ),
)
