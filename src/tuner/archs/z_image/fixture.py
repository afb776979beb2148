"""A tiny random-weight Z-Image model, written in both layouts users have.

The models are built from the `tiny` configs shipped with `tuner.archs.z_image.loaders` (transformer: 3 heads
of 32, one refiner block of each kind, 2 layers, caption width 64), `tuner.archs.flux.loaders` (the FLUX.1 VAE
at base width 32 with the real 8× compression and 16 channels) and `tuner.archs.z_image.text` (Qwen3:
2 layers of width 64), so loaders recognise them like real checkpoints. The tokenizer is a byte-level
BPE with Qwen3's chat template.

    out_dir/
      diffusers/                    what `ZImagePipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/                       the ComfyUI single-file layout
        z_image_tiny.safetensors    the release's keys (layers.0.attention.qkv.weight, x_embedder, ...)
        ae.safetensors              the FLUX.1 VAE's original keys
        qwen_3_tiny.safetensors     Hugging Face Qwen3 keys (model.layers.0...)
        tokenizer/

Both layouts hold the same float32 weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Model

from tuner.archs.flux.fixture import ldm_vae_file
from tuner.archs.z_image import loaders as z_image
from tuner.archs.z_image import text as z_image_text
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.tokenizers import build_qwen3_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "z_image_tiny.safetensors"
VAE_FILE = "ae.safetensors"
TEXT_ENCODER_FILE = "qwen_3_tiny.safetensors"

# Tongyi-MAI/Z-Image-Turbo's scheduler_config.json: a constant shift of 3.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


def build_z_image_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments
    of `ZImagePipeline` (transformer, vae, text_encoder, tokenizer, scheduler)."""
    transformer = tiny_model(ZImageTransformer2DModel, tiny_config("z_image", "transformer"), seed)
    _quiet_block_modulation_(transformer)
    text_encoder = tiny_model(Qwen3Model, tiny_config("z_image", "text_encoder"), seed + 2)
    tokenizer = build_qwen3_tokenizer([z_image_text.TEMPLATE.replace("{}", "\n")])
    assert len(tokenizer) <= text_encoder.config.vocab_size, "the tiny vocabulary outgrew the tiny config"
    return {
        "transformer": transformer,
        "vae": tiny_model(AutoencoderKL, tiny_config("flux", "vae"), seed + 1),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG),
    }


@torch.no_grad()
def _quiet_block_modulation_(transformer: ZImageTransformer2DModel) -> None:
    """Scale the blocks' modulation weights by 1/4. Z-Image gates each block's update with tanh of its
    modulation (adaLN, zero-initialized as in DiT), so a trained model's blocks change the residual
    stream a little each; at full random scale every block replaces it, and a few percent of fp8
    rounding per weight compounds to over 5% of the output (the contract suite's fp8 bound)."""
    for name, param in transformer.named_parameters():
        if ".adaLN_modulation." in name and not name.startswith("all_final_layer"):
            param.mul_(0.25)


def write_z_image_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Z-Image model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file, tokenizer
    (the single-file layout's tokenizer folder). Existing `diffusers/` and `single/` folders under
    `out_dir` are replaced only once the new ones are complete.
    """
    parts = build_z_image_components(seed)
    text_encoder = parts["text_encoder"].state_dict()
    single = {
        "transformer_file": (
            TRANSFORMER_FILE,
            z_image.Z_IMAGE_LAYOUT.to_original(parts["transformer"].state_dict()),
        ),
        "vae_file": (VAE_FILE, ldm_vae_file(parts["vae"])),
        "text_encoder_file": (
            TEXT_ENCODER_FILE,
            {z_image_text.original_key(k): v for k, v in text_encoder.items()},
        ),
    }
    return write_layouts(out_dir, "z-image", ZImagePipeline(**parts), single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_z_image_fixture,
    # every part as a ComfyUI single file (the tokenizer from its folder)
    model_section=model_section(
        "z_image", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=TEXT_ENCODER_FILE
    ),
)
