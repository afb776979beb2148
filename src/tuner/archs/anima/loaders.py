"""Anima: loading its models and turning captions into model inputs.

Anima (circlestone-labs/Anima) is released as ComfyUI single files only:

* transformer: `anima-preview.safetensors`, Cosmos-Predict2-2B's DiT under NVIDIA's release names plus the
  LLM adapter (`llm_adapter.*`, `tuner.archs.anima.adapter`), with or without `net.` / ComfyUI's
  `model.diffusion_model.` prefix, fp8-scaled files dequantized. It is built as diffusers'
  `CosmosTransformer3DModel` (`tuner.archs.cosmos_predict2.loaders.build_transformer`: the padding mask an
  ordinary input channel) holding the adapter as its module `llm_adapter`; every tensor of the file is
  used and none may be missing. A Cosmos-Predict2 file (no adapter) is refused naming `cosmos_predict2`;
* text encoder: Qwen3-0.6B-Base (`qwen_3_06b_base.safetensors`, Hugging Face keys `model.layers.0...`, or a
  transformers folder) with its tokenizer, through `tuner.archs.z_image.text`'s loader; plus a T5
  tokenizer (`tokenizer_2`: the T5-11B vocabulary, as Cosmos-Predict2's `tokenizer/`) for the adapter's ids;
* VAE: the Qwen-Image VAE (`qwen_image_vae.safetensors`; the Wan 2.1 network and latent statistics,
  ComfyUI's `Wan21` latent format), read by `tuner.archs.qwen_image.loaders`.

**Text.** As ComfyUI's `comfy/text_encoders/anima.py`: the caption is tokenized twice, by Qwen's tokenizer
without special tokens (an empty caption becomes one `<|endoftext|>`, its padding token) and by T5's with
its closing `</s>`; Qwen3's last hidden states (after the final norm) and the T5 ids are cached at their
true lengths. At training and sampling time the adapter (part of the transformer, so trained with it) maps
them to context rows, zero-padded to 512 as `Anima.preprocess_text_embeds` pads them.

**The parameterization** is Cosmos-Predict2's: the DiT is called on `x_t` at timestep t ∈ [0, 1] and
returns the velocity ε − x0 (`tuner.archs.cosmos_predict2.loaders`; diffusion-pipe's `models/anima.py`
trains exactly this target).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.anima.adapter import LLMAdapter
from tuner.archs.anima.keys import ADAPTER, ANIMA_LAYOUT
from tuner.archs.cosmos_predict2 import loaders as cosmos
from tuner.archs.cosmos_predict2.keys import is_release_only
from tuner.archs.model import padded_prompts
from tuner.archs.z_image import text as z_image_text
from tuner.errors import CheckpointError
from tuner.models.component import diffusers_keys
from tuner.models.encoders import CAUSAL_LM_COLUMNS
from tuner.models.identify import Variant, check_keys, pick_variant, variant_table, wrong_architecture
from tuner.models.loading import (
    load_tensors,
    load_tokenizer,
    normalize_shapes,
    normalize_state_dict,
    read_folder_config,
    read_tensor_shapes,
)

if TYPE_CHECKING:
    from diffusers import CosmosTransformer3DModel
    from transformers import PreTrainedTokenizerBase

CONFIGS = Path(__file__).parent / "configs"
CONTEXT_ROWS = 512  # Anima.preprocess_text_embeds zero-pads the adapter's output to this many rows
QWEN_PAD = "<|endoftext|>"  # Qwen3's padding token (151643), ComfyUI's one token of an empty caption

# ---------------------------------------------------------------------------------------------------
# Known variants (release names without `net.`)
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("x_embedder.proj.1.weight", f"{ADAPTER}.embed.weight", "blocks.{}.mlp.layer1.weight", f"{ADAPTER}.blocks.{{}}.mlp.0.weight"),
    {
        # circlestone-labs/Anima: Cosmos-Predict2-2B (16 heads of 128, 28 blocks) + a 6-block adapter of width 1024
        "2B": ((2048, 68), (32128, 1024), (28, (8192, 2048)), (6, (4096, 1024))),
        # the test fixture (tuner.archs.anima.fixture): the cosmos_predict2 tiny DiT + 2 adapter blocks of width 64
        "tiny": ((64, 68), (512, 64), (2, (256, 64)), (2, (256, 64))),
    },
)  # fmt: skip
_DIT_MARKERS = ("x_embedder.proj.1.weight", "blocks.0.self_attn.q_proj.weight")
_MARKERS = (*_DIT_MARKERS, f"{ADAPTER}.embed.weight")
_DIFFUSERS_MARKERS = ("patch_embed.proj.weight", "transformer_blocks.0.attn1.to_q.weight")

QWEN3_VARIANTS = variant_table(
    CONFIGS / "text_encoder",
    CAUSAL_LM_COLUMNS,
    {
        "qwen3-0.6b": ((151936, 1024), (28, (3072, 1024))),  # Qwen/Qwen3-0.6B-Base
        "tiny": ((2048, 64), (2, (128, 64))),  # the test fixture: 2 layers of width 64
    },
)  # fmt: skip
QWEN3_SPEC = replace(z_image_text.SPEC, what="Qwen3-0.6B text encoder (Anima's)", variants=QWEN3_VARIANTS)


# ---------------------------------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------------------------------


def adapter_config(variant: Variant) -> dict:
    """The `LLMAdapter` arguments of a transformer variant (its `llm_adapter.json`)."""
    return json.loads((variant.config_dir / "llm_adapter.json").read_text())


def expected_keys(variant: Variant) -> set[str]:
    """Every tensor name (release layout, without `net.`) of a variant's file: the DiT's and the adapter's."""
    with torch.device("meta"):
        adapter = LLMAdapter(**adapter_config(variant))
    dit = diffusers_keys("CosmosTransformer3DModel", ANIMA_LAYOUT.key_to_original)(variant)
    return dit | {f"{ADAPTER}.{k}" for k in adapter.state_dict()}


