"""A tiny random-weight Qwen-Image / Qwen-Image-Edit model, written in both layouts users have.

The models are built from the `tiny` configs shipped with `tuner.archs.qwen_image.loaders` and
`tuner.archs.qwen_image.text` (transformer: 2 heads of 32, 2 blocks, text width 64; VAE: base width
16 with the real 8× spatial compression and 16 latent channels; Qwen2.5-VL: 2 layers of width 64 and a
2-block vision tower of width 32 with the real 14-pixel patches and 2×2 merge), so loaders recognise
them like real checkpoints. The tokenizer is a byte-level BPE learned from the prompt templates and
caption words, so the templates drop exactly as many tokens as with the real tokenizer (34 and 64).

    out_dir/
      diffusers/                      what `QwenImagePipeline.from_pretrained(out_dir/"diffusers")` loads
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  scheduler/
        processor/                    edit fixture only (QwenImageEditPlusPipeline; its loading also
                                      needs torchvision, which transformers' Qwen2VLProcessor requires)
      single/                         the ComfyUI single-file layout
        qwen_image_tiny.safetensors   release keys = diffusers keys (transformer_blocks.0.attn.to_q.weight)
        qwen_image_vae.safetensors    original Wan VAE keys (encoder.conv1.weight, ...)
        qwen_2.5_vl_tiny.safetensors  original Qwen2.5-VL keys (model.layers.0..., visual.blocks.0..., lm_head)
        tokenizer/

Both layouts hold the same float32 weights.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tuner.archs.qwen_image.text import EDIT_TEMPLATE, PICTURE, TEXT_TO_IMAGE_TEMPLATE, original_key
from tuner.archs.wan.keys import vae_to_original
from tuner.fixtures import Fixture, model_section, tokenizer_folders, write_layouts
from tuner.fixtures.tokenizers import build_qwen2_tokenizer
from tuner.fixtures.weights import tiny_config, tiny_model

TRANSFORMER_FILE = "qwen_image_tiny.safetensors"
VAE_FILE = "qwen_image_vae.safetensors"
TEXT_ENCODER_FILE = "qwen_2.5_vl_tiny.safetensors"

# Qwen/Qwen-Image's scheduler_config.json: exponential time shift with μ from the image-token count.
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}


def tiny_qwen_vl(seed: int) -> Qwen2_5_VLForConditionalGeneration:
    """The tiny Qwen2.5-VL (`configs/text_encoder/tiny`), filled with `seed`; Kandinsky 5's and
    HunyuanVideo 1.5's fixtures use it too."""
    return tiny_model(Qwen2_5_VLForConditionalGeneration, tiny_config("qwen_image", "text_encoder"), seed)


def qwen_vl_file(model: Qwen2_5_VLForConditionalGeneration) -> dict:
    """A Qwen2.5-VL in the original layout, as ComfyUI's file holds it (model.layers..., visual..., lm_head)."""
    return {(k if k == "lm_head.weight" else original_key(k)): v for k, v in model.state_dict().items()}


def build_qwen_image_components(seed: int = 0) -> dict:
    """The tiny pipeline's components (eval mode, float32), deterministic given `seed`.

    Keys: transformer, vae, text_encoder, tokenizer, scheduler (the arguments of `QwenImagePipeline`),
    and image_processor (what the edit pipelines' `Qwen2VLProcessor` wraps with the tokenizer).
    """
    text_encoder = tiny_qwen_vl(seed + 2)
    tokenizer = build_qwen2_tokenizer(
        [t.replace("{}", "\n") for t in (TEXT_TO_IMAGE_TEMPLATE, EDIT_TEMPLATE, PICTURE)]
        + ["user\nassistant\n"]
    )
    assert len(tokenizer) <= text_encoder.config.text_config.vocab_size, (
        "the tiny vocabulary outgrew the tiny config"
    )
    return {
        "transformer": tiny_model(
            QwenImageTransformer2DModel, tiny_config("qwen_image", "transformer"), seed
        ),
        "vae": tiny_model(AutoencoderKLQwenImage, tiny_config("qwen_image", "vae"), seed + 1),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG),
        "image_processor": Qwen2VLImageProcessorPil(),
    }


def write_qwen_image_fixture(out_dir: str | Path, seed: int = 0, edit: bool = False) -> dict[str, Path]:
    """Write the tiny Qwen-Image (or, with `edit`, Qwen-Image-Edit) model under `out_dir` in both
    layouts; returns the paths.

    Keys: root, diffusers (pipeline folder), transformer_file, vae_file, text_encoder_file, tokenizer
    (the single-file layout's tokenizer folder). Existing `diffusers/` and `single/` folders under
    `out_dir` are replaced only once the new ones are complete.
    """
    parts = build_qwen_image_components(seed)
    pipeline = QwenImagePipeline(**{k: v for k, v in parts.items() if k != "image_processor"})

    def diffusers(folder: Path) -> None:
        pipeline.save_pretrained(folder, safe_serialization=True)
        if edit:
            _add_edit_processor(folder, parts)

    single = {
        "transformer_file": (TRANSFORMER_FILE, parts["transformer"].state_dict()),
        "vae_file": (VAE_FILE, vae_to_original(parts["vae"].state_dict())),
        "text_encoder_file": (TEXT_ENCODER_FILE, qwen_vl_file(parts["text_encoder"])),
    }
    return write_layouts(out_dir, "qwen-image", diffusers, single, tokenizer_folders(parts))


