"""Z-Image's text encoder: Qwen3-4B, its tokenizer, and prompt encoding.

Z-Image conditions on Qwen3's **second-to-last** hidden states (`hidden_states[-2]`: the output of the
last-but-one decoder layer, before the final norm) over the prompt in Qwen3's chat format with thinking
enabled, which for one user message is exactly `TEMPLATE`. Unlike Qwen-Image, nothing is dropped: every
token of the templated prompt, up to `max_length` (512 in ZImagePipeline), is a row of the embedding,
kept at its true length (the pipeline selects the rows by the attention mask).

Loading takes the diffusers folder (`text_encoder/` of `Tongyi-MAI/Z-Image-Turbo`, with `tokenizer/`
beside it) or ComfyUI's single file `qwen_3_4b.safetensors`: the Hugging Face checkpoint of
Qwen3-4B (`model.embed_tokens.weight`, `model.layers.0...`; `lm_head.weight` when present is dropped,
the hidden states do not use it). A single file carries no tokenizer: pass the tokenizer folder
(`tokenizer/` of a Z-Image diffusers release, or Qwen3-4B's).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from tuner.models.encoders import CAUSAL_LM_COLUMNS, load_encoder_file_on_meta, model_keys
from tuner.models.identify import SingleFileSpec, variant_table
from tuner.models.loading import (
    load_tokenizer,
    load_transformers_folder,
    resolve_folder,
    sibling,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, Qwen3Model

CONFIGS = Path(__file__).parent / "configs" / "text_encoder"

TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
"""Qwen3's chat template for one user message with `add_generation_prompt=True, enable_thinking=True`
(ZImagePipeline's call): no system prompt, no empty think block."""

VARIANTS = variant_table(
    CONFIGS,
    CAUSAL_LM_COLUMNS,
    {
        "qwen3-4b": ((151936, 2560), (36, (9728, 2560))),
        # the test fixture: 2 layers of width 64
        "tiny": ((2048, 64), (2, (128, 64))),
    },
)  # fmt: skip

_LM_HEAD = "lm_head.weight"


def original_key(key: str) -> str:
    """A `Qwen3Model` key (`layers.0...`) in the Hugging Face checkpoint's layout (`model.layers.0...`)."""
    return "model." + key


SPEC = SingleFileSpec(
    what="Qwen3 text encoder",
    variants=VARIANTS,
    expected_keys=model_keys("Qwen3Model", to_original=original_key),
    original_markers=("model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight"),
    aliases={_LM_HEAD: "model.embed_tokens.weight"},  # tied in Qwen3-4B; unused here
)


class TextEncoder(NamedTuple):
    """Qwen3 (base model, eval mode) and its tokenizer."""

    model: Qwen3Model
    tokenizer: PreTrainedTokenizerBase


def load_text_encoder(
    path: str | Path,
    tokenizer_path: str | Path | None,
    dtype: torch.dtype,
    spec: SingleFileSpec = SPEC,
    tokenizer_what: str = "Qwen3 tokenizer (the tokenizer/ folder of Z-Image)",
) -> TextEncoder:
    """Load Qwen3 and its tokenizer. `tokenizer_path` may be None for a diffusers pipeline root or its
    `text_encoder/` folder (the sibling `tokenizer/` is used); a single file needs it. `spec` tells the
    single files' sizes apart (another model's Qwen3: Anima's 0.6B)."""
    from transformers import Qwen3Model

    folder = resolve_folder(path, "text_encoder")
    if folder is not None:
        model = load_transformers_folder(Qwen3Model, folder, dtype, "qwen3")
        tokenizer_path = tokenizer_path or sibling(folder, "tokenizer")
    else:
        model = load_encoder_file_on_meta(Path(path), dtype, Qwen3Model, spec, _model_keys, "Qwen3")
    tokenizer = load_tokenizer(tokenizer_path, path, tokenizer_what)
    return TextEncoder(model.eval(), tokenizer)


def _model_keys(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors under `Qwen3Model`'s keys, the unused LM head left out."""
    return {k.removeprefix("model."): v for k, v in stored.items() if k != _LM_HEAD}


@torch.no_grad()
def encode_prompts(encoder: TextEncoder, captions: list[str], max_length: int = 512) -> list[torch.Tensor]:
    """One [L, D] tensor per caption: Qwen3's second-to-last hidden states of the templated caption at
    its true length (L ≤ max_length). Padding to the batch's longest leaves the real rows unchanged
    (causal attention), so the result equals ZImagePipeline's padding to `max_length`."""
    model, tokenizer = encoder
    tokens = tokenizer(
        [TEMPLATE.format(c) for c in captions],
        max_length=max_length,
        padding=True,
        truncation=True,
        return_tensors="pt",
    )
    mask = tokens.attention_mask.to(model.device).bool()
    hidden = model(
        input_ids=tokens.input_ids.to(model.device), attention_mask=mask, output_hidden_states=True
    ).hidden_states[-2]
    return [h[m] for h, m in zip(hidden, mask, strict=True)]
