"""FLUX.2's text encoders: Mistral-Small-3.x 24B for dev, Qwen3 (4B / 8B) for klein, and prompt encoding.

Both condition the transformer the same way (Flux2Pipeline / Flux2KleinPipeline): the prompt in the
model's chat format, padded to `max_length` tokens and run with its attention mask; the hidden states
after three layers (dev: 10, 20, 30; klein: 9, 18, 27) are put side by side per token, giving
[max_length, 3 · D] (dev 15360, klein 4B 7680, klein 9B 12288). Every row is kept: the transformer takes
no text mask. The formats differ:

* dev: a system turn with BFL's system message, then the prompt as a user turn (a Mistral chat;
  `[IMG]` is removed from the prompt), no generation prompt; the whole batch is tokenized at once;
* klein: the prompt alone as a user turn of the Qwen3 chat, with the assistant's generation prompt and
  thinking turned off (`enable_thinking=False`); each prompt is tokenized on its own.

The prompt is text only, so the hidden states are the language model's: tuner builds transformers'
`MistralModel` / `Qwen3Model` and leaves the vision tower, projector and LM head of the released
checkpoints unloaded. Loading takes the diffusers folder's `text_encoder/` (Mistral3ForConditionalGeneration,
Qwen3ForCausalLM) or a single file holding the language model under any of the names it is published
with (`model.language_model.*`, `language_model.model.*` or a plain causal LM's `model.*`). A single file
carries no tokenizer: pass the release's `tokenizer/` folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from tuner.errors import CheckpointError
from tuner.models.encoders import DECODER_COLUMNS
from tuner.models.identify import Variant, check_keys, pick_variant, variant_table, wrong_architecture
from tuner.models.loading import (
    load_tensors,
    load_tokenizer,
    normalize_state_dict,
    read_folder_config,
    read_tensor_shapes,
    resolve_folder,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

CONFIGS = Path(__file__).parent / "configs" / "text_encoder"


@dataclass(frozen=True)
class LanguageModel:
    """One text encoder this loader reads (FLUX.2's two; ERNIE-Image's Ministral 3 is a third kind, declared
    in `tuner.archs.ernie_image.text`): what it is, where its variants are, how it formats and reads prompts."""

    what: str
    architecture: str  # the record that trains with it
    model_class: str  # transformers' base-model class
    config_class: str
    model_types: tuple[str, ...]  # config.json `model_type`s of its diffusers folder
    variants: tuple[Variant, ...]
    layers: tuple[int, ...]  # hidden states stacked (the pipeline's `text_encoder_out_layers`)
    tokenizer_hint: str
    chat: bool = True  # prompts are formatted with the tokenizer's chat template (ERNIE-Image's are not)


MISTRAL = LanguageModel(
    what="Mistral-Small text encoder (FLUX.2 dev)",
    architecture="flux2",
    model_class="MistralModel",
    config_class="MistralConfig",
    model_types=("mistral3", "mistral"),
    variants=variant_table(
        CONFIGS,
        DECODER_COLUMNS,
        {
            "mistral-small-3": ((131072, 5120), (40, (32768, 5120))),  # Mistral-Small-3.1 / 3.2 24B
            "tiny": ((1024, 32), (30, (64, 32))),  # the fixture: 30 layers (the pipeline reads the 30th)
        },
    ),
    layers=(10, 20, 30),
    tokenizer_hint="Mistral-Small tokenizer (the tokenizer/ folder of FLUX.2-dev)",
)

QWEN3 = LanguageModel(
    what="Qwen3 text encoder (FLUX.2 klein)",
    architecture="flux2_klein",
    model_class="Qwen3Model",
    config_class="Qwen3Config",
    model_types=("qwen3",),
    variants=variant_table(
        CONFIGS,
        DECODER_COLUMNS,
        {
            "qwen3-4b": ((151936, 2560), (36, (9728, 2560))),  # klein 4B
            "qwen3-8b": ((151936, 4096), (36, (12288, 4096))),  # klein 9B
            "tiny-qwen3": (
                (2048, 32),
                (27, (64, 32)),
            ),  # the fixture: 27 layers (the pipeline reads the 27th)
        },
    ),
    layers=(9, 18, 27),
    tokenizer_hint="Qwen3 tokenizer (the tokenizer/ folder of FLUX.2 klein)",
)


class TextEncoder(NamedTuple):
    """A FLUX.2 prompt encoder: the language model, its tokenizer and its kind, in eval mode."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    kind: LanguageModel


