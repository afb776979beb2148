"""Chroma: loading its transformer and T5 encoder, and turning captions into model inputs.

Chroma is FLUX.1-schnell reworked by lodestones: no CLIP, no guidance embedding, and one small
network, the distilled guidance approximator (`distilled_guidance_layer`), computing every block's
modulation from the timestep in place of the per-block modulation linears. Its VAE is FLUX.1's
(`tuner.archs.flux.loaders.load_vae`), and so are the latent packing and position ids.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder (`ChromaTransformer2DModel`), or the release's single file
  (`chroma-unlocked-v*.safetensors`, `Chroma1-HD.safetensors`; FLUX.1's BFL names with fused `qkv` and
  `linear1`, plus `distilled_guidance_layer.*`; with or without ComfyUI's `model.diffusion_model.`
  prefix; scaled-fp8 files are dequantized), converted by tuner's own `chroma_keys` at any size. A
  FLUX.1 file is refused naming `flux` (and `flux` refuses a Chroma file naming `chroma`);
* T5-XXL encoder: a diffusers folder (the pipeline's `text_encoder/`), or ComfyUI's
  `t5xxl_*.safetensors`, through FLUX.1's T5 loader. A single file carries no tokenizer: pass one.

Text, as ChromaPipeline encodes it: the prompt padded to `max_length` tokens and run through T5 *with*
the tokenizer's attention mask; in the transformer, every padding token except the first is masked out
of attention (lodestones' recipe: one padding token stays visible). A token masked out of attention
changes nothing, so a cache entry keeps only the visible rows (the prompt's tokens, its end token and
one padding row), `collate` pads a batch with masked rows, and `predict_velocity` gives the model the
visible rows alone, with no attention mask.

That is the boolean mask the pipeline means. diffusers 0.42's ChromaPipeline casts its mask to the
text encoder's float dtype, and scaled-dot-product attention *adds* a float mask to the scores (0 / +1,
not masking; huggingface/diffusers#12116), so its own images are not the masked model's; the tests
compare with its transformer given the pipeline's mask as booleans.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from tuner.archs.chroma.keys import transformer_key_to_original, transformer_to_diffusers
from tuner.archs.flux.loaders import image_ids, load_t5, pack_latents, unpack_latents
from tuner.errors import CheckpointError, ConfigError
from tuner.models.component import component_spec, load_component
from tuner.models.identify import CHROMA_MARKER, variant_table
from tuner.models.loading import (
    load_tokenizer,
    normalize_shapes,
    read_folder_config,
    read_tensor_shapes,
    resolve_folder,
)

if TYPE_CHECKING:
    from diffusers import ChromaTransformer2DModel
    from transformers import PreTrainedTokenizerBase, T5EncoderModel

CONFIGS = Path(__file__).parent / "configs"

# ---------------------------------------------------------------------------------------------------
# Known variants (release-layout names of layers that are not fused, so that a file in diffusers' layout
# is matched too; `None`: the tensor must be absent, which pins the block counts)
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("img_in.weight", "txt_in.weight", "distilled_guidance_layer.in_proj.weight",
     "distilled_guidance_layer.out_proj.weight", "distilled_guidance_layer.layers.{}.in_layer.weight",
     "double_blocks.{}.img_attn.proj.weight", "single_blocks.{}.linear2.weight"),
    {
        # chroma-unlocked-v* (v27 to v50), Chroma1-Base, Chroma1-HD: one network
        "chroma1": ((3072, 64), (3072, 4096), (5120, 64), (3072, 5120), (5, (5120, 5120)), (19, (3072, 3072)), (38, (3072, 15360))),
        # the test fixture (tuner.archs.chroma.fixture): 2 heads of 32, one block of each kind
        "tiny": ((64, 64), (64, 64), (64, 64), (64, 64), (2, (64, 64)), (1, (64, 64)), (1, (64, 320))),
    },
)  # fmt: skip

_ORIGINAL_MARKERS = ("double_blocks.0.img_attn.qkv.weight", CHROMA_MARKER)
# FLUX.1's per-block modulation, in either layout: what a FLUX.1 file has and Chroma lacks
_FLUX_MARKERS = ("double_blocks.0.img_mod.lin.weight", "transformer_blocks.0.norm1.linear.weight")


_DIFFUSERS_MARKERS = ("transformer_blocks.0.attn.to_q.weight", CHROMA_MARKER)
TRANSFORMER_SPEC = component_spec(
    "Chroma transformer", "ChromaTransformer2DModel", TRANSFORMER_VARIANTS,
    _ORIGINAL_MARKERS, _DIFFUSERS_MARKERS, transformer_key_to_original)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype) -> ChromaTransformer2DModel:
    """Load the Chroma transformer from a diffusers folder or a single file (either layout), in eval mode."""
    _refuse_flux(path, resolve_folder(path, "transformer"))
    return load_component(
        path, dtype, "ChromaTransformer2DModel", "transformer", TRANSFORMER_SPEC,
        lambda state_dict, _: transformer_to_diffusers(state_dict),
    )  # fmt: skip


def _refuse_flux(path: str | Path, folder: Path | None) -> None:
    """A FLUX.1 transformer (per-block modulation linears, no approximator) names the architecture to use."""
    if folder is not None:
        flux = read_folder_config(folder).get("_class_name") == "FluxTransformer2DModel"
    else:
        flux = any(k in _FLUX_MARKERS for k in normalize_shapes(read_tensor_shapes(path)))
    if flux:
        raise CheckpointError(
            f"{path}: this is a FLUX.1 transformer (per-block modulation layers, no distilled_guidance_layer), "
            'which architecture "chroma" does not train; use architecture = "flux" (FLUX.1-dev).'
        )


class TextEncoder(NamedTuple):
    """Chroma's T5-XXL encoder and its tokenizer, in eval mode."""

    t5: T5EncoderModel
    tokenizer: PreTrainedTokenizerBase


