"""AuraFlow (v0.1-v0.3): loading its three models, prompt encoding, and calling the transformer as
AuraFlowPipeline does.

* transformer (diffusers' `AuraFlowTransformer2DModel`, 6.8B: 4 joint blocks then 32 single-stream blocks
  of width 3072): a diffusers folder, fal's single file (`aura_flow_0.3.safetensors`: `double_layers.0...`,
  converted by `tuner.archs.aura_flow.keys`, bit for bit what diffusers' own single-file converter gives),
  the same under ComfyUI's `model.` or `model.diffusion_model.` prefix (a checkpoint bundling the VAE and
  text encoder: those entries are skipped), fp8 files dequantized, or the network saved in diffusers'
  names. v0.1/v0.2 (a 64² position table) and v0.3 (96²) are told apart by the table's shape;
* VAE: SDXL's (`AutoencoderKL`, 4 channels, 8x, scaling factor 0.13025, no shift), loaded by
  `tuner.archs.sdxl.loaders.load_vae` (a `vae/` folder, `sdxl_vae.safetensors`);
* text encoder: Pile-T5-XL as transformers' `UMT5EncoderModel` (a `text_encoder/` folder, or a single file in
  transformers' T5 names, the embedding stored once as `shared.weight`) and its tokenizer (`tokenizer/`).

Prompts are what `AuraFlowPipeline.encode_prompt` computes: tokens padded to `max_sequence_length` (256),
the encoder's last hidden state with the padded rows zeroed. The transformer is given all the rows,
padding included (it takes no text mask), so the length is part of the conditioning and stays fixed.
Calling the model: latents [B, 4, H, W] (normalized: mean · 0.13025), t ∈ [0, 1] (1 = noise) as the
timestep; it predicts the velocity noise − x0.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from tuner.archs.aura_flow.keys import AURA_FLOW_LAYOUT
from tuner.models.component import component_spec, load_component
from tuner.models.encoders import T5_COLUMNS, load_encoder, model_keys
from tuner.models.identify import SingleFileSpec, variant_table
from tuner.models.loading import load_tokenizer

if TYPE_CHECKING:
    from diffusers import AuraFlowTransformer2DModel
    from transformers import PreTrainedTokenizerBase, UMT5EncoderModel

CONFIGS = Path(__file__).parent / "configs"
T = TypeVar("T")

MAX_SEQUENCE_LENGTH = 256
"""AuraFlowPipeline's `max_sequence_length`: every prompt is padded to it."""

TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("init_x_linear.weight", "positional_encoding", "double_layers.{}.attn.w2q.weight",
     "single_layers.{}.mlp.c_fc1.weight"),
    {
        # v0.1 / v0.2 and v0.3: 4 joint + 32 single blocks of 3072, a 64² / 96² position table
        "v0.1": ((3072, 16), (1, 4096, 3072), (4, (3072, 3072)), (32, (8192, 3072))),
        "v0.3": ((3072, 16), (1, 9216, 3072), (4, (3072, 3072)), (32, (8192, 3072))),
        # the test fixture (tuner.archs.aura_flow.fixture): 2 heads of 32, 1 joint + 2 single blocks
        "tiny": ((64, 16), (1, 256, 64), (1, (64, 64)), (2, (256, 64))),
    },
)  # fmt: skip

TRANSFORMER_SPEC = component_spec(
    "AuraFlow transformer",
    "AuraFlowTransformer2DModel",
    TRANSFORMER_VARIANTS,
    ("double_layers.0.attn.w1q.weight", "cond_seq_linear.weight", "init_x_linear.weight"),
    ("joint_transformer_blocks.0.attn.add_q_proj.weight", "context_embedder.weight"),
    AURA_FLOW_LAYOUT.key_to_original,
)

# The encoder's embedding is tied to `shared`; single files store only `shared.weight`.
_TIED_EMBEDDING = {"encoder.embed_tokens.weight": "shared.weight"}
TEXT_ENCODER_SPEC = SingleFileSpec(
    what="Pile-T5-XL text encoder (UMT5)",
    variants=variant_table(
        CONFIGS / "text_encoder",
        T5_COLUMNS,
        {"pile-t5-xl": ((32128, 2048), (24, (5120, 2048))), "tiny": ((512, 64), (2, (128, 64)))},
    ),
    expected_keys=model_keys("UMT5EncoderModel", leave_out=tuple(_TIED_EMBEDDING)),
    original_markers=("shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight"),
    aliases=_TIED_EMBEDDING,
)

# Where a bundled checkpoint keeps the other components (skipped when reading the transformer)
_COMPANIONS = ("vae.", "first_stage_model.", "text_encoders.", "conditioner.")


