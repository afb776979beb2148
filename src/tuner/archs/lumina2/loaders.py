"""Lumina Image 2.0: loading its transformer and Gemma 2 text encoder, and turning captions and latents
into model inputs. The VAE is FLUX.1's (16 channels, its shift and scaling factors): `tuner.archs.flux.loaders`
loads and applies it.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder (`Alpha-VLLM/Lumina-Image-2.0`'s `transformer/`), or the original
  single file (`consolidated.00-of-01.pth` or its safetensors conversion, ComfyUI's
  `lumina_2_model_bf16.safetensors`; with or without the `model.diffusion_model.` prefix, fp8 files
  dequantized). ComfyUI's all-in-one `lumina_2.safetensors` also holds the VAE and Gemma under other
  prefixes: only its `model.diffusion_model.` keys are read. Renames and the fused `qkv` are
  `tuner.archs.lumina2.keys`, at any model size;
* text encoder: Gemma 2 2B, a diffusers folder (`text_encoder/`, a `Gemma2Model`, with `tokenizer/`
  beside it) or ComfyUI's `gemma_2_2b_fp16.safetensors` (transformers' `model.*` keys; an `lm_head`
  tied to the embedding is ignored). A single file carries no tokenizer: pass the tokenizer folder.

Model inputs are what `Lumina2Pipeline` computes: the caption behind the system prompt
(`SYSTEM_PROMPT + " <Prompt Start> " + caption`; the empty caption alone, as the pipeline encodes its
default negative prompt), tokenized with `<bos>`, right-padded and cut to
`max_length` (256 in the pipeline); the embedding is Gemma's **second-to-last** hidden state at the
unmasked positions, and the transformer gets the mask with it (padding rows never reach the image).

Time runs the other way in Lumina: the transformer is given τ = 1 − t (τ = 0 is noise, τ = 1 the
image) and predicts dx/dτ = x0 − ε. tuner's t is the noise level (x_t = (1 − t)·x0 + t·ε) with velocity
ε − x0, so `predict_velocity` calls the model at 1 − t and negates its output, as the pipeline does
before its scheduler step.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from tuner.archs.lumina2.keys import (
    UNUSED_ORIGINAL_KEYS,
    transformer_key_to_original,
    transformer_to_diffusers,
    transformer_to_original,
)
from tuner.models.encoders import CAUSAL_LM_COLUMNS, base_model_keys, causal_lm_key, load_encoder, model_keys
from tuner.models.identify import (
    SingleFileSpec,
    check_keys,
    diffusers_meta_keys,
    pick_variant,
    variant_table,
    wrong_architecture,
)
from tuner.models.loading import (
    as_file_list,
    from_state_dict,
    load_diffusers_folder,
    load_tensors_of,
    load_tokenizer,
    normalize_shapes,
    normalize_state_dict,
    read_shapes_of,
    resolve_folder,
)

# diffusers and transformers are imported where a model is built: importing them costs seconds, which a
# command that loads no model should not pay.
if TYPE_CHECKING:
    from diffusers import Lumina2Transformer2DModel
    from transformers import Gemma2Model, PreTrainedTokenizerBase

CONFIGS = Path(__file__).parent / "configs"

# Lumina2Pipeline's prompt format
SYSTEM_PROMPT = (
    "You are an assistant designed to generate superior images with the superior degree of image-text "
    "alignment based on textual prompts or user prompts."
)
PROMPT_FORMAT = SYSTEM_PROMPT + " <Prompt Start> {}"
MAX_TEXT_TOKENS = 256  # the pipeline's default max_sequence_length (system prompt included)

# ---------------------------------------------------------------------------------------------------
# Known variants. Signatures use original-layout names; `None` means the tensor must be absent (it pins
# the number of blocks).
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("x_embedder.weight", "cap_embedder.1.weight", "layers.0.attention.qkv.weight",
     "layers.{}.adaLN_modulation.1.weight"),
    {
        # Lumina-Image-2.0 (2.6B): 26 layers of width 2304, Gemma-2-2B features
        "lumina2": ((2304, 64), (2304, 2304), (3840, 2304), (26, (9216, 1024))),
        # the test fixture (tuner.archs.lumina2.fixture): 3 heads of 32 (1 key/value head), 2 layers
        "tiny": ((96, 64), (96, 64), (160, 96), (2, (384, 96))),
    },
)  # fmt: skip

TEXT_ENCODER_VARIANTS = variant_table(
    CONFIGS / "text_encoder",
    CAUSAL_LM_COLUMNS,
    {
        "gemma2-2b": ((256000, 2304), (26, (9216, 2304))),
        # the test fixture: 2 layers of width 64
        "tiny": ((1536, 64), (2, (128, 64))),
    },
)  # fmt: skip

_TRANSFORMER_WHAT = "Lumina Image 2.0 transformer"
_ORIGINAL_MARKERS = ("cap_embedder.0.weight", "layers.0.attention.qkv.weight")
_DIFFUSERS_MARKERS = ("time_caption_embed.caption_embedder.0.weight", "layers.0.attn.to_q.weight")


_LM_HEAD = "lm_head.weight"
TEXT_ENCODER_SPEC = SingleFileSpec(
    what="Gemma 2 text encoder",
    variants=TEXT_ENCODER_VARIANTS,
    expected_keys=model_keys("Gemma2Model", to_original=causal_lm_key),
    original_markers=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"),
    diffusers_markers=("embed_tokens.weight", "layers.0.self_attn.q_proj.weight"),
    to_original=causal_lm_key,
    aliases={_LM_HEAD: "model.embed_tokens.weight"},  # tied to the embedding; the hidden states skip it
)


# ---------------------------------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype) -> Lumina2Transformer2DModel:
    """Load the Lumina 2 transformer from a diffusers folder or a single file (either layout), in eval mode."""
    from diffusers import Lumina2Transformer2DModel

    folder = resolve_folder(path, "transformer")
    if folder is not None:
        return load_diffusers_folder(Lumina2Transformer2DModel, folder, dtype, "Lumina2Transformer2DModel")
    config_dir, original = identify_transformer_file(path)
    state_dict = normalize_state_dict(load_tensors_of(path), dtype)
    if original:  # the unused norm_final is dropped here
        state_dict = transformer_to_diffusers(state_dict)
    # built with accelerate's empty weights (parameters on meta, other tensors real): the rotary tables
    # are plain tensor attributes computed in __init__, which a meta-device build would leave empty
    return from_state_dict(Lumina2Transformer2DModel, state_dict, config_dir, dtype, Path(path))


def identify_transformer_file(files: str | Path) -> tuple[Path, bool]:
    """(config folder, whether the file is in the original layout) for a single transformer file, after
    checking it is complete. Reads headers only."""
    from diffusers import Lumina2Transformer2DModel

    files = as_file_list(files)
    path = files[0]
    shapes = normalize_shapes(read_shapes_of(files))
    if all(k in shapes for k in _ORIGINAL_MARKERS):
        original = True
    elif all(k in shapes for k in _DIFFUSERS_MARKERS):
        original = False
        shapes = _original_shapes(shapes)
    else:
        raise wrong_architecture(path, shapes, _TRANSFORMER_WHAT, _ORIGINAL_MARKERS)
    for key in UNUSED_ORIGINAL_KEYS:  # optional: the release has it, the network does not
        shapes.pop(key, None)
    variant = pick_variant(shapes, TRANSFORMER_VARIANTS, path, _TRANSFORMER_WHAT)
    expected = {
        transformer_key_to_original(k)
        for k in diffusers_meta_keys(Lumina2Transformer2DModel, variant.config_dir)
    }
    check_keys(expected, shapes, path, f"{_TRANSFORMER_WHAT} {variant.name}")
    return variant.config_dir, original


def _original_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shapes of a diffusers-keyed file under the original names (q, k, v rows summed into `qkv`);
    keys outside the layout are kept, so that check_keys reports them as unexpected."""
    known, unknown = {}, {}
    for key, shape in shapes.items():
        try:
            transformer_key_to_original(key)
            known[key] = torch.empty(shape, device="meta")
        except KeyError:
            unknown[key] = shape
    try:
        return {**{k: tuple(v.shape) for k, v in transformer_to_original(known).items()}, **unknown}
    except KeyError:  # a fused layer with some parts missing: compare under the parts' own names
        return {**{transformer_key_to_original(k): tuple(v.shape) for k, v in known.items()}, **unknown}


