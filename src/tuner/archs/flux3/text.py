"""FLUX.3's text encoder: the language model of Qwen3-VL-4B, its tokenizer, and prompt encoding.

The facts are those of diffusers' modular FLUX.3 pipeline (`Flux3TextEncoderStep` in
`diffusers/modular_pipelines/flux3/encoders.py`). A prompt is one user message through the chat template
(with the generation prompt), right-padded with the pad token to a **window**: its length rounded up to a
multiple of 80 tokens, capped at `max_length`. The padding is masked inside Qwen3-VL but the transformer
attends to every row of the window, so the window is part of the recipe. The padding tokens take position
1 on every rotary axis (the position transformers 4.57, the training environment, gave them; the pipeline
passes the positions explicitly). The text embedding of a token is the hidden states after layers 4, 8,
..., 32 (`LAYERS`) concatenated: [window, 8 · 2560] for Qwen3-VL-4B, matching the transformer's
`joint_attention_dim` of 20480.

Only the language model is loaded (`tuner.models.qwen3_vl`): from the diffusers folder (`text_encoder/`
with `tokenizer/` beside it) or the Hugging Face checkpoint as one file (`model.language_model.*`) with
the release's `tokenizer/` folder.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tuner.models.identify import variant_table
from tuner.models.qwen3_vl import COLUMNS, TextEncoder, language_model_spec, load_language_model

CONFIGS = Path(__file__).parent / "configs" / "text_encoder"

LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)
"""The `hidden_states` indices concatenated per token (the pipeline's `text_encoder_out_layers`)."""
PAD_MULTIPLE = 80
"""The text window is the prompt's token count rounded up to a multiple of this (`pad_multiple`)."""
PAD_POSITION = 1
"""The rotary position of every padding token."""

VARIANTS = variant_table(
    CONFIGS,
    COLUMNS,
    {
        "qwen3-vl-4b": ((151936, 2560), (36, (9728, 2560))),
        # the test fixture: 32 layers (LAYERS reads up to the 32nd) of width 16
        "tiny": ((2048, 16), (32, (32, 16))),
    },
)  # fmt: skip

SPEC = language_model_spec("Qwen3-VL text encoder (FLUX.3)", VARIANTS)


def load_text_encoder(path: str | Path, tokenizer_path: str | Path | None, dtype: torch.dtype) -> TextEncoder:
    """Qwen3-VL's language model and its tokenizer (`tuner.models.qwen3_vl.load_language_model`)."""
    return load_language_model(
        path, tokenizer_path, dtype, SPEC, "Qwen3-VL tokenizer (the tokenizer/ folder of FLUX.3)"
    )


@torch.no_grad()
def encode_prompts(encoder: TextEncoder, captions: list[str], max_length: int = 8192) -> list[torch.Tensor]:
    """One [window, 8·D] tensor per caption, each encoded on its own as the pipeline encodes its prompt
    (`max_length` is its `max_sequence_length`: longer prompts are cut)."""
    model, tokenizer = encoder
    out = []
    for caption in captions:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": caption}], tokenize=False, add_generation_prompt=True
        )
        length = len(tokenizer(text, truncation=True, max_length=max_length)["input_ids"])
        window = min(math.ceil(length / PAD_MULTIPLE) * PAD_MULTIPLE, max_length)
        tokens = tokenizer(
            text, padding="max_length", padding_side="right", truncation=True, max_length=window,
            return_tensors="pt",
        )  # fmt: skip
        ids, mask = tokens["input_ids"].to(model.device), tokens["attention_mask"].to(model.device)
        positions = torch.arange(window, device=model.device)[None].masked_fill(mask == 0, PAD_POSITION)
        states = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            output_hidden_states=True,
            use_cache=False,
        )
        out.append(torch.cat([states.hidden_states[i][0] for i in LAYERS], dim=-1))
    return out
