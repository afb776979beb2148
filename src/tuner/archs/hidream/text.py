"""HiDream-I1's four text encoders and prompt encoding, as HiDreamImagePipeline.encode_prompt does it.

* CLIP-L (`text_encoder`) and CLIP-G (`text_encoder_2`): `CLIPTextModelWithProjection`s with 248
  positions (Long-CLIP); the prompt is padded to min(max_length, 218) tokens and the *projected* pooled
  outputs (`text_embeds`) of both are concatenated (768 + 1280 = the transformer's `text_emb_dim`).
  Files: the diffusers folders, or ComfyUI's `clip_l_hidream.safetensors` / `clip_g_hidream.safetensors`
  (`text_model.*` plus `text_projection.weight`: transformers' own names); the number of positions is
  read from the file.
* T5-XXL encoder (`text_encoder_3`): last hidden state over the prompt padded to `max_length` tokens,
  run *with* the attention mask; all rows kept. Files as for FLUX.1 (`t5xxl_*.safetensors`).
* Llama 3.1 8B Instruct (`text_encoder_4`): the hidden states after every decoder layer (the embedding
  output dropped) over the prompt padded to `max_length` with `<|eot_id|>` (the pipeline's pad is the
  eos), with the attention mask: [layers, L, 4096] per prompt. The HiDream diffusers repos do not ship
  it: point at the `meta-llama/Llama-3.1-8B-Instruct` folder (its tokenizer too), or ComfyUI's
  `llama_3.1_8b_instruct_fp8_scaled.safetensors` (the Hugging Face layout, `model.layers.0...`; the LM
  head, unused, is dropped). Only the base `LlamaModel` is built; its hidden states are those of
  `LlamaForCausalLM`.

`max_length` is the pipeline's `max_sequence_length` (128 by default, the length HiDream was trained
with): tuner passes `cache.text_max_length`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

# FLUX.1's loaders of transformers folders: same checks, same errors
from tuner.archs.flux.loaders import T5_SPEC
from tuner.errors import CheckpointError
from tuner.models.encoders import (
    base_model_keys,
    clip_with_projection_entries,
    load_clip_encoder,
    load_encoder,
    load_encoder_file,
    model_keys,
)
from tuner.models.identify import (
    SingleFileSpec,
    Variant,
)
from tuner.models.loading import (
    load_tokenizer,
    load_transformers_folder,
    resolve_folder,
    sibling,
)

if TYPE_CHECKING:
    from transformers import CLIPTextModelWithProjection, LlamaModel, PreTrainedTokenizerBase, T5EncoderModel

CONFIGS = Path(__file__).parent / "configs"
CLIP_MAX_TOKENS = 218  # HiDreamImagePipeline's cap on CLIP prompts

_POSITIONS = "text_model.embeddings.position_embedding.weight"
CLIP_L_VARIANTS = (
    Variant("clip-l", CONFIGS / "clip_l" / "clip-l", {"text_model.embeddings.token_embedding.weight": (49408, 768),
            "text_model.encoder.layers.11.mlp.fc1.weight": (3072, 768), "text_model.encoder.layers.12.mlp.fc1.weight": None}),
    Variant("tiny", CONFIGS / "clip_l" / "tiny", {"text_model.embeddings.token_embedding.weight": (1088, 32),
            "text_model.encoder.layers.1.mlp.fc1.weight": (64, 32), "text_model.encoder.layers.2.mlp.fc1.weight": None}),
)  # fmt: skip
CLIP_G_VARIANTS = (
    Variant("clip-g", CONFIGS / "clip_g" / "clip-g", {"text_model.embeddings.token_embedding.weight": (49408, 1280),
            "text_model.encoder.layers.31.mlp.fc1.weight": (5120, 1280), "text_model.encoder.layers.32.mlp.fc1.weight": None}),
    Variant("tiny", CONFIGS / "clip_g" / "tiny", {"text_model.embeddings.token_embedding.weight": (1088, 32),
            "text_model.encoder.layers.2.mlp.fc1.weight": (64, 32), "text_model.encoder.layers.3.mlp.fc1.weight": None}),
)  # fmt: skip
# ComfyUI's files use CLIPTextModelWithProjection's own names (`text_model.*`, `text_projection.weight`)
_CLIP_MARKERS = ("text_model.embeddings.token_embedding.weight", "text_projection.weight",
                 _POSITIONS)  # fmt: skip
CLIP_L_SPEC = SingleFileSpec("HiDream CLIP-L text encoder", CLIP_L_VARIANTS,
                             model_keys("CLIPTextModelWithProjection"), _CLIP_MARKERS)  # fmt: skip
CLIP_G_SPEC = SingleFileSpec("HiDream CLIP-G text encoder", CLIP_G_VARIANTS,
                             model_keys("CLIPTextModelWithProjection"), _CLIP_MARKERS)  # fmt: skip
LLAMA_VARIANTS = (
    Variant("llama-3.1-8b", CONFIGS / "llama" / "llama-3.1-8b", {"model.embed_tokens.weight": (128256, 4096),
            "model.layers.31.mlp.gate_proj.weight": (14336, 4096), "model.layers.32.mlp.gate_proj.weight": None}),
    Variant("tiny", CONFIGS / "llama" / "tiny", {"model.embed_tokens.weight": (2048, 64),
            "model.layers.1.mlp.gate_proj.weight": (128, 64), "model.layers.2.mlp.gate_proj.weight": None}),
)  # fmt: skip


# ComfyUI's / Hugging Face's files hold LlamaForCausalLM (`model.x`, `lm_head.weight`); tuner builds the
# base model (`x`; a file saved from it loads too). The LM head is not used: identification ignores
# it, loading drops it.
_LM_HEAD = "lm_head.weight"
LLAMA_SPEC = SingleFileSpec(
    what="Llama 3.1 text encoder",
    variants=LLAMA_VARIANTS,
    expected_keys=model_keys("LlamaModel", prefix="model."),
    original_markers=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"),
    diffusers_markers=("embed_tokens.weight", "layers.0.self_attn.q_proj.weight"),
    to_original=lambda key: "model." + key,
    aliases={_LM_HEAD: "model.embed_tokens.weight"},
)


class TextEncoders(NamedTuple):
    """HiDream-I1's four text encoders and their tokenizers, in eval mode."""

    clip_l: CLIPTextModelWithProjection
    tokenizer: PreTrainedTokenizerBase
    clip_g: CLIPTextModelWithProjection
    tokenizer_2: PreTrainedTokenizerBase
    t5: T5EncoderModel
    tokenizer_3: PreTrainedTokenizerBase
    llama: LlamaModel
    tokenizer_4: PreTrainedTokenizerBase

    @property
    def models(self) -> tuple[torch.nn.Module, ...]:
        return self.clip_l, self.clip_g, self.t5, self.llama


