"""A tiny random-weight Wan 2.1 text-to-video model, written in both layouts users have.

The models are built from the `tiny` configs shipped with `tuner.archs.wan.loaders` (transformer: 2 heads of
32, 2 blocks, text dim 64; VAE: base width 16 with the real 4x temporal / 8x spatial compression and 16
latent channels; UMT5: 2 layers of width 64), so loaders recognise them like real checkpoints.

    out_dir/
      diffusers/                      what `WanPipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/                         the official / ComfyUI single-file layout
        wan2.1_t2v_tiny.safetensors   official transformer keys (blocks.0.self_attn.q.weight, ...)
        wan_2.1_vae.safetensors       original VAE keys (encoder.downsamples.0.residual.0.gamma, ...)
        umt5_tiny.safetensors         ComfyUI text-encoder layout (transformers keys, no embed_tokens)
        tokenizer/

Both layouts hold the same float32 weights: the single files are the diffusers state dicts renamed by
tuner's own diffusers -> original converters (`tuner.archs.wan.keys`).
"""

from __future__ import annotations

from pathlib import Path

from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5EncoderModel

from tuner.archs.wan.keys import transformer_to_original, vae_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import t5_file
from tuner.fixtures.tokenizers import build_t5_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "wan2.1_t2v_tiny.safetensors"
VAE_FILE = "wan_2.1_vae.safetensors"
TEXT_ENCODER_FILE = "umt5_tiny.safetensors"


def build_wan_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: transformer, vae, text_encoder, tokenizer, scheduler (the arguments of `WanPipeline`).
    """
    return {
        "transformer": tiny_model(WanTransformer3DModel, tiny_config("wan", "transformer"), seed),
        "vae": tiny_model(AutoencoderKLWan, tiny_config("wan", "vae"), seed + 1),
        "text_encoder": tiny_model(UMT5EncoderModel, tiny_config("wan", "text_encoder"), seed + 2),
        "tokenizer": build_t5_tokenizer(),
        # Wan 2.1's diffusers release samples with UniPC on flow-matching sigmas, shift 3 (480p).
        "scheduler": UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
    }


def write_wan_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Wan 2.1 T2V model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file, tokenizer
    (the single-file layout's tokenizer folder). Existing `diffusers/` and `single/` folders under
    `out_dir` are replaced only once the new ones are complete.
    """
    parts = build_wan_components(seed)
    single = {
        "transformer_file": (TRANSFORMER_FILE, transformer_to_original(parts["transformer"].state_dict()))
    }
    return write_layouts(
        out_dir, "wan", WanPipeline(**parts), single | wan21_files(parts), tokenizer_folders(parts)
    )


def wan21_files(parts: dict) -> dict[str, tuple[str, dict]]:
    """The single files every Wan fixture but TI2V shares: Wan 2.1's VAE and the UMT5 encoder (ComfyUI's
    files hold its tied embedding once), as `write_layouts` takes them."""
    return {
        "vae_file": (VAE_FILE, vae_to_original(parts["vae"].state_dict())),
        "text_encoder_file": (TEXT_ENCODER_FILE, t5_file(parts["text_encoder"])),
    }


FIXTURE = Fixture(
    write=write_wan_fixture,
    # the original single-file layout for the transformer, the diffusers folder for the rest
    model_section=model_section(
        "wan", transformer=TRANSFORMER_FILE, vae="diffusers", text_encoder="diffusers"
    ),
)
