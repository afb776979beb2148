"""Qwen3-VL's language model as a text encoder: its single-file spec and its loader (Krea 2, Ideogram 4).

The families that condition on Qwen3-VL's hidden states encode text only, so only the language model
(`Qwen3VLTextModel`) is loaded; the vision tower and the LM head are not used. It loads from a diffusers
folder (`text_encoder/`, a `Qwen3VLModel`, with `tokenizer/` beside it) or from the Hugging Face
checkpoint as one file (ComfyUI's `qwen3vl_*.safetensors`, bf16 or fp8 scaled), whose language model sits
under `model.language_model.` (`LANGUAGE_MODEL`). A single file carries no tokenizer: the release's
`tokenizer/` folder (Qwen3-VL's) is passed with it.

Each family declares the sizes it knows (`variant_table` over `COLUMNS`, its configs in its folder) and
names them in `language_model_spec`; how the prompt is templated and which layers it reads stay with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from tuner.models.encoders import load_encoder_file_on_meta, model_keys
from tuner.models.identify import SingleFileSpec, Variant
from tuner.models.loading import load_tokenizer, load_transformers_folder, resolve_folder, sibling

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, Qwen3VLTextModel

LANGUAGE_MODEL = "model.language_model."
"""Where the Hugging Face Qwen3-VL checkpoint keeps the language model."""

COLUMNS = (f"{LANGUAGE_MODEL}embed_tokens.weight", LANGUAGE_MODEL + "layers.{}.mlp.gate_proj.weight")
"""A variant table's signature: the vocabulary and width, and the depth with the MLP's width."""


class TextEncoder(NamedTuple):
    """Qwen3-VL's language model (eval mode) and its tokenizer."""

    model: Qwen3VLTextModel
    tokenizer: PreTrainedTokenizerBase


def language_model_spec(what: str, variants: tuple[Variant, ...]) -> SingleFileSpec:
    """The `SingleFileSpec` of a Hugging Face Qwen3-VL file whose language model is one of `variants`."""
    return SingleFileSpec(
        what=what,
        variants=variants,
        expected_keys=model_keys("Qwen3VLTextModel", to_original=lambda k: LANGUAGE_MODEL + k),
        original_markers=(
            f"{LANGUAGE_MODEL}embed_tokens.weight",
            f"{LANGUAGE_MODEL}layers.0.self_attn.q_norm.weight",
        ),
    )


def load_language_model(
    path: str | Path,
    tokenizer_path: str | Path | None,
    dtype: torch.dtype,
    spec: SingleFileSpec,
    tokenizer_what: str,
    tokenizer_folder: str = "tokenizer",
) -> TextEncoder:
    """Qwen3-VL's language model and its tokenizer. `tokenizer_path` may be None for a diffusers pipeline
    root or its `text_encoder/` folder (the sibling `tokenizer_folder` is used: `processor` where the
    pipeline keeps a Qwen3-VL processor); a single file (identified by `spec`) needs it, and
    `tokenizer_what` says which one in the error when it is missing."""
    from transformers import Qwen3VLModel, Qwen3VLTextModel

    folder = resolve_folder(path, "text_encoder")
    if folder is not None:
        model = load_transformers_folder(Qwen3VLModel, folder, dtype, "qwen3_vl").language_model
        tokenizer_path = tokenizer_path or sibling(folder, tokenizer_folder)
    else:
        model = load_encoder_file_on_meta(
            path, dtype, Qwen3VLTextModel, spec, _model_keys, "Qwen3-VL", entries=_language_model
        )
    return TextEncoder(model.eval(), load_tokenizer(tokenizer_path, path, tokenizer_what))


def _language_model(entries: dict) -> dict:
    """The file's language-model entries (the vision tower and the LM head are not used)."""
    return {k: v for k, v in entries.items() if k.startswith(LANGUAGE_MODEL)}


def _model_keys(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix(LANGUAGE_MODEL): v for k, v in stored.items()}
