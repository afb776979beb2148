"""Krea 2's text encoder: the language model of Qwen3-VL-4B, its tokenizer, and prompt encoding.

Krea 2 conditions on a *stack* of hidden states: the outputs of every third decoder layer from the second
(`hidden_states[2], [5], ..., [35]`: 12 of Qwen3-VL-4B's 37, `tapped_layers`), one [12, 2560] slab per
token, which the transformer's text-fusion stage collapses. The prompt is Qwen-Image's chat template
(`PREFIX` + caption + `SUFFIX`); the first 34 tokens (the system prefix) are dropped from the output.
Krea2Pipeline pads the caption to a fixed length *before* the suffix and gives the tokens positions that
count real tokens only (padding takes no position); tuner keeps each caption at its true length, which
gives the same rows (causal attention, padding masked), and the transformer's text tokens carry no
position, so their order past the caption does not matter.

Only text is encoded, so only the language model is loaded (`tuner.models.qwen3_vl`): from the diffusers
folder (`text_encoder/` with `tokenizer/` beside it) or ComfyUI's single file (`qwen3vl_4b_bf16.safetensors`,
fp8 too) with the `tokenizer/` folder of the release.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tuner.models.identify import variant_table
from tuner.models.qwen3_vl import COLUMNS, TextEncoder, language_model_spec, load_language_model

CONFIGS = Path(__file__).parent / "configs" / "text_encoder"

# Krea2Pipeline's template (Qwen-Image's): the prefix is dropped from the output, the suffix follows the caption
PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
PREFIX_TOKENS = 34
SUFFIX_TOKENS = 5

VARIANTS = variant_table(
    CONFIGS,
    COLUMNS,
    {
        "qwen3-vl-4b": ((151936, 2560), (36, (9728, 2560))),
        # the test fixture: 6 layers of width 64
        "tiny": ((2048, 64), (6, (128, 64))),
    },
)  # fmt: skip

SPEC = language_model_spec("Qwen3-VL text encoder", VARIANTS)


def tapped_layers(num_hidden_layers: int) -> tuple[int, ...]:
    """The `hidden_states` indices stacked per token: every third from the second (Krea2Pipeline's
    `text_encoder_select_layers` for Qwen3-VL-4B, 2, 5, ..., 35)."""
    return tuple(range(2, num_hidden_layers + 1, 3))


def load_text_encoder(path: str | Path, tokenizer_path: str | Path | None, dtype: torch.dtype) -> TextEncoder:
    """Qwen3-VL's language model and its tokenizer (`tuner.models.qwen3_vl.load_language_model`)."""
    return load_language_model(
        path, tokenizer_path, dtype, SPEC, "Qwen3-VL tokenizer (the tokenizer/ folder of Krea 2)"
    )


@torch.no_grad()
def encode_prompts(encoder: TextEncoder, captions: list[str], max_length: int = 512) -> list[torch.Tensor]:
    """One [L, layers, D] tensor per caption: the tapped hidden states of the caption and the suffix (the
    system prefix dropped), L ≤ `max_length` (the pipeline's `max_sequence_length`; longer captions are cut
    as it cuts them)."""
    model, tokenizer = encoder
    text = tokenizer(
        [PREFIX + c for c in captions],
        truncation=True,
        padding=True,
        padding_side="right",
        max_length=max_length + PREFIX_TOKENS - SUFFIX_TOKENS,
        return_tensors="pt",
    )
    suffix = tokenizer([SUFFIX] * len(captions), return_tensors="pt")
    ids = torch.cat([text.input_ids, suffix.input_ids], dim=1).to(model.device)
    mask = torch.cat([text.attention_mask, suffix.attention_mask], dim=1).to(model.device).bool()
    # positions count real tokens only, on all three mRoPE axes (text: t = h = w)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
    states = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    taps = tapped_layers(model.config.num_hidden_layers)
    hidden = torch.stack([states.hidden_states[i] for i in taps], dim=2)[:, PREFIX_TOKENS:]
    return [h[m] for h, m in zip(hidden, mask[:, PREFIX_TOKENS:], strict=True)]