def _network_keys(names) -> dict[str, str]:
    """Each network key (without `net.`; release-only buffers left out) -> the stored key."""
    return {k: s for k, s in cosmos.strip_release_prefix(names).items() if not is_release_only(k)}


def _in_release_names(shapes: dict, path: Path) -> dict:
    """`shapes` (or tensors) keyed by release names: a file in diffusers' names is renamed."""
    if all(k in shapes for k in _DIFFUSERS_MARKERS):
        shapes = {
            k if k.startswith(ADAPTER) else ANIMA_LAYOUT.key_to_original(k): v for k, v in shapes.items()
        }
    if not all(k in shapes for k in _DIT_MARKERS):
        raise wrong_architecture(path, shapes, "Anima transformer", _MARKERS)
    if f"{ADAPTER}.embed.weight" not in shapes:
        raise CheckpointError(
            f"{path}: a Cosmos-Predict2 transformer without Anima's LLM adapter (no {ADAPTER}.* tensors); "
            'train it with architecture = "cosmos_predict2", or point to an Anima file (anima-preview.safetensors).'
        )
    return shapes


def identify_transformer(path: str | Path) -> Variant:
    """The variant of an Anima transformer file, from its header; every tensor checked by name."""
    path = Path(path)
    stored = normalize_shapes(read_tensor_shapes(path))
    shapes = _in_release_names({k: stored[s] for k, s in _network_keys(stored).items()}, path)
    variant = pick_variant(shapes, TRANSFORMER_VARIANTS, path, "Anima transformer")
    check_keys(expected_keys(variant), shapes, path, f"Anima transformer {variant.name}")
    return variant


def load_transformer(path: str | Path, dtype: torch.dtype) -> CosmosTransformer3DModel:
    """Anima's DiT (a `CosmosTransformer3DModel`, padding mask as an input channel) holding its LLM adapter
    as `llm_adapter`, from a single file, in eval mode. The adapter is kept in `dtype` too."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"{path}: a folder; Anima is released as a single file (anima-preview.safetensors), which "
            "`model.transformer` should point to."
        )
    variant = identify_transformer(path)
    stored = normalize_state_dict(load_tensors(path), dtype)
    tensors = _in_release_names({k: stored[s] for k, s in _network_keys(stored).items()}, path)
    adapter_tensors = {k[len(ADAPTER) + 1 :]: v for k, v in tensors.items() if k.startswith(ADAPTER + ".")}
    dit = ANIMA_LAYOUT.to_diffusers({k: v for k, v in tensors.items() if not k.startswith(ADAPTER + ".")})
    model = cosmos.build_transformer(read_folder_config(variant.config_dir), dit, dtype, path)
    with torch.device("meta"):
        adapter = LLMAdapter(**adapter_config(variant))
    adapter.load_state_dict(adapter_tensors, strict=True, assign=True)
    model.add_module(ADAPTER, adapter.to(dtype).eval())
    return model


def predict_velocity(
    model: CosmosTransformer3DModel, noisy: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The velocity ε − x0 at `x_t` = `noisy` [B, 16, F, H, W], t ∈ [0, 1] [B], given a batch of `collate`d
    captions: the adapter's rows, zero-padded to 512, are the DiT's context."""
    return model(**cosmos.model_inputs(model, noisy, t, context(model, noisy, cond)), return_dict=False)[0]