# Prefixes the language model's weights are published under, tried in order: transformers 5's
# Mistral3ForConditionalGeneration, transformers 4's, a plain causal LM (Qwen3, Mistral).
_LM_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_NOT_LM = (
    "vision_tower.",
    "multi_modal_projector.",
    "lm_head.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
_MARKERS = ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight")


def language_model_names(names: Sequence[str]) -> dict[str, str]:
    """Base-model key -> stored key for the language model's tensors of a checkpoint."""
    names = [n for n in names if not n.startswith(_NOT_LM)]
    for prefix in _LM_PREFIXES:
        if any(n.startswith(prefix) for n in names):
            return {n.removeprefix(prefix): n for n in names if n.startswith(prefix)}
    return {n: n for n in names}


def load_text_encoder(
    path: str | Path, tokenizer: str | Path | None, dtype: torch.dtype, kind: LanguageModel
) -> TextEncoder:
    """Load `kind`'s language model from a diffusers folder or a single file, with its tokenizer
    (`tokenizer` may be None for a diffusers folder: the sibling `tokenizer/`)."""
    import transformers

    folder = resolve_folder(path, "text_encoder")
    if folder is not None:
        found_type = read_folder_config(folder).get("model_type")
        if found_type not in kind.model_types:
            raise CheckpointError(
                f"{folder}: config.json describes a {found_type!r} model, not the {kind.what}."
            )
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no .safetensors weights in this text encoder folder.")
        found = folder.parent / "tokenizer" if (folder.parent / "tokenizer").is_dir() else None
    else:
        files, found = [Path(path)], None
    shapes = {k: v for f in files for k, v in read_tensor_shapes(f).items()}
    names = language_model_names(list(shapes))
    lm_shapes = {k: shapes[stored] for k, stored in names.items()}
    if not all(k in lm_shapes for k in _MARKERS):
        raise wrong_architecture(path, list(shapes), kind.what, _MARKERS)
    for other in (MISTRAL, QWEN3):
        if other is not kind and any(not v.mismatches(lm_shapes) for v in other.variants):
            raise CheckpointError(
                f'{path}: a {other.what}, not the {kind.what}. Set model.architecture = "{other.architecture}" '
                "to train the model it belongs to, or point to the right text encoder."
            )
    variant = pick_variant(lm_shapes, kind.variants, path, kind.what)
    config = getattr(transformers, kind.config_class).from_pretrained(variant.config_dir)
    model_class = getattr(transformers, kind.model_class)
    with torch.device("meta"):
        expected = model_class(config).state_dict()
    check_keys(expected, lm_shapes, path, f"{kind.what} {variant.name}")
    tensors = {k: v for f in files for k, v in load_tensors(f).items()}
    state_dict = normalize_state_dict({k: tensors[stored] for k, stored in names.items()}, dtype)
    model = model_class.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype).eval()
    tokenizer_dir = tokenizer or found
    loaded = load_tokenizer(tokenizer_dir, path, kind.tokenizer_hint)
    if kind.chat and getattr(loaded, "chat_template", None) is None:
        loaded.chat_template = processor_chat_template(Path(tokenizer_dir))
    return TextEncoder(model, loaded, kind)


def processor_chat_template(folder: Path) -> str:
    """The chat template a processor folder keeps beside its tokenizer (FLUX.2-dev's `tokenizer/` is a
    PixtralProcessor's: the template is in `chat_template.json` / `.jinja`, which the tokenizer alone does
    not read). The pipelines format prompts with it."""
    import json

    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text(encoding="utf-8"))["chat_template"]
    raise CheckpointError(
        f"{folder}: this tokenizer has no chat template (tokenizer_config.json, chat_template.jinja or "
        "chat_template.json); FLUX.2 formats prompts as a chat. Use the release's tokenizer/ folder."
    )


# ---------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------


def mistral_chat(caption: str) -> list[dict]:
    """The conversation Flux2Pipeline wraps a prompt in: BFL's system message, then the prompt."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
        {"role": "user", "content": [{"type": "text", "text": caption.replace("[IMG]", "")}]},
    ]


def _tokenize(encoder: TextEncoder, captions: list[str], max_length: int) -> dict[str, torch.Tensor]:
    tokenizer = encoder.tokenizer
    padding = {"padding": "max_length", "truncation": True, "max_length": max_length, "return_tensors": "pt"}
    if encoder.kind is MISTRAL:
        return tokenizer.apply_chat_template(
            [mistral_chat(c) for c in captions], add_generation_prompt=False, tokenize=True, return_dict=True,
            **padding,
        )  # fmt: skip
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        for c in captions
    ]
    rows = [tokenizer(text, **padding) for text in texts]  # one by one, as Flux2KleinPipeline does
    return {name: torch.cat([r[name] for r in rows]) for name in ("input_ids", "attention_mask")}


@torch.no_grad()
def encode_prompts(encoder: TextEncoder, captions: list[str], max_length: int = 512) -> list[torch.Tensor]:
    """Per caption [max_length, 3 · D]: the hidden states after the kind's layers, side by side per token."""
    inputs = _tokenize(encoder, captions, max_length)
    device = next(encoder.model.parameters()).device
    out = encoder.model(
        input_ids=inputs["input_ids"].to(device),
        attention_mask=inputs["attention_mask"].to(device),
        output_hidden_states=True,
        use_cache=False,
    )
    stacked = torch.stack([out.hidden_states[k] for k in encoder.kind.layers], dim=2)  # [B, L, layers, D]
    return list(stacked.flatten(2))
