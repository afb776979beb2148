"""A tiny random-weight Krea 2 model, written in both layouts users have.

The models are built from the `tiny` configs shipped in `configs/` (transformer: 2 heads of 32, 2 blocks,
one text-fusion block of each kind, 2 tapped text layers of width 64; Qwen3-VL: a language model of 6
layers of width 64, whose `tapped_layers` are 2 and 5, and a one-block vision tower) and
`tuner.archs.qwen_image` (the Qwen-Image VAE at base width 16 with the real 8x compression and 16
channels), so loaders recognise them like real checkpoints. The tokenizer is a byte-level BPE learned from
the prompt template and caption words, so the template drops exactly as many tokens as with the real
tokenizer (34 before the caption, 5 after).

    out_dir/
      diffusers/                    what `Krea2Pipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
      single/                       the ComfyUI single-file layout
        krea2_raw_tiny.safetensors  the release's keys (blocks.0.attn.wq.weight, txtfusion..., first, last)
        qwen_image_vae.safetensors  original Wan VAE keys
        qwen3vl_tiny.safetensors    Hugging Face Qwen3-VL keys (model.language_model..., model.visual...)
        tokenizer/

Both layouts hold the same float32 weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    Krea2Pipeline,
    Krea2Transformer2DModel,
)
from transformers import Qwen3VLConfig, Qwen3VLModel, Qwen3VLTextConfig

from tuner.archs.krea2.keys import KREA2_LAYOUT
from tuner.archs.krea2.text import PREFIX, SUFFIX, tapped_layers
from tuner.archs.wan.keys import vae_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.tokenizers import build_qwen2_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "krea2_raw_tiny.safetensors"
VAE_FILE = "qwen_image_vae.safetensors"
TEXT_ENCODER_FILE = "qwen3vl_tiny.safetensors"

# Krea 2's scheduler, as Krea2Pipeline's docstring gives it: the exponential time shift with μ from the
# image-token count, 256 -> 0.5 up to 6400 -> 1.15
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 6400,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}

# a one-block vision tower: the diffusers folder and the single file hold one, as the release's do
_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    num_position_embeddings=64, deepstack_visual_indexes=[0])  # fmt: skip


def tiny_qwen3_vl_config(family: str = "krea2", configs: str = "configs") -> Qwen3VLConfig:
    """The tiny Qwen3-VL's config: the `family`'s `<configs>/text_encoder/tiny` as its language model, a
    one-block vision tower."""
    text = Qwen3VLTextConfig.from_pretrained(tiny_config(family, "text_encoder", configs=configs))
    vision = dict(_TINY_VISION, out_hidden_size=text.hidden_size)  # the tower projects onto the text width
    return Qwen3VLConfig(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=True)


def tiny_qwen3_vl(seed: int, family: str = "krea2") -> Qwen3VLModel:
    """The tiny Qwen3-VL (`tiny_qwen3_vl_config`), filled with `seed`."""
    return tiny_model(Qwen3VLModel, tiny_qwen3_vl_config(family), seed)


def build_krea2_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`: the arguments of
    `Krea2Pipeline` (transformer, vae, text_encoder, tokenizer, scheduler, text_encoder_select_layers)."""
    text_encoder = tiny_qwen3_vl(seed + 2)
    tokenizer = build_qwen2_tokenizer([PREFIX.replace("{}", "\n"), SUFFIX, "user\nassistant\n"])
    assert len(tokenizer) <= text_encoder.config.text_config.vocab_size, (
        "the tiny vocabulary outgrew the tiny config"
    )
    return {
        "transformer": _quiet_block_modulation_(
            tiny_model(Krea2Transformer2DModel, tiny_config("krea2", "transformer"), seed)
        ),
        "vae": tiny_model(AutoencoderKLQwenImage, tiny_config("qwen_image", "vae"), seed + 1),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG),
        "text_encoder_select_layers": tapped_layers(text_encoder.config.text_config.num_hidden_layers),
    }


@torch.no_grad()
def _quiet_block_modulation_(transformer: Krea2Transformer2DModel) -> Krea2Transformer2DModel:
    """Scale the blocks' modulation (the shared `time_mod_proj` and each block's table) by 1/4. Its gates
    scale each block's update; a trained model's are small (zero-initialized as in DiT), a random one's
    let every block replace the residual stream, and a few percent of fp8 rounding per weight then
    compounds past the contract suite's 5% bound on the output."""
    for name, param in transformer.named_parameters():
        if name.startswith("time_mod_proj.") or (
            name.startswith("transformer_blocks.") and "scale_shift" in name
        ):
            param.mul_(0.25)
    return transformer


def write_krea2_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Krea 2 model under `out_dir` in both layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file, tokenizer (the
    single-file layout's tokenizer folder). Existing `diffusers/` and `single/` folders under `out_dir` are
    replaced only once the new ones are complete.
    """
    parts = build_krea2_components(seed)
    single = {
        "transformer_file": (TRANSFORMER_FILE, KREA2_LAYOUT.to_original(parts["transformer"].state_dict())),
        "vae_file": (VAE_FILE, vae_to_original(parts["vae"].state_dict())),
        "text_encoder_file": (
            TEXT_ENCODER_FILE,
            {f"model.{k}": v for k, v in parts["text_encoder"].state_dict().items()},
        ),
    }
    return write_layouts(out_dir, "krea2", Krea2Pipeline(**parts), single, tokenizer_folders(parts))


FIXTURE = Fixture(
    write=write_krea2_fixture,
    # every part as a ComfyUI single file (the tokenizer from its folder)
    model_section=model_section(
        "krea2", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=TEXT_ENCODER_FILE
    ),
)
