"""A tiny random-weight MiniMax H3 (video + sound), written in the layouts users have.

Built from the `tiny` configs in `tuner/archs/minimax_h3/configs/` (transformer: 2 blocks of width 48, 2
heads of 32, one refiner block, 24 video and 32 audio channels as the release; video VAE with the real
16× / 17n + 5 → 5n + 2 compression and 24 channels; audio VAE with the real hop of 800 at 32 kHz and 32
channels; Qwen3-VL language model of 51 layers of width 32, so `hidden_states[50]` exists as in the 32B)
and an offline Qwen2 tokenizer.

    out_dir/
      diffusers/   the release's folder layout (what `MiniMaxH3ModularPipeline` loads its components
                   from): transformer/ vae/ audio_vae/ text_encoder/ tokenizer/
      single/minimax_h3_tiny.safetensors   the transformer in the reference code's names (ComfyUI's file)
      single/qwen3vl_tiny.safetensors      Qwen3-VL in Hugging Face keys, with single/tokenizer/
"""

from __future__ import annotations

from pathlib import Path

from tuner.archs.krea2.fixture import tiny_qwen3_vl
from tuner.archs.minimax_h3.keys import MINIMAX_H3_LAYOUT
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.tokenizers import build_qwen2_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "minimax_h3_tiny.safetensors"
TEXT_ENCODER_FILE = "qwen3vl_tiny.safetensors"


def build_minimax_h3_components(seed: int = 0) -> dict:
    """The tiny model's components (eval mode, float32), deterministic given `seed`."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

    classes = {
        "transformer": MiniMaxH3Transformer3DModel,
        "vae": AutoencoderKLMiniMaxH3,
        "audio_vae": AutoencoderKLMiniMaxH3Audio,
    }
    parts = {
        name: tiny_model(cls, tiny_config("minimax_h3", name), seed + i)
        for i, (name, cls) in enumerate(classes.items())
    }
    parts["text_encoder"] = tiny_qwen3_vl(seed + len(classes), "minimax_h3")
    parts["tokenizer"] = build_qwen2_tokenizer()
    assert len(parts["tokenizer"]) <= parts["text_encoder"].config.text_config.vocab_size, (
        "the tiny vocabulary outgrew the tiny config"
    )
    return parts


def write_minimax_h3_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny MiniMax H3 under `out_dir`; returns {root, diffusers, transformer_file,
    text_encoder_file, tokenizer}."""
    parts = build_minimax_h3_components(seed)

    def write_folder(folder: Path) -> None:
        for name, part in parts.items():
            part.save_pretrained(folder / name)

    single = {
        "transformer_file": (
            TRANSFORMER_FILE,
            MINIMAX_H3_LAYOUT.to_original(parts["transformer"].state_dict()),
        ),
        "text_encoder_file": (
            TEXT_ENCODER_FILE,
            {f"model.{k}": v for k, v in parts["text_encoder"].state_dict().items()},
        ),
    }
    return write_layouts(out_dir, "minimax_h3", write_folder, single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_minimax_h3_fixture,
    # the transformer and text encoder as single files; the VAEs from the diffusers folder (the release's)
    model_section=model_section(
        "minimax_h3", transformer=TRANSFORMER_FILE, vae="diffusers", text_encoder=TEXT_ENCODER_FILE
    ),
)