def load_transformer(path: str | Path, dtype: torch.dtype) -> AuraFlowTransformer2DModel:
    """Load the AuraFlow transformer from a diffusers folder or a single file (either layout), in eval mode."""
    return load_component(
        path, dtype, "AuraFlowTransformer2DModel", "transformer", TRANSFORMER_SPEC,
        lambda state_dict, _: AURA_FLOW_LAYOUT.to_diffusers(state_dict),
        bundled=("model.diffusion_model.", "model."), entries=_without_companions,
    )  # fmt: skip


def _without_companions(entries: Mapping[str, T]) -> dict[str, T]:
    return {k: v for k, v in entries.items() if not k.startswith(_COMPANIONS)}


class TextEncoder(NamedTuple):
    """Pile-T5-XL (eval mode) and its tokenizer."""

    model: UMT5EncoderModel
    tokenizer: PreTrainedTokenizerBase


def load_text_encoder(path: str | Path, tokenizer_path: str | Path | None, dtype: torch.dtype) -> TextEncoder:
    """Load the UMT5 encoder and its tokenizer. `tokenizer_path` may be None for a diffusers pipeline root or
    its `text_encoder/` folder (the sibling `tokenizer/` is used); a single file needs it."""
    from transformers import UMT5EncoderModel

    folders = ("text_encoder", "tokenizer")
    model, found = load_encoder(path, dtype, UMT5EncoderModel, "umt5", folders, TEXT_ENCODER_SPEC)
    tokenizer = load_tokenizer(
        tokenizer_path or found, path, "Pile-T5 tokenizer (the tokenizer/ folder of AuraFlow)"
    )
    return TextEncoder(model, tokenizer)


@torch.no_grad()
def encode_prompts(
    encoder: TextEncoder, captions: list[str], max_length: int = MAX_SEQUENCE_LENGTH
) -> list[torch.Tensor]:
    """One [max_length, D] tensor per caption: the last hidden state over the tokens padded to `max_length`,
    padded rows zeroed (AuraFlowPipeline.encode_prompt)."""
    model, tokenizer = encoder
    tokens = tokenizer(
        captions, truncation=True, max_length=max_length, padding="max_length", return_tensors="pt"
    )
    mask = tokens.attention_mask.to(model.device)
    hidden = model(input_ids=tokens.input_ids.to(model.device), attention_mask=mask)[0]
    return list(hidden * mask.unsqueeze(-1).to(hidden.dtype))


def predict_velocity(
    model: AuraFlowTransformer2DModel, noisy: torch.Tensor, t: torch.Tensor, prompt_embeds: torch.Tensor
) -> torch.Tensor:
    """The velocity (noise − x0) for latents `noisy` [B, 4, H, W] at t ∈ [0, 1], given the padded prompt
    embeddings [B, L, D]."""
    return model(
        noisy,
        encoder_hidden_states=prompt_embeds.to(noisy.dtype),
        timestep=t.to(noisy.dtype),
        return_dict=False,
    )[0]


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# AuraFlowTransformer2DModel.forward; the contract suite checks the parts against the whole forward.


def embed(model: AuraFlowTransformer2DModel, noisy: torch.Tensor, t: torch.Tensor,
          prompt_embeds: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`predict_velocity`'s forward up to its first block: (image tokens with their positions, the register
    tokens followed by the text tokens, the timestep embedding)."""
    hidden = model.pos_embed(noisy)
    temb = model.time_step_proj(model.time_step_embed(t.to(noisy.dtype)).to(next(model.parameters()).dtype))
    text = model.context_embedder(prompt_embeds.to(noisy.dtype))
    registers = model.register_tokens.to(text.dtype).expand(text.shape[0], -1, -1)
    return hidden, torch.cat([registers, text], dim=1), temb


def run_block(
    model: AuraFlowTransformer2DModel, block: torch.nn.Module, carried: tuple
) -> tuple[torch.Tensor, ...]:
    """One joint block (the streams apart), or one single block on the text then image tokens joined (split
    again after it: the next single block joins them as they were)."""
    from diffusers.models.transformers.auraflow_transformer_2d import AuraFlowJointTransformerBlock

    from tuner.archs.stages import call_block

    hidden, text, temb = carried
    if isinstance(block, AuraFlowJointTransformerBlock):
        text, hidden = call_block(model, block, hidden, text, temb)
        return hidden, text, temb
    joined = call_block(model, block, torch.cat([text, hidden], dim=1), temb)
    return joined[:, text.shape[1] :], joined[:, : text.shape[1]], temb


def project_out(model: AuraFlowTransformer2DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last block: output norm, projection and unpatchify to `noisy`'s shape."""
    from tuner.archs.stages import unpatchify

    hidden, _, temb = carried
    tokens = model.proj_out(model.norm_out(hidden, temb))
    return unpatchify(tokens, *noisy.shape[-2:], model.config.patch_size)