def model_inputs(noisy: torch.Tensor, t: torch.Tensor, prompt_embeds: torch.Tensor,
                 prompt_mask: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    """The transformer's keyword arguments (its output is the negated velocity; `predict_velocity`)."""
    return {
        "hidden_states": noisy,
        "timestep": 1 - t.float(),  # fp32, as the pipeline passes it: bf16 would round τ to ~3 digits
        "encoder_hidden_states": prompt_embeds.to(noisy.dtype),
        "encoder_attention_mask": prompt_mask.to(noisy.device),
    }


def predict_velocity(model: Lumina2Transformer2DModel, noisy: torch.Tensor, t: torch.Tensor,
                     prompt_embeds: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """tuner's velocity ε − x0 for latents `noisy` [B, 16, H, W] at noise level t ∈ [0, 1]: the model
    runs at Lumina's time 1 − t and its output (x0 − ε) is negated (see the module docstring)."""
    return -model(**model_inputs(noisy, t, prompt_embeds, prompt_mask), return_dict=False)[0]


# --- the forward cut at its layers, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# Lumina2Transformer2DModel.forward: the caption and noise refiners run in the prologue (their adapters are
# outside the stages' layers), the main layers are the blocks. The contract suite checks the parts against
# the whole forward. The rotary table is complex: it travels as real pairs (torch.view_as_real).


def embed(model: Lumina2Transformer2DModel, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The forward up to its first main layer: (each sample's caption rows then image tokens, padded to the
    longest, the padding mask or empty when all are as long, the rotary table as real pairs, the
    timestep embedding)."""
    from tuner.archs.stages import optional

    latents, mask = inputs["hidden_states"], inputs["encoder_attention_mask"]
    temb, text = model.time_caption_embed(latents, inputs["timestep"], inputs["encoder_hidden_states"])
    tokens, text_rope, image_rope, rope, text_lengths, lengths = model.rope_embedder(latents, mask)
    image = model.x_embedder(tokens)
    for layer in model.context_refiner:
        text = layer(text, mask, text_rope)
    for layer in model.noise_refiner:
        image = layer(image, None, image_rope, temb)
    joint = image.new_zeros(image.shape[0], max(lengths), model.config.hidden_size)
    padding = torch.zeros(joint.shape[:2], dtype=torch.bool, device=joint.device)
    for i, (n_text, n) in enumerate(zip(text_lengths, lengths, strict=True)):
        joint[i, :n_text], joint[i, n_text:n], padding[i, :n] = text[i, :n_text], image[i], True
    return joint, optional(padding if len(set(lengths)) > 1 else None, joint), torch.view_as_real(rope), temb


def run_block(model: Lumina2Transformer2DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    from tuner.archs.stages import call_block, given

    hidden, mask, rope, temb = carried
    return call_block(model, block, hidden, given(mask), torch.view_as_complex(rope), temb), mask, rope, temb


def project_out(model: Lumina2Transformer2DModel, carried: tuple, noisy: torch.Tensor,
                prompt_mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The forward after its last layer: output norm, each sample's image tokens unpatchified, negated (the
    velocity)."""
    from tuner.archs.stages import unpatchify

    hidden, temb = carried[0], carried[-1]
    hidden = model.norm_out(hidden, temb)
    p, (height, width) = model.config.patch_size, noisy.shape[-2:]
    n_image = (height // p) * (width // p)
    rows = [h[n : n + n_image] for h, n in zip(hidden, prompt_mask.sum(dim=1).tolist(), strict=True)]
    return -unpatchify(torch.stack(rows), height, width, p)


# ---------------------------------------------------------------------------------------------------
# Text encoder
# ---------------------------------------------------------------------------------------------------


class TextEncoder(NamedTuple):
    """Gemma 2 (base model, eval mode) and its tokenizer."""

    model: Gemma2Model
    tokenizer: PreTrainedTokenizerBase


def load_text_encoder(path: str | Path, tokenizer_path: str | Path | None, dtype: torch.dtype) -> TextEncoder:
    """Load Gemma 2 and its tokenizer. `tokenizer_path` may be None when `path` is a diffusers pipeline
    root or its `text_encoder` folder (the sibling `tokenizer/` is used); a single file needs it."""
    from transformers import Gemma2Model

    folders = ("text_encoder", "tokenizer")
    model, found = load_encoder(
        path, dtype, Gemma2Model, "gemma2", folders, TEXT_ENCODER_SPEC, base_model_keys
    )
    tokenizer = load_tokenizer(
        tokenizer_path or found, path, "Gemma tokenizer (the tokenizer/ folder of Lumina-Image-2.0)"
    )
    tokenizer.padding_side = "right"  # as Lumina2Pipeline sets it: the mask counts the leading tokens
    return TextEncoder(model, tokenizer)


@torch.no_grad()
def encode_prompts(encoder: TextEncoder, captions: list[str], max_length: int = 256) -> list[torch.Tensor]:
    """One [L, D] embedding per caption (L ≤ max_length, its unmasked tokens), as Lumina2Pipeline
    encodes prompts: system prompt in front, Gemma's second-to-last hidden state.

    The empty caption is encoded without the system prompt (`<bos>` alone): that is the pipeline's
    default negative prompt, the unconditional input of its guidance, and what caption dropout and
    `generate`'s default negative prompt stand for. (The pipeline gives a non-empty negative prompt no
    system prompt either; tuner encodes every non-empty text as a prompt.)"""
    tokens = encoder.tokenizer(
        [PROMPT_FORMAT.format(c) if c else "" for c in captions],
        padding="longest",
        max_length=max_length,
        truncation=True,
        return_tensors="pt",
    )
    device = encoder.model.device
    mask = tokens.attention_mask.to(device)
    out = encoder.model(tokens.input_ids.to(device), attention_mask=mask, output_hidden_states=True)
    return [h[m.bool()] for h, m in zip(out.hidden_states[-2], mask)]


def pad_prompts(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [L_i, D] embeddings to a batch [B, L, D] with its mask [B, L] (True = a token)."""
    length = max(r.shape[0] for r in rows)
    embeds = rows[0].new_zeros(len(rows), length, rows[0].shape[-1])
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, r in enumerate(rows):
        embeds[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = True
    return embeds, mask
