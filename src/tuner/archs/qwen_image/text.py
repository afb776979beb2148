"""Qwen-Image's text encoder: Qwen2.5-VL, its tokenizer and image processor, and prompt encoding.

Qwen-Image conditions on the last hidden states of Qwen2.5-VL-7B-Instruct run over a chat-formatted
prompt. The facts below are those of diffusers' QwenImagePipeline / QwenImageEditPlusPipeline:

* text-to-image: the prompt goes into a fixed system + user template; the template's first 34 tokens
  (everything before the user's text) are dropped from the hidden states; the rest, the closing
  `<|im_end|>\\n<|im_start|>assistant\\n` tokens included, is the embedding, cut to the longest
  allowed length (512 tokens by default).
* edit (Qwen-Image-Edit-2509 / 2511, one or more control images): another system prompt (64 tokens
  dropped), and before the user's text one `Picture N: <|vision_start|><|image_pad|><|vision_end|>`
  per control image. Each control is resized to about 384×384 pixels (its aspect kept, sides multiples
  of 32), cut into 14-pixel patches by the Qwen2-VL image processor, and each `<|image_pad|>` is
  expanded to one token per 2×2 patches, which the vision tower's outputs replace. The kept rows thus
  include the image tokens. Without control images the edit template is used with no picture.
* The image tokens get 3-D (temporal, row, column) rotary positions computed from
  `mm_token_type_ids`. transformers 5 needs those ids passed explicitly; diffusers' edit pipelines
  do not pass them (diffusers issue #14194), which silently gives sequential positions. tuner passes
  them, matching the released model (and the pipeline once that is fixed).

Loading takes the diffusers folder (`text_encoder/` of a Qwen-Image release, with `tokenizer/` and, for
the edit models, `processor/` beside it) or ComfyUI's single file `qwen_2.5_vl_7b.safetensors`, which
is the Qwen2.5-VL checkpoint in the original Hugging Face layout: `model.layers.0...` for the language
model, `visual.blocks.0...` for the vision tower, and `lm_head.weight`. The hidden states do not use
the LM head, so tuner keeps only the base model (`Qwen2_5_VLModel`); a file without `lm_head` loads
too. A single file carries no tokenizer: pass the tokenizer folder (`tokenizer/` or `processor/` of a
Qwen-Image diffusers release).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from tuner.errors import CheckpointError
from tuner.models.encoders import load_encoder_file_on_meta, model_keys
from tuner.models.identify import SingleFileSpec, Variant
from tuner.models.loading import (
    load_tokenizer,
    read_folder_config,
    resolve_folder,
)

# transformers' model classes are imported where a model is built: importing them costs seconds
# (torch._dynamo among them), which a command that loads no model should not pay.
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, Qwen2_5_VLModel
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

CONFIGS = Path(__file__).parent / "configs" / "text_encoder"

# ---------------------------------------------------------------------------------------------------
# Prompt formats (QwenImagePipeline, QwenImageEditPlusPipeline)
# ---------------------------------------------------------------------------------------------------
TEXT_TO_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEXT_TO_IMAGE_DROP = 34
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
    "objects, background), then explain how the user's text instruction should alter or modify the image. "
    "Generate a new image that meets the user's requirements while maintaining consistency with the "
    "original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_DROP = 64
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
TOKENIZER_MAX_LENGTH = 1024  # the pipelines' tokenizer limit, on top of the dropped template tokens
CONDITION_AREA = 384 * 384  # pixels of a control image as the VL model sees it

# ---------------------------------------------------------------------------------------------------
# Known variants, in the ComfyUI (original Hugging Face) layout
# ---------------------------------------------------------------------------------------------------
VARIANTS = (
    Variant(
        "qwen2.5-vl-7b",
        CONFIGS / "qwen2.5-vl-7b",
        {
            "model.embed_tokens.weight": (152064, 3584),
            "model.layers.27.mlp.gate_proj.weight": (18944, 3584),
            "model.layers.28.mlp.gate_proj.weight": None,
            "visual.blocks.31.attn.qkv.weight": (3840, 1280),
        },
    ),
    Variant(  # the test fixture: 2 layers of width 64, a 2-block vision tower of width 32
        "tiny",
        CONFIGS / "tiny",
        {
            "model.embed_tokens.weight": (2048, 64),
            "model.layers.1.mlp.gate_proj.weight": (128, 64),
            "model.layers.2.mlp.gate_proj.weight": None,
            "visual.blocks.1.attn.qkv.weight": (96, 32),
        },
    ),
)

_LM_HEAD = "lm_head.weight"


def original_key(key: str) -> str:
    """A key of `Qwen2_5_VLModel` (`language_model.x`, `visual.x`) or of the full model as transformers 5
    saves it (`model.language_model.x`, `model.visual.x`) in the original layout (`model.x`, `visual.x`)."""
    if key.startswith("language_model."):
        return "model." + key.removeprefix("language_model.")
    if key.startswith("model.language_model."):  # the same model saved with its LM head (transformers 5)
        return "model." + key.removeprefix("model.language_model.")
    return key.removeprefix("model.")  # visual.*


SPEC = SingleFileSpec(
    what="Qwen2.5-VL text encoder",
    variants=VARIANTS,
    expected_keys=model_keys("Qwen2_5_VLModel", to_original=original_key),
    original_markers=("model.embed_tokens.weight", "visual.patch_embed.proj.weight"),
    diffusers_markers=("model.language_model.embed_tokens.weight", "model.visual.patch_embed.proj.weight"),
    to_original=original_key,
    # The LM head is not used (and is the embedding itself in the tied 3B model): identification ignores
    # it, loading drops it, so files with or without it load.
    aliases={_LM_HEAD: "model.embed_tokens.weight"},
)


@dataclass
class QwenTextEncoder:
    """What prompt encoding needs: the VL base model, the tokenizer, the image processor."""

    model: Qwen2_5_VLModel
    tokenizer: PreTrainedTokenizerBase
    image_processor: Qwen2VLImageProcessorPil

    def to(self, device: torch.device | str) -> QwenTextEncoder:
        self.model.to(device)
        return self


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def load_text_encoder(
    path: str | Path,
    tokenizer_path: str | Path | None,
    dtype: torch.dtype,
    spec: SingleFileSpec = SPEC,
    folders: tuple[str, str] = ("text_encoder", "tokenizer"),
) -> QwenTextEncoder:
    """Load Qwen2.5-VL (base model, eval mode), its tokenizer and image processor.

    `tokenizer_path` may be None when `path` is a diffusers pipeline root or its `text_encoder` folder
    (the sibling `tokenizer/` is used); a single file needs it. The image processor's settings come
    from a `preprocessor_config.json` in the tokenizer folder or a sibling `processor/` folder, else
    Qwen2-VL's defaults (those of the released models). `spec` names the sizes a single file may have
    (Qwen-Image's 7B by default) and `folders` the pipeline's (text encoder, tokenizer) subfolders
    (OmniGen2's release calls them `mllm/` and `processor/`).
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    subfolder, tokenizer_folder = folders
    folder = resolve_folder(path, subfolder)
    if folder is not None:
        if read_folder_config(folder).get("model_type") != "qwen2_5_vl":
            raise CheckpointError(
                f"{folder}: config.json does not describe a Qwen2.5-VL model (model_type 'qwen2_5_vl')."
            )
        try:
            full = Qwen2_5_VLForConditionalGeneration.from_pretrained(
                folder, dtype=dtype, local_files_only=True
            )
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{folder}: cannot be loaded as Qwen2.5-VL: {e}") from None
        model = full.model
        if tokenizer_path is None and (folder.parent / tokenizer_folder).is_dir():
            tokenizer_path = folder.parent / tokenizer_folder
    else:
        model = load_single_file(Path(path), dtype, spec)
    tokenizer = load_tokenizer(
        tokenizer_path,
        path,
        "Qwen2.5-VL tokenizer (the tokenizer/ folder of Qwen-Image, processor/ of OmniGen2)",
    )
    return QwenTextEncoder(model.eval(), tokenizer, _load_image_processor(Path(tokenizer_path)))


def load_single_file(path: Path, dtype: torch.dtype, spec: SingleFileSpec = SPEC) -> Qwen2_5_VLModel:
    from transformers import Qwen2_5_VLModel

    return load_encoder_file_on_meta(path, dtype, Qwen2_5_VLModel, spec, _model_keys, "Qwen2.5-VL")


def _model_keys(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors under `Qwen2_5_VLModel`'s keys (from the original layout or transformers 5's),
    the unused LM head left out."""
    stored = {k: v for k, v in stored.items() if k not in (_LM_HEAD, "model." + _LM_HEAD)}
    if SPEC.original_markers[0] not in stored:  # saved from transformers 5 (`model.language_model.*`)
        stored = {original_key(k): v for k, v in stored.items()}
    # the inverse of `original_key` on the model's keys (`model.x` -> `language_model.x`; `visual.x` kept)
    return {
        ("language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
        for k, v in stored.items()
    }


def _load_image_processor(tokenizer_path: Path) -> Qwen2VLImageProcessorPil:
    """The PIL implementation (torchvision is not needed); same settings as the release's processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    for folder in (tokenizer_path, tokenizer_path.parent / "processor"):
        if (folder / "preprocessor_config.json").is_file():
            return Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True)
    return Qwen2VLImageProcessorPil()


# ---------------------------------------------------------------------------------------------------
# Prompt encoding
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_prompts(
    encoder: QwenTextEncoder, captions: list[str], max_length: int = 512
) -> list[torch.Tensor]:
    """Text-to-image embeddings, one [L, D] tensor per caption at its true length (L ≤ max_length)."""
    tokens = encoder.tokenizer(
        [TEXT_TO_IMAGE_TEMPLATE.format(c) for c in captions],
        max_length=TOKENIZER_MAX_LENGTH + TEXT_TO_IMAGE_DROP,
        padding=True,
        truncation=True,
        return_tensors="pt",
    )
    rows = hidden_rows(encoder.model, tokens.input_ids, tokens.attention_mask)
    return [r[TEXT_TO_IMAGE_DROP:][:max_length] for r in rows]


@torch.no_grad()
def encode_edit_prompts(
    encoder: QwenTextEncoder, captions: list[str], images: list[list[Image.Image | torch.Tensor]]
) -> list[torch.Tensor]:
    """Edit embeddings: each caption with its own control images (PIL, or tensors [3, (1,) H, W] in
    [-1, 1]), one [L, D] tensor per caption. Not cut to a maximum length, as in the pipeline."""
    processor = encoder.image_processor
    texts, pixel_values, grids = [], [], []
    for caption, controls in zip(captions, images):
        pictures = [_condition_image(c) for c in controls]
        prompt = EDIT_TEMPLATE.format("".join(PICTURE.format(i + 1) for i in range(len(pictures))) + caption)
        if pictures:
            processed = processor(images=pictures, return_tensors="pt")
            pixel_values.append(processed["pixel_values"])
            grids.append(processed["image_grid_thw"])
            pads = iter(int(g.prod()) // processor.merge_size**2 for g in processed["image_grid_thw"])
            prompt = _expand_image_pads(prompt, pads)
        texts.append(prompt)
    tokens = encoder.tokenizer(texts, padding=True, return_tensors="pt")
    image_inputs = {}
    if pixel_values:
        image_token = encoder.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        image_inputs = {
            "pixel_values": torch.cat(pixel_values),
            "image_grid_thw": torch.cat(grids),
            "mm_token_type_ids": (tokens.input_ids == image_token).int(),
        }
    rows = hidden_rows(encoder.model, tokens.input_ids, tokens.attention_mask, **image_inputs)
    return [r[EDIT_DROP:] for r in rows]


def hidden_rows(model: Qwen2_5_VLModel, input_ids, attention_mask, **image_inputs) -> list[torch.Tensor]:
    """The last hidden state at each sequence's unmasked positions."""
    device = model.device
    extra = {k: v.to(device) for k, v in image_inputs.items()}  # the model casts pixels to its dtype
    out = model(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        output_hidden_states=True,
        **extra,
    )
    hidden = out.hidden_states[-1]
    return [h[m.bool()] for h, m in zip(hidden, attention_mask.to(device))]


def _expand_image_pads(prompt: str, counts) -> str:
    """Replace each `<|image_pad|>` by as many copies as its image has merged patches."""
    pieces = prompt.split(IMAGE_PAD)
    out = pieces[0]
    for piece in pieces[1:]:
        out += IMAGE_PAD * next(counts) + piece
    return out


def condition_size(width: int, height: int, area: int = CONDITION_AREA) -> tuple[int, int]:
    """(width, height) of about `area` pixels with the aspect ratio of width × height, sides rounded
    to multiples of 32 (the pipelines' `calculate_dimensions`)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


def _condition_image(image: Image.Image | torch.Tensor) -> Image.Image:
    """A control image resized for the VL model (Lanczos, as the pipelines' image processor does)."""
    if isinstance(image, torch.Tensor):
        pixels = image.detach().float().cpu()
        pixels = pixels[:, 0] if pixels.ndim == 4 else pixels  # [3, 1, H, W] → [3, H, W]
        array = ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        image = Image.fromarray(np.ascontiguousarray(array))
    image = image.convert("RGB")
    return image.resize(condition_size(*image.size), resample=Image.LANCZOS)