def _add_edit_processor(folder: Path, parts: dict) -> None:
    """Turn a saved QwenImagePipeline folder into a QwenImageEditPlusPipeline one: the same components
    plus `processor/` (image processor settings + tokenizer), as the Qwen-Image-Edit-2509 release has.
    Written piecewise: transformers cannot build a Qwen2VLProcessor without torchvision."""
    parts["image_processor"].save_pretrained(folder / "processor")
    parts["tokenizer"].save_pretrained(folder / "processor")
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "QwenImageEditPlusPipeline"
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")


FIXTURE = Fixture(
    write=write_qwen_image_fixture,
    # every part as a ComfyUI single file (the tokenizer from its folder)
    model_section=model_section(
        "qwen_image", transformer=TRANSFORMER_FILE, vae=VAE_FILE, text_encoder=TEXT_ENCODER_FILE
    ),
)

EDIT_FIXTURE = Fixture(
    write=partial(write_qwen_image_fixture, edit=True),
    # the single-file transformer, the diffusers folder for the rest (text encoder with its processor)
    model_section=model_section(
        "qwen_image_edit", transformer=TRANSFORMER_FILE, vae="diffusers", text_encoder="diffusers"
    ),
)


# ---------------------------------------------------------------------------------------------------
# Qwen-Image 2.1
# ---------------------------------------------------------------------------------------------------

TRANSFORMER_21_FILE = "qwen_image_2.1_tiny.safetensors"
VAE_21_FILE = "qwen_image_2.1_vae.safetensors"
TEXT_ENCODER_21_FILE = "qwen3vl_tiny.safetensors"


def build_qwen_image_21_components(seed: int = 0) -> dict:
    """The tiny Qwen-Image 2.1 parts (eval mode, float32), deterministic given `seed`: transformer, vae,
    text_encoder (a Qwen3VLForConditionalGeneration, as the release's `text_encoder/`), tokenizer and
    scheduler (diffusers' default FlowMatchEulerDiscreteScheduler with the dynamic shift QwenImage21Pipeline
    computes μ for)."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
    from transformers import Qwen3VLForConditionalGeneration

    from tuner.archs.krea2.fixture import tiny_qwen3_vl_config
    from tuner.archs.qwen_image.qwen21 import PREFIX, SUFFIX

    text_encoder = tiny_model(
        Qwen3VLForConditionalGeneration, tiny_qwen3_vl_config("qwen_image", configs="configs_21"), seed + 2
    )
    tokenizer = build_qwen2_tokenizer([PREFIX, SUFFIX, "user\nassistant\n"])
    assert len(tokenizer) <= text_encoder.config.text_config.vocab_size, (
        "the tiny vocabulary outgrew the tiny config"
    )
    return {
        "transformer": tiny_model(
            QwenImage21Transformer2DModel,
            tiny_config("qwen_image", "transformer", configs="configs_21"),
            seed,
        ),
        "vae": tiny_model(
            AutoencoderKLQwenImage21, tiny_config("qwen_image", "vae", configs="configs_21"), seed + 1
        ),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
    }


def write_qwen_image_21_fixture(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Qwen-Image 2.1 under `out_dir` in both layouts; returns the paths (root, diffusers,
    transformer_file, vae_file, text_encoder_file, tokenizer).

    The diffusers folder is QwenImage21Pipeline's, written part by part: its `processor/` (a
    Qwen3VLProcessor) holds the tokenizer only, since transformers builds no Qwen3-VL processor without
    torchvision. The transformer file is in the release's layout (`img_mlp.gate_up` fused), the VAE file
    holds diffusers' keys, the text encoder file the Hugging Face checkpoint's."""
    from tuner.archs.qwen_image.qwen21 import QWEN_IMAGE_21_LAYOUT

    parts = build_qwen_image_21_components(seed)

    def diffusers(folder: Path) -> None:
        for name in ("transformer", "vae", "text_encoder", "scheduler"):
            parts[name].save_pretrained(folder / name)
        parts["tokenizer"].save_pretrained(folder / "processor")
        index = {
            "_class_name": "QwenImage21Pipeline",
            "processor": ["transformers", "Qwen3VLProcessor"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
            "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
            "vae": ["diffusers", "AutoencoderKLQwenImage21"],
        }
        (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")

    single = {
        "transformer_file": (
            TRANSFORMER_21_FILE,
            QWEN_IMAGE_21_LAYOUT.to_original(parts["transformer"].state_dict()),
        ),
        "vae_file": (VAE_21_FILE, parts["vae"].state_dict()),
        # the checkpoint's keys (`model.language_model.`, `model.visual.`); the tied LM head is not stored
        "text_encoder_file": (
            TEXT_ENCODER_21_FILE,
            {k: v for k, v in parts["text_encoder"].state_dict().items() if k != "lm_head.weight"},
        ),
    }
    return write_layouts(out_dir, "qwen-image-2.1", diffusers, single, tokenizer_folders(parts))


FIXTURE_21 = Fixture(
    write=write_qwen_image_21_fixture,
    # every part as a single file (the tokenizer from its folder)
    model_section=model_section(
        "qwen_image_21", transformer=TRANSFORMER_21_FILE, vae=VAE_21_FILE, text_encoder=TEXT_ENCODER_21_FILE
    ),
)
