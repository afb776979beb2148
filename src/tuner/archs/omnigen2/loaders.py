"""OmniGen2: loading its transformer and Qwen2.5-VL-3B, and turning captions into model inputs. The VAE
is FLUX.1's (`ae.safetensors`, 16 channels, its shift and scaling factors): `tuner.archs.flux_vae`.

Each loader takes the layouts users have (see `tuner.models.loading`):

* transformer: the release's diffusers-style folder (`OmniGen2/OmniGen2`'s `transformer/`, class
  `OmniGen2Transformer2DModel`, which `tuner.archs.omnigen2.model` is), or a single file: ComfyUI's
  `omnigen2_fp16.safetensors` or the release's weights file (the same keys, `model.diffusion_model.`
  optional, fp8 dequantized). Every tensor of the identified variant must be there and no other;
* text encoder: Qwen2.5-VL-3B-Instruct, the release's `mllm/` folder (with `processor/` beside it, whose
  tokenizer it uses) or ComfyUI's `qwen_2.5_vl_fp16.safetensors` (the original Hugging Face layout, read
  as Qwen-Image's 7B is: `tuner.archs.qwen_image.text`) with a tokenizer folder.

Prompts are what `OmniGen2Pipeline.encode_prompt` computes: the caption in Qwen's chat template behind
the release's system prompt (`add_generation_prompt=False`: the text ends at the user turn's
`<|im_end|>\\n`), tokenized, right-padded; the embedding is the **last** hidden state at the unmasked
positions, and the transformer gets the mask with it. The pipeline's negative prompt is the empty caption
in the same template, so the empty caption is templated too (caption dropout, `generate`'s default
negative prompt).

Time: the transformer runs from noise (τ = 0) to image (τ = 1) and predicts image − noise, as Lumina 2's;
`tuner.archs.lumina2.loaders.predict_velocity` calls it at 1 − t and negates the output (ComfyUI's
OmniGen2 does the same).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.qwen_image import text as qwen_text
from tuner.models.component import read_single_file
from tuner.models.identify import SingleFileSpec, diffusers_meta_keys, variant_table
from tuner.models.loading import from_state_dict, load_diffusers_folder, resolve_folder

# diffusers is imported where a model is built (the model file imports it): importing it costs seconds,
# which a command that loads no model should not pay.
if TYPE_CHECKING:
    from tuner.archs.omnigen2.model import OmniGen2Transformer2DModel

CONFIGS = Path(__file__).parent / "configs"
MODEL_CLASS = "OmniGen2Transformer2DModel"

# OmniGen2Pipeline._apply_chat_template: Qwen2.5's chat template over a system and a user message
SYSTEM_PROMPT = "You are a helpful assistant that generates high-quality images based on user instructions."
PROMPT_TEMPLATE = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n"
# the rotary table's first axis holds 1024 positions, and the image sits at the text's length on it
MAX_TEXT_TOKENS = 1023

# ---------------------------------------------------------------------------------------------------
# Known variants. `None` means the tensor must be absent (it pins the number of blocks).
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("x_embedder.weight", "time_caption_embed.caption_embedder.1.weight", "layers.{}.attn.to_k.weight"),
    {
        # OmniGen2 (4B): 32 layers of width 2520 (21 query heads, 7 key/value heads of 120), Qwen2.5-VL-3B
        "omnigen2": ((2520, 64), (2520, 2048), (32, (840, 2520))),
        # the test fixture (tuner.archs.omnigen2.fixture): 4 heads of 32 (2 key/value heads), 2 layers
        "tiny": ((128, 64), (128, 64), (2, (64, 128))),
    },
)  # fmt: skip

TEXT_ENCODER_VARIANTS = (
    *variant_table(
        CONFIGS / "text_encoder",
        ("model.embed_tokens.weight", "model.layers.{}.mlp.gate_proj.weight", "visual.blocks.31.attn.qkv.weight"),
        # Qwen2.5-VL-3B-Instruct: 36 layers of width 2048 (embedding tied to the LM head), 32 vision blocks
        {"qwen2.5-vl-3b": ((151936, 2048), (36, (11008, 2048)), (3840, 1280))},
    ),
    # the test fixture: Qwen-Image's tiny Qwen2.5-VL (2 layers of width 64)
    *(v for v in qwen_text.VARIANTS if v.name == "tiny"),
)  # fmt: skip
TEXT_ENCODER_SPEC = replace(qwen_text.SPEC, what="Qwen2.5-VL-3B text encoder", variants=TEXT_ENCODER_VARIANTS)


def _transformer_keys(variant) -> list[str]:
    from tuner.archs.omnigen2.model import OmniGen2Transformer2DModel

    return diffusers_meta_keys(OmniGen2Transformer2DModel, variant.config_dir)


TRANSFORMER_SPEC = SingleFileSpec(
    what="OmniGen2 transformer",
    variants=TRANSFORMER_VARIANTS,
    expected_keys=_transformer_keys,
    original_markers=(
        "ref_image_patch_embedder.weight",
        "image_index_embedding",
        "layers.0.attn.to_q.weight",
    ),
)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype) -> OmniGen2Transformer2DModel:
    """Load the OmniGen2 transformer from the release's folder or a single file, in eval mode."""
    from tuner.archs.omnigen2.model import OmniGen2Transformer2DModel

    folder = resolve_folder(path, "transformer")
    if folder is not None:
        return load_diffusers_folder(OmniGen2Transformer2DModel, folder, dtype, MODEL_CLASS)
    variant, _, state_dict = read_single_file(path, dtype, TRANSFORMER_SPEC)
    return from_state_dict(OmniGen2Transformer2DModel, state_dict, variant.config_dir, dtype, Path(path))


def load_text_encoder(
    path: str | Path, tokenizer_path: str | Path | None, dtype: torch.dtype
) -> qwen_text.QwenTextEncoder:
    """Qwen2.5-VL-3B and its tokenizer: the release's `mllm/` folder (or its pipeline root; the tokenizer
    then comes from `processor/`), or a single file with `tokenizer_path`."""
    return qwen_text.load_text_encoder(path, tokenizer_path, dtype, TEXT_ENCODER_SPEC, ("mllm", "processor"))


@torch.no_grad()
def encode_prompts(
    encoder: qwen_text.QwenTextEncoder, captions: list[str], max_length: int = MAX_TEXT_TOKENS
) -> list[torch.Tensor]:
    """One [L, D] embedding per caption (L ≤ max_length, its unmasked tokens), as OmniGen2Pipeline encodes
    prompts: the chat template around the caption, Qwen2.5-VL's last hidden state."""
    tokens = encoder.tokenizer(
        [PROMPT_TEMPLATE.format(c) for c in captions],
        padding="longest",
        max_length=max_length,
        truncation=True,
        return_tensors="pt",
    )
    return qwen_text.hidden_rows(encoder.model, tokens.input_ids, tokens.attention_mask)
