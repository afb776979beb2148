"""HunyuanImage 2.1's text: Qwen2.5-VL-7B hidden states of the prompt, and ByT5 states of its quoted text.

Both encoders load as HunyuanVideo 1.5's do (its `loaders.load_text_encoders`): Qwen2.5-VL's language
model from a diffusers `text_encoder/` or ComfyUI's `qwen_2.5_vl_7b*.safetensors` (+ `tokenizer`),
Glyph-SDXL-v2's ByT5-small from `text_encoder_2/` or ComfyUI's `byt5_small_glyphxl_fp16.safetensors` (its
tokenizer is byte-level).

What `HunyuanImagePipeline.encode_prompt` computes (diffusers 0.42.1,
`pipelines/hunyuan_image/pipeline_hunyuanimage.py`):

* the prompt in `TEMPLATE` (Qwen-Image's text-to-image system prompt without the assistant turn),
  tokenized to `DROP` + `max_length` tokens (`tokenizer_max_length` 1000), the third-to-last hidden
  state (`hidden_states[-3]`) with the first `DROP` = 34 rows (the system prompt) and their mask cut;
* the quoted text of the prompt (`'...'`, `"..."`, `‘...’`, `“...”`, in that order of kinds, as
  `Text "a". Text "b". `), through ByT5 over `GLYPH_MAX_LENGTH` = 128 tokens; a prompt without quotes
  has no glyph tokens (the pipeline's zero rows, all masked).

Entries keep their true lengths; HunyuanVideo 1.5's `collate` pads a batch with masks. The transformer
masks padded rows, so padding to the pipeline's fixed lengths gives the same output.
"""

from __future__ import annotations

import re

import torch

from tuner.archs.hunyuan_video15.loaders import TextEncoders, glyph_states
from tuner.archs.qwen_image.text import TEXT_TO_IMAGE_DROP, TEXT_TO_IMAGE_TEMPLATE

TEMPLATE = TEXT_TO_IMAGE_TEMPLATE.removesuffix("\n<|im_start|>assistant\n")
DROP = TEXT_TO_IMAGE_DROP  # the pipeline's `prompt_template_encode_start_idx`
HIDDEN_LAYERS_TO_SKIP = 2  # hidden_states[-3]
MAX_LENGTH = 1000  # the pipeline's `tokenizer_max_length`
GLYPH_MAX_LENGTH = 128  # its `tokenizer_2_max_length`
_QUOTES = (r"\'(.*?)\'", r"\"(.*?)\"", r"‘(.*?)’", r"“(.*?)”")


def glyph_text(caption: str) -> str | None:
    """The quoted text of a caption as the pipeline gives it to ByT5 (`Text "a". Text "b". `), or None."""
    found = [text for pattern in _QUOTES for text in re.findall(pattern, caption)]
    return ". ".join(f'Text "{t}"' for t in found) + ". " if found else None


@torch.no_grad()
def encode_prompts(
    encoders: TextEncoders, captions: list[str], max_length: int = MAX_LENGTH
) -> list[dict[str, torch.Tensor]]:
    """Per caption {"text": [n, D_qwen], "glyph": [g, D_byt5]} at their true lengths (g = 0 without
    quoted text), as HunyuanImagePipeline.encode_prompt computes them."""
    qwen, tokenizer, byt5, byt5_tokenizer = encoders
    tokens = tokenizer([TEMPLATE.format(c) for c in captions], max_length=DROP + max_length,
                       padding="max_length", truncation=True, return_tensors="pt")  # fmt: skip
    mask = tokens.attention_mask.to(qwen.device)
    hidden = qwen(
        input_ids=tokens.input_ids.to(qwen.device), attention_mask=mask, output_hidden_states=True
    ).hidden_states[-(HIDDEN_LAYERS_TO_SKIP + 1)]
    hidden, mask = hidden[:, DROP:], mask[:, DROP:].bool()
    return [
        {
            "text": h[m],
            "glyph": glyph_states(byt5, byt5_tokenizer, glyph_text(c), GLYPH_MAX_LENGTH).to(h.dtype),
        }
        for c, h, m in zip(captions, hidden, mask)
    ]
