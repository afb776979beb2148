"""Ideogram 4's text encoder: the language model of Qwen3-VL-8B, its tokenizer, and prompt encoding.

Ideogram 4 conditions on a *stack* of hidden states: the outputs of decoder layers 0, 3, 6, ..., 33 and 35
(`LAYERS`, Ideogram4Pipeline's `QWEN3_VL_ACTIVATION_LAYERS`), 13 of them side by side per token: 13 x 4096
= 53,248 values (the transformer's `llm_features_dim`). The prompt is the chat turn Qwen3-VL's template
writes for one user text message with the generation prompt (`PREFIX` + caption + `SUFFIX`, no system
turn), and every token of it is kept. Each caption is encoded on its own at its true length (the pipeline
left-pads to 2048 with positions counting real tokens only and a padding mask, which gives the same rows).
A caption longer than `max_length` tokens is cut (the pipeline refuses it). The empty caption is no text at
all (zero rows): the pipeline's unconditional pass sees the image tokens alone, and so do tuner's guidance
pass with the empty negative prompt and a caption dropped in training.

Only text is encoded, so only the language model is loaded (`tuner.models.qwen3_vl`): from the diffusers
folder (`text_encoder/` with `tokenizer/` beside it) or ComfyUI's single file
(`qwen3vl_8b_fp8_scaled.safetensors`, dequantized) with the `tokenizer/` folder of the release.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tuner.models.identify import variant_table
from tuner.models.qwen3_vl import COLUMNS, TextEncoder, language_model_spec, load_language_model

CONFIGS = Path(__file__).parent / "configs" / "text_encoder"

LAYERS = (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 35)
"""The decoder layers whose outputs are stacked per token (diffusers' `QWEN3_VL_ACTIVATION_LAYERS`)."""

PREFIX = "<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"

VARIANTS = variant_table(
    CONFIGS,
    COLUMNS,
    {
        "qwen3-vl-8b": ((151936, 4096), (36, (12288, 4096))),
        # the test fixture: 36 layers (the pipeline reads the 36th) of width 32
        "tiny": ((2048, 32), (36, (64, 32))),
    },
)  # fmt: skip

SPEC = language_model_spec("Qwen3-VL-8B text encoder", VARIANTS)


def load_text_encoder(path: str | Path, tokenizer_path: str | Path | None, dtype: torch.dtype) -> TextEncoder:
    """Qwen3-VL's language model and its tokenizer (`tuner.models.qwen3_vl.load_language_model`)."""
    return load_language_model(
        path, tokenizer_path, dtype, SPEC, "Qwen3-VL tokenizer (the tokenizer/ folder of Ideogram 4)"
    )


@torch.no_grad()
def encode_prompts(encoder: TextEncoder, captions: list[str], max_length: int = 2048) -> list[torch.Tensor]:
    """One [L, 13 · D] float32 tensor per caption: the stacked layer outputs of every token of its chat
    turn, L ≤ `max_length`."""
    model, tokenizer = encoder
    suffix = tokenizer(SUFFIX, add_special_tokens=False, return_tensors="pt").input_ids
    taps: dict[int, torch.Tensor] = {}
    hooks = [model.layers[i].register_forward_hook(_keep(taps, i)) for i in LAYERS]
    try:
        out = []
        for caption in captions:
            if not caption:
                out.append(torch.zeros(0, len(LAYERS) * model.config.hidden_size))
                continue
            text = tokenizer(PREFIX + caption, add_special_tokens=False, return_tensors="pt", truncation=True,
                             max_length=max(1, max_length - suffix.shape[1])).input_ids  # fmt: skip
            model(input_ids=torch.cat([text, suffix], 1).to(model.device))
            out.append(torch.stack([taps[i][0] for i in LAYERS], -1).flatten(1).float())
    finally:
        for hook in hooks:
            hook.remove()
    return out


def _keep(taps: dict[int, torch.Tensor], index: int):
    def hook(module, args, output):
        taps[index] = output[0] if isinstance(output, tuple) else output

    return hook
