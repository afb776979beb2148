"""A tiny random-weight Cosmos 1.0 Diffusion model (Text2World, or Video2World), in the layouts users have.

Built from the `tiny-cosmos1` configs (transformer: 2 heads of 32, 2 blocks, the learnable position
embedding over 16 × 32 × 32 latents; VAE: the CV8x8x8 layout at width 8, statistics for 4 latent frames) and
Cosmos-Predict2's tiny T5 (`fixture.py`).

    out_dir/
      diffusers/                         the folders of `CosmosTextToWorldPipeline` (or VideoToWorld)
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/
        cosmos1_tiny_t2w.safetensors     release names without `net.` (blocks.block0.blocks.0.block.attn...)
        t5_tiny.safetensors              transformers' T5 layout
        tokenizer/

The VAE is read from the diffusers folder only (`loaders_cosmos1.load_vae`).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from diffusers import AutoencoderKLCosmos, CosmosTransformer3DModel, EDMEulerScheduler
from transformers import T5EncoderModel

from tuner.archs.cosmos_predict2.fixture import TEXT_ENCODER_FILE
from tuner.archs.cosmos_predict2.keys_cosmos1 import transformer_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import t5_file
from tuner.fixtures.tokenizers import build_t5_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "cosmos1_tiny_t2w.safetensors"
V2W_TRANSFORMER_FILE = "cosmos1_tiny_v2w.safetensors"

# the scheduler diffusers' converter writes for the Cosmos 1.0 pipelines
# (its scripts/convert_cosmos_to_diffusers.py)
SCHEDULER_CONFIG = {
    "sigma_min": 0.002,
    "sigma_max": 80.0,
    "sigma_data": 0.5,
    "sigma_schedule": "karras",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "rho": 7.0,
    "final_sigmas_type": "sigma_min",
}


def build_cosmos1_components(seed: int = 0, video2world: bool = False) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments of
    `CosmosTextToWorldPipeline` / `CosmosVideoToWorldPipeline` but its safety checker."""
    family = "cosmos_predict2"
    transformer = tiny_config(family, "transformer", "tiny-cosmos1-v2w" if video2world else "tiny-cosmos1")
    return {
        "transformer": tiny_model(CosmosTransformer3DModel, transformer, seed),
        "vae": tiny_model(AutoencoderKLCosmos, tiny_config(family, "vae", "tiny-cosmos1"), seed + 1),
        "text_encoder": tiny_model(T5EncoderModel, tiny_config(family, "text_encoder"), seed + 2),
        "tokenizer": build_t5_tokenizer(),
        "scheduler": EDMEulerScheduler(**SCHEDULER_CONFIG),
    }


def write_cosmos1_fixture(out_dir: str | Path, seed: int = 0, video2world: bool = False) -> dict[str, Path]:
    """Write the tiny Cosmos 1.0 model under `out_dir`; returns the paths.

    Keys: root, diffusers, transformer_file, text_encoder_file, tokenizer."""
    parts = build_cosmos1_components(seed, video2world)

    def diffusers(folder: Path) -> None:
        for name, part in parts.items():
            part.save_pretrained(folder / name)
        index = {
            "_class_name": "CosmosVideoToWorldPipeline" if video2world else "CosmosTextToWorldPipeline",
            "_diffusers_version": "0.32.0",
            "safety_checker": [None, None],
            "scheduler": ["diffusers", "EDMEulerScheduler"],
            "text_encoder": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "T5TokenizerFast"],
            "transformer": ["diffusers", "CosmosTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLCosmos"],
        }
        (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")

    single = {
        "transformer_file": (
            V2W_TRANSFORMER_FILE if video2world else TRANSFORMER_FILE,
            transformer_to_original(parts["transformer"].state_dict()),
        ),
        "text_encoder_file": (TEXT_ENCODER_FILE, t5_file(parts["text_encoder"])),
    }
    label = "cosmos1_v2w" if video2world else "cosmos1_t2w"
    return write_layouts(out_dir, label, diffusers, single, tokenizer_folders(parts))


def _model_section(architecture: str, transformer_file: str) -> str:
    # the release's single file for the transformer, the diffusers folder for the rest
    return model_section(
        architecture, transformer=transformer_file, vae="diffusers", text_encoder="diffusers"
    )


T2W_FIXTURE = Fixture(
    write=write_cosmos1_fixture, model_section=_model_section("cosmos1_t2w", TRANSFORMER_FILE)
)
V2W_FIXTURE = Fixture(
    write=partial(write_cosmos1_fixture, video2world=True),
    model_section=_model_section("cosmos1_v2w", V2W_TRANSFORMER_FILE),
)
