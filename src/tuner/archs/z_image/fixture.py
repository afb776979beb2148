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
from transformers import Qwen3Config, Qwen3Model

from tuner.archs.flux import loaders as flux
from tuner.archs.flux.keys import vae_to_original
from tuner.archs.z_image import loaders as z_image
from tuner.archs.z_image import text as z_image_text
from tuner.fixtures import Fixture, publish_layouts
from tuner.fixtures.tokenizers import build_qwen3_tokenizer
from tuner.fixtures.weights import fill_random_
from tuner.io import save_safetensors

TRANSFORMER_FILE = "z_image_tiny.safetensors"
VAE_FILE = "ae.safetensors"
TEXT_ENCODER_FILE = "qwen_3_tiny.safetensors"

# Tongyi-MAI/Z-Image-Turbo's scheduler_config.json: a constant shift of 3.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


def _tiny(variants) -> Path:
    return next(v.config_dir for v in variants if v.name == "tiny")


def build_z_image_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments
    of `ZImagePipeline` (transformer, vae, text_encoder, tokenizer, scheduler)."""
    with torch.random.fork_rng(devices=[]):  # constructors draw from the global generator
        transformer = ZImageTransformer2DModel.from_config(
            ZImageTransformer2DModel.load_config(_tiny(z_image.TRANSFORMER_VARIANTS))
        )
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(_tiny(flux.VAE_VARIANTS)))
        config = Qwen3Config.from_pretrained(_tiny(z_image_text.VARIANTS))
        text_encoder = Qwen3Model(config)
    fill_random_(transformer, seed)
    _quiet_block_modulation_(transformer)
    fill_random_(vae, seed + 1)
    fill_random_(text_encoder, seed + 2)
    tokenizer = build_qwen3_tokenizer([z_image_text.TEMPLATE.replace("{}", "\n")])
    assert len(tokenizer) <= config.vocab_size, "the tiny vocabulary outgrew the tiny config"
    return {
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "text_encoder": text_encoder.eval(),
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = build_z_image_components(seed)

    def write(staging: Path) -> None:
        ZImagePipeline(**parts).save_pretrained(staging / "diffusers", safe_serialization=True)
        write_single_files(staging / "single", parts)

    publish_layouts(out, "z-image", write)
    single = out / "single"
    return {
        "root": out,
        "diffusers": out / "diffusers",
        "transformer_file": single / TRANSFORMER_FILE,
        "vae_file": single / VAE_FILE,
        "text_encoder_file": single / TEXT_ENCODER_FILE,
        "tokenizer": single / "tokenizer",
    }


def write_single_files(folder: Path, parts: dict) -> None:
    folder.mkdir(parents=True)
    save_safetensors(
        z_image.Z_IMAGE_LAYOUT.to_original(parts["transformer"].state_dict()), folder / TRANSFORMER_FILE
    )
    levels = len(parts["vae"].config.block_out_channels)
    save_safetensors(vae_to_original(parts["vae"].state_dict(), levels), folder / VAE_FILE)
    text_encoder = parts["text_encoder"].state_dict()
    save_safetensors(
        {z_image_text.original_key(k): v for k, v in text_encoder.items()}, folder / TEXT_ENCODER_FILE
    )
    parts["tokenizer"].save_pretrained(folder / "tokenizer")


FIXTURE = Fixture(
    write=write_z_image_fixture,
    # every part as a ComfyUI single file (the tokenizer from its folder)
    model_section=f"""\
architecture = "z_image"
transformer = "{{root}}/single/{TRANSFORMER_FILE}"
vae = "{{root}}/single/{VAE_FILE}"
text_encoder = "{{root}}/single/{TEXT_ENCODER_FILE}"
tokenizer = "{{root}}/single/tokenizer"
""",
)
