"""ERNIE-Image's text encoder: the language model of Ministral 3 3B, its tokenizer, and prompt encoding.

ErnieImagePipeline (`encode_prompt`) tokenizes each prompt on its own, as it is (no chat template, the
tokenizer's BOS added, no padding), and takes the **second-to-last** hidden state (`hidden_states[-2]`,
the output of the last-but-one decoder layer) of every token: one [L, 3072] tensor per prompt, at its true
length. ComfyUI's `comfy/text_encoders/ernie.py` reads the same layer (`layer_idx=-2`). Captions longer
than `max_length` tokens are cut.

The model is transformers' `Mistral3Model` (Ministral 3 3B: a language model of 26 layers of width 3072
and a Pixtral vision tower, unused for text); tuner builds its language model alone (`Ministral3Model`)
through FLUX.2's Mistral loader (`tuner.archs.flux2.text.load_text_encoder`, which this module gives its
own `LanguageModel` kind): the diffusers folder's `text_encoder/` (with `tokenizer/` beside it) or a
single file holding the language model as `model.language_model.*`, `language_model.model.*` or `model.*`
(ComfyUI's `ministral-3-3b.safetensors`; fp8 dequantized). A single file carries no tokenizer: pass the
release's `tokenizer/` folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tuner.archs.flux2.text import LanguageModel, TextEncoder
from tuner.models.encoders import DECODER_COLUMNS
from tuner.models.identify import variant_table

CONFIGS = Path(__file__).parent / "configs" / "text_encoder"

MINISTRAL3 = LanguageModel(
    what="Ministral 3 3B text encoder (ERNIE-Image)",
    architecture="ernie_image",
    model_class="Ministral3Model",
    config_class="Ministral3Config",
    model_types=("mistral3", "ministral3"),
    variants=variant_table(
        CONFIGS,
        DECODER_COLUMNS,
        {
            "ministral-3-3b": ((131072, 3072), (26, (9216, 3072))),
            "tiny": ((1024, 32), (3, (64, 32))),  # the fixture: 3 layers of width 32
        },
    ),
    layers=(-2,),  # the second-to-last hidden state
    tokenizer_hint="Ministral 3 tokenizer (the tokenizer/ folder of baidu/ERNIE-Image)",
    chat=False,
)


@torch.no_grad()
def encode_prompts(encoder: TextEncoder, captions: list[str], max_length: int = 512) -> list[torch.Tensor]:
    """One [L, D] tensor per caption (L ≤ `max_length`): its second-to-last hidden states, each caption
    encoded on its own as ErnieImagePipeline.encode_prompt does (an empty one gives the BOS token alone)."""
    model, tokenizer, kind = encoder
    device = next(model.parameters()).device
    out = []
    for caption in captions:
        ids = tokenizer(caption, add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
        ids = ids or [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0]
        states = model(
            input_ids=torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False
        )
        out.append(torch.cat([states.hidden_states[i][0] for i in kind.layers], dim=-1))
    return out