def load_text_encoders(
    paths: tuple[str | Path | None, ...], tokenizers: tuple[str | Path | None, ...], dtype: torch.dtype
) -> TextEncoders:
    """Load the four encoders from `paths` (CLIP-L, CLIP-G, T5, Llama) with `tokenizers` (same order).

    When `paths[0]` is a HiDream diffusers root (or its `text_encoder/`), missing CLIP-G and T5 paths are
    found beside it; Llama is never part of that release and must be given. Tokenizer paths may be None
    where the encoder is a folder with its tokenizer beside it (`tokenizer_N/`, or the Llama folder).
    """
    first = paths[0]
    root = resolve_folder(first, "text_encoder") if first is not None else None
    found = [Path(p) if p else None for p in paths]
    for i, sub in ((1, "text_encoder_2"), (2, "text_encoder_3"), (3, "text_encoder_4")):
        if found[i] is None and root is not None and (root.parent / sub).is_dir():
            found[i] = root.parent / sub
    names = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
    for path, name, what in zip(found, names, ("CLIP-L", "CLIP-G", "T5-XXL", "Llama 3.1 8B Instruct")):
        if path is None:
            raise CheckpointError(
                f"HiDream-I1 needs its {what} text encoder: set model.{name} (a single file or a diffusers / "
                "Hugging Face folder), or point model.text_encoder at a HiDream diffusers folder that holds it."
            )
    clip_l, tok_l = _load_clip(found[0], "text_encoder", "tokenizer", CLIP_L_SPEC, dtype)
    clip_g, tok_g = _load_clip(found[1], "text_encoder_2", "tokenizer_2", CLIP_G_SPEC, dtype)
    t5, tok_t5 = _load_t5(found[2], dtype)
    llama, tok_llama = _load_llama(found[3], dtype)
    beside = (tok_l, tok_g, tok_t5, tok_llama)
    what = ("CLIP-L (tokenizer/ of HiDream-I1)", "CLIP-G (tokenizer_2/ of HiDream-I1)",
            "T5 (tokenizer_3/ of HiDream-I1)", "Llama 3.1 (the Llama-3.1-8B-Instruct folder)")  # fmt: skip
    loaded = [load_tokenizer(tokenizers[i] or beside[i], found[i], what[i]) for i in range(4)]
    return TextEncoders(clip_l, loaded[0], clip_g, loaded[1], t5, loaded[2], llama, loaded[3])