def load_text_encoder(path: str | Path, tokenizer: str | Path | None, dtype: torch.dtype) -> TextEncoder:
    """T5-XXL from a single file or a diffusers folder (a Chroma pipeline root: `text_encoder/`), with
    its tokenizer (`tokenizer`, else the pipeline's `tokenizer/` beside the encoder)."""
    t5, found = load_t5(path, dtype, subfolder="text_encoder", tokenizer="tokenizer")
    return TextEncoder(t5, load_tokenizer(tokenizer or found, path, "T5 (the tokenizer/ folder of Chroma)"))


# ---------------------------------------------------------------------------------------------------
# Inputs for the transformer
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_prompts(
    encoder: TextEncoder, captions: list[str], max_length: int = 512
) -> list[dict[str, torch.Tensor]]:
    """Per caption {"t5": [n, D_t5]}: T5's last hidden state over the prompt padded to `max_length`
    tokens with the attention mask, as ChromaPipeline computes it, cut to the n rows the transformer
    sees (the tokens and one padding token; all `max_length` when the prompt fills them)."""
    tokens = encoder.tokenizer(
        captions, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    )
    mask = tokens.attention_mask.to(encoder.t5.device)
    hidden = encoder.t5(tokens.input_ids.to(encoder.t5.device), attention_mask=mask).last_hidden_state
    visible = (mask.sum(dim=1) + 1).clamp(max=max_length)
    return [{"t5": h[:n].clone()} for h, n in zip(hidden, visible.tolist())]  # not views of all rows


