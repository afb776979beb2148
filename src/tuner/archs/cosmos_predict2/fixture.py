"""A tiny random-weight Cosmos-Predict2 text-to-image model, written in both layouts users have.

Built from the `tiny` configs shipped with `tuner.archs.cosmos_predict2.loaders` (transformer: 2 heads of 32,
2 blocks, text dim 64, the released `concat_padding_mask=True`; T5: 2 ReLU layers of width 64, as
T5-11B's v1.0 layout) and the tiny Wan 2.1 VAE of `tuner.archs.wan.fixture`.

    out_dir/
      diffusers/                          the folders of `Cosmos2TextToImagePipeline`
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/
        cosmos_predict2_tiny_t2i.safetensors  release names without `net.` (blocks.0.self_attn.q_proj...)
        wan_2.1_vae.safetensors               original Wan VAE keys
        t5_tiny.safetensors                   transformers' T5 layout without the tied embed_tokens
        tokenizer/

`video2world=True` writes the Video2World model instead (`cosmos_predict2_v2w`'s fixture): the `tiny-v2w`
transformer config (one condition-mask input channel more), `cosmos_predict2_tiny_v2w.safetensors` and a
`Cosmos2VideoToWorldPipeline` model index; the other parts are the same.

The diffusers folder is written component by component: the pipeline's constructor insists on NVIDIA's
`cosmos_guardrail` safety checker, which is not installed here.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from diffusers import CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
from transformers import T5EncoderModel

from tuner.archs.cosmos_predict2.keys import transformer_to_original
from tuner.archs.wan.fixture import VAE_FILE, build_wan_components
from tuner.archs.wan.keys import vae_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.encoders import t5_file
from tuner.fixtures.tokenizers import build_t5_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "cosmos_predict2_tiny_t2i.safetensors"
V2W_TRANSFORMER_FILE = "cosmos_predict2_tiny_v2w.safetensors"
TEXT_ENCODER_FILE = "t5_tiny.safetensors"

# nvidia/Cosmos-Predict2-*-Text2Image's scheduler_config.json (the pipeline adds the EDM sigma range)
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "invert_sigmas": False,
    "shift_terminal": None,
    "use_karras_sigmas": True,
}


def build_cosmos_predict2_components(seed: int = 0, video2world: bool = False) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: transformer (diffusers' own class with the released config), vae, text_encoder, tokenizer,
    scheduler (the arguments of `Cosmos2TextToImagePipeline` / `Cosmos2VideoToWorldPipeline` but its
    safety checker)."""
    transformer = tiny_config("cosmos_predict2", "transformer", "tiny-v2w" if video2world else "tiny")
    return {
        "transformer": tiny_model(CosmosTransformer3DModel, transformer, seed),
        "vae": build_wan_components(seed)["vae"],  # the tiny Wan 2.1 VAE, weights seeded by seed + 1
        "text_encoder": tiny_model(T5EncoderModel, tiny_config("cosmos_predict2", "text_encoder"), seed + 2),
        "tokenizer": build_t5_tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
    }


def write_cosmos_predict2_fixture(
    out_dir: str | Path, seed: int = 0, video2world: bool = False
) -> dict[str, Path]:
    """Write the tiny Cosmos-Predict2 model (Text2Image, or Video2World) under `out_dir` in both
    layouts; returns the paths.

    Keys: root, diffusers, transformer_file, vae_file, text_encoder_file, tokenizer."""
    parts = build_cosmos_predict2_components(seed, video2world)

    def diffusers(folder: Path) -> None:
        for name, part in parts.items():
            part.save_pretrained(folder / name)
        index = {
            "_class_name": "Cosmos2VideoToWorldPipeline" if video2world else "Cosmos2TextToImagePipeline",
            "_diffusers_version": "0.34.0",
            "safety_checker": [None, None],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "T5TokenizerFast"],
            "transformer": ["diffusers", "CosmosTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLWan"],
        }
        (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")

    single = {
        "transformer_file": (
            V2W_TRANSFORMER_FILE if video2world else TRANSFORMER_FILE,
            transformer_to_original(parts["transformer"].state_dict()),
        ),
        "vae_file": (VAE_FILE, vae_to_original(parts["vae"].state_dict())),
        "text_encoder_file": (TEXT_ENCODER_FILE, t5_file(parts["text_encoder"])),
    }
    label = "cosmos_predict2_v2w" if video2world else "cosmos_predict2"
    return write_layouts(out_dir, label, diffusers, single, tokenizer_folders(parts))


def _model_section(architecture: str, transformer_file: str) -> str:
    # the release's single file for the transformer, the diffusers folder for the rest
    return model_section(
        architecture, transformer=transformer_file, vae="diffusers", text_encoder="diffusers"
    )


FIXTURE = Fixture(
    write=write_cosmos_predict2_fixture, model_section=_model_section("cosmos_predict2", TRANSFORMER_FILE)
)
V2W_FIXTURE = Fixture(
    write=partial(write_cosmos_predict2_fixture, video2world=True),
    model_section=_model_section("cosmos_predict2_v2w", V2W_TRANSFORMER_FILE),
)