def context(
    model: CosmosTransformer3DModel, noisy: torch.Tensor, cond: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The DiT's text context: the LLM adapter's rows of each caption, zero-padded to 512."""
    rows = model.llm_adapter(cond["qwen"].to(noisy.dtype), cond["t5_ids"], cond["qwen_mask"], cond["t5_mask"])
    return cosmos.collate(list(rows), CONTEXT_ROWS)


# ---------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------


def load_text_encoder(
    path: str | Path,
    tokenizer_path: str | Path | None,
    t5_tokenizer_path: str | Path | None,
    dtype: torch.dtype,
) -> tuple[z_image_text.TextEncoder, PreTrainedTokenizerBase]:
    """Qwen3-0.6B with its tokenizer, and the T5 tokenizer of the adapter's ids (`t5_tokenizer_path`,
    `model.tokenizer_2`; a single file carries neither tokenizer)."""
    encoder = z_image_text.load_text_encoder(
        path, tokenizer_path, dtype, QWEN3_SPEC, "Qwen3 tokenizer (Qwen/Qwen3-0.6B-Base's files)"
    )
    what = "T5 tokenizer of Anima's LLM adapter (tokenizer/ of nvidia/Cosmos-Predict2-2B-Text2Image, or google-t5/t5-11b)"
    if t5_tokenizer_path is None:
        raise CheckpointError(
            f"{path}: key 'model.tokenizer_2' is not set; Anima's LLM adapter reads the caption's T5 ids: point "
            f"it at the {what}."
        )
    return encoder, load_tokenizer(t5_tokenizer_path, path, what)


@torch.no_grad()
def encode_prompts(
    encoder: z_image_text.TextEncoder,
    t5_tokenizer: PreTrainedTokenizerBase,
    captions: list[str],
    max_length: int = 512,
) -> list[dict[str, torch.Tensor]]:
    """Per caption: `qwen` [S, 1024], Qwen3's last hidden states of its tokens, and `t5_ids` [T], its T5
    ids with `</s>` (both at their true length, at most `max_length`); see the module docstring."""
    model, tokenizer = encoder
    pad = tokenizer.convert_tokens_to_ids(QWEN_PAD)
    ids = [
        tokenizer(c, add_special_tokens=False, truncation=True, max_length=max_length).input_ids or [pad]
        for c in captions
    ]
    longest = max(len(i) for i in ids)
    input_ids = torch.tensor([i + [pad] * (longest - len(i)) for i in ids], device=model.device)
    mask = torch.tensor([[True] * len(i) + [False] * (longest - len(i)) for i in ids], device=model.device)
    # causal attention: the padding after a caption leaves its rows as they are alone
    hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    t5 = t5_tokenizer(captions, truncation=True, max_length=max_length).input_ids
    return [
        {"qwen": h[m].clone(), "t5_ids": torch.tensor(t, dtype=torch.long)}
        for h, m, t in zip(hidden, mask, t5, strict=True)
    ]


def collate(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch of `encode_prompts` entries: `qwen` [B, S, D] and `t5_ids` [B, T] padded to the batch's
    longest (zeros), with boolean `qwen_mask` / `t5_mask` marking the real tokens."""
    out: dict[str, torch.Tensor] = {}
    for key in ("qwen", "t5_ids"):
        padded = padded_prompts([{"prompt_embeds": e[key]} for e in entries])
        out[key], out[key.removesuffix("_ids") + "_mask"] = padded["prompt_embeds"], padded["prompt_mask"]
    return out