def collate(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{"t5": [B, L, D], "t5_mask": [B, L] bool}: entries padded with masked zero rows to the longest."""
    length = max(e["t5"].shape[0] for e in entries)
    t5 = torch.stack(
        [torch.nn.functional.pad(e["t5"], (0, 0, 0, length - e["t5"].shape[0])) for e in entries]
    )
    mask = torch.arange(length)[None] < torch.tensor([e["t5"].shape[0] for e in entries])[:, None]
    return {"t5": t5, "t5_mask": mask}


def predict_velocity(
    model: ChromaTransformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    t5: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """The model's velocity for latents `noisy` [B, 16, H, W] at t ∈ [0, 1] (shape of `noisy`), given
    T5 rows [B, L, D] whose visible rows are the first of each sample (`mask` [B, L], from `collate`).

    The model sees only the visible rows, so no attention mask is passed: a batch of one length runs
    as one call, a mixed batch one call per sample. (Leaving masked rows out is what masking them does;
    it also sidesteps diffusers' Chroma, which drops the mask from its single blocks under gradient
    checkpointing.)"""
    lengths = mask.sum(dim=1).tolist()
    if len(set(lengths)) == 1:
        return _velocity(model, noisy, t, t5[:, : lengths[0]])
    parts = [
        _velocity(model, noisy[i : i + 1], t[i : i + 1], t5[i : i + 1, :n]) for i, n in enumerate(lengths)
    ]
    return torch.cat(parts)


def _velocity(
    model: ChromaTransformer2DModel, noisy: torch.Tensor, t: torch.Tensor, t5: torch.Tensor
) -> torch.Tensor:
    _, _, h, w = noisy.shape
    out = model(**model_inputs(noisy, t, t5), return_dict=False)[0]
    return unpack_latents(out, h, w)


def model_inputs(noisy: torch.Tensor, t: torch.Tensor, t5: torch.Tensor) -> dict[str, torch.Tensor]:
    """The transformer's keyword arguments for captions of one length (`t5` [B, L, D], every row seen)."""
    _, _, h, w = noisy.shape
    return {
        "hidden_states": pack_latents(noisy),
        "timestep": t,
        "encoder_hidden_states": t5.to(noisy.dtype),
        "txt_ids": torch.zeros(t5.shape[1], 3, device=noisy.device),
        "img_ids": image_ids(h, w, 0, noisy.device),
    }


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# ChromaTransformer2DModel.forward without ControlNet residuals, IP-Adapter inputs or an attention mask
# (`predict_velocity` passes none); the contract suite checks the parts against the whole forward.


def embed(model: ChromaTransformer2DModel, noisy: torch.Tensor, t: torch.Tensor, t5: torch.Tensor,
          mask: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`predict_velocity`'s forward up to its first block, for a micro-batch whose captions are of one
    length: (image tokens, text tokens, every block's modulation from the guidance approximator, rotary cos
    and sin)."""
    lengths = mask.sum(dim=1).tolist()
    if len(set(lengths)) > 1:  # predict runs such samples one by one; one stage input cannot
        raise ConfigError(
            "key 'distributed.pipeline_microbatches': chroma's pipeline stages take micro-batches of captions "
            f"of one length (got {sorted(set(lengths))} tokens); set it to the batch size (one sample each)."
        )
    inputs = model_inputs(noisy, t, t5[:, : lengths[0]])
    hidden = model.x_embedder(inputs["hidden_states"])
    timestep = inputs["timestep"].to(hidden.dtype) * 1000
    modulation = model.distilled_guidance_layer(model.time_text_embed(timestep))
    text = model.context_embedder(inputs["encoder_hidden_states"])
    cos, sin = model.pos_embed(torch.cat((inputs["txt_ids"], inputs["img_ids"]), dim=0))
    return hidden, text, modulation, cos, sin


def run_block(model: ChromaTransformer2DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    """One dual-stream block with its image and text rows of the modulation, or one single-stream block
    with its own on the text then image tokens joined (split again after it)."""
    from tuner.archs.stages import call_block

    hidden, text, modulation, cos, sin = carried
    singles, duals = len(model.single_transformer_blocks), len(model.transformer_blocks)
    if block in model.transformer_blocks:
        i = list(model.transformer_blocks).index(block)
        image_rows, text_rows = 3 * singles + 6 * i, 3 * singles + 6 * duals + 6 * i
        temb = torch.cat(
            [modulation[:, image_rows : image_rows + 6], modulation[:, text_rows : text_rows + 6]], 1
        )
        text, hidden = call_block(model, block, hidden, text, temb, (cos, sin), None)
        return hidden, text, modulation, cos, sin
    i = list(model.single_transformer_blocks).index(block)
    joined = call_block(
        model, block, torch.cat([text, hidden], dim=1), modulation[:, 3 * i : 3 * i + 3], (cos, sin)
    )
    return joined[:, text.shape[1] :], joined[:, : text.shape[1]], modulation, cos, sin


def project_out(model: ChromaTransformer2DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last block: output norm (the modulation's last two rows), projection, unpack."""
    hidden, _, modulation = carried[:3]
    return unpack_latents(model.proj_out(model.norm_out(hidden, modulation[:, -2:])), *noisy.shape[-2:])