def _load_clip(path: Path, subfolder: str, tokenizer_dir: str, spec: SingleFileSpec, dtype: torch.dtype):
    """A CLIP text model with projection, and the tokenizer folder beside it (None for a single file)."""
    from transformers import CLIPTextModelWithProjection

    folders = (subfolder, tokenizer_dir)
    return load_clip_encoder(
        path, dtype, CLIPTextModelWithProjection, folders, spec, clip_with_projection_entries
    )


def _load_t5(path: Path, dtype: torch.dtype):
    from transformers import T5EncoderModel

    return load_encoder(path, dtype, T5EncoderModel, "t5", ("text_encoder_3", "tokenizer_3"), T5_SPEC)


def _load_llama(path: Path, dtype: torch.dtype):
    """The Llama base model, and its tokenizer folder (a Hugging Face Llama folder holds its tokenizer)."""
    from transformers import LlamaModel

    folder = resolve_folder(path, "text_encoder_4")
    if folder is not None:
        model = load_transformers_folder(LlamaModel, folder, dtype, "llama")
        tokenizer = folder if (folder / "tokenizer.json").is_file() else sibling(folder, "tokenizer_4")
        return model, tokenizer
    return load_encoder_file(path, dtype, LlamaModel, LLAMA_SPEC, base_model_keys), None


# ---------------------------------------------------------------------------------------------------
# Prompt encoding
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_prompts(
    encoders: TextEncoders, captions: list[str], max_length: int = 128
) -> list[dict[str, torch.Tensor]]:
    """Per caption {"t5": [L, D_t5], "llama": [layers, L, D_llama], "pooled": [D_l + D_g]}, exactly as
    HiDreamImagePipeline.encode_prompt computes them (see the module docstring)."""
    e = encoders
    pooled = torch.cat(
        [_clip_pooled(e.clip_l, e.tokenizer, captions, max_length),
         _clip_pooled(e.clip_g, e.tokenizer_2, captions, max_length)], dim=-1,
    )  # fmt: skip
    ids, mask = _tokens(e.tokenizer_3, captions, max_length)
    t5 = e.t5(ids.to(e.t5.device), attention_mask=mask.to(e.t5.device))[0]
    if e.tokenizer_4.pad_token is None:  # the pipeline pads Llama prompts with its eos
        e.tokenizer_4.pad_token = e.tokenizer_4.eos_token
    ids, mask = _tokens(e.tokenizer_4, captions, max_length)
    hidden = e.llama(
        ids.to(e.llama.device), attention_mask=mask.to(e.llama.device), output_hidden_states=True
    )
    llama = torch.stack(hidden.hidden_states[1:], dim=1)  # [B, layers, L, D]
    return [{"t5": a, "llama": b, "pooled": c} for a, b, c in zip(t5, llama, pooled)]


def _tokens(tokenizer, captions: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = tokenizer(
        captions, padding="max_length", max_length=min(max_length, tokenizer.model_max_length),
        truncation=True, add_special_tokens=True, return_tensors="pt",
    )  # fmt: skip
    return out.input_ids, out.attention_mask


def _clip_pooled(model, tokenizer, captions: list[str], max_length: int) -> torch.Tensor:
    ids = tokenizer(
        captions, padding="max_length", max_length=min(max_length, CLIP_MAX_TOKENS), truncation=True,
        return_tensors="pt",
    ).input_ids  # fmt: skip
    return model(ids.to(model.device), output_hidden_states=True)[0]
