"""LTX-Video 0.9 (Lightricks, 2B): loading its transformer, VAE and T5, and turning captions into context.

* transformer: `LTXVideoTransformer3DModel`, tokens `[B, F·H·W, 128]` (patch 1×1×1), from the release's
  single file (`ltx-video-2b-v0.9.safetensors`: `model.diffusion_model.*` with `patchify_proj`,
  `adaln_single`, `q_norm` / `k_norm`; its bundled `vae.*` is skipped; fp8 too) or a diffusers folder.
* vae: `AutoencoderKLLTXVideo`, 32× spatial and 8× temporal compression, 128 channels, normalized like
  LTX-2's (`tuner.archs.ltx2.loaders.encode_video`), from the diffusers folder.
* text encoder: T5-XXL (`tuner.archs.flux.loaders.load_t5`), 128 tokens padded with their mask, as `LTXPipeline`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.ltx2.loaders import load_release_transformer, tokenize
from tuner.archs.ltx_video.keys import LTX_VIDEO_LAYOUT
from tuner.errors import CheckpointError
from tuner.models.component import component_spec
from tuner.models.identify import Variant
from tuner.models.loading import load_diffusers_folder, normalize_shapes, read_shapes_of, resolve_folder

if TYPE_CHECKING:
    from torch import nn

CONFIGS = Path(__file__).parent / "configs"
TRANSFORMER_VARIANTS = (
    Variant(  # LTX-Video 0.9 / 0.9.1 (2B): 28 blocks of width 2048, T5-XXL captions
        "0.9",
        CONFIGS / "transformer" / "0.9",
        {
            "patchify_proj.weight": (2048, 128),
            "caption_projection.linear_1.weight": (2048, 4096),
            "transformer_blocks.27.attn1.to_q.weight": (2048, 2048),
            "transformer_blocks.28.attn1.to_q.weight": None,
        },
    ),
    Variant(  # the test fixture (tuner.archs.ltx_video.fixture): 2 blocks, 2 heads of 16, T5 width 64
        "tiny",
        CONFIGS / "transformer" / "tiny",
        {
            "patchify_proj.weight": (32, 128),
            "caption_projection.linear_1.weight": (32, 64),
            "transformer_blocks.2.attn1.to_q.weight": None,
        },
    ),
)


_ORIGINAL_MARKERS = (
    "patchify_proj.weight",
    "adaln_single.linear.weight",
    "caption_projection.linear_1.weight",
)
_DIFFUSERS_MARKERS = ("proj_in.weight", "time_embed.linear.weight", "caption_projection.linear_1.weight")
TRANSFORMER_SPEC = component_spec(
    "LTX-Video transformer", "LTXVideoTransformer3DModel", TRANSFORMER_VARIANTS,
    _ORIGINAL_MARKERS, _DIFFUSERS_MARKERS, LTX_VIDEO_LAYOUT.key_to_original)  # fmt: skip


def load_transformer(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The transformer from a diffusers folder or the release's single file."""
    from diffusers import LTXVideoTransformer3DModel

    if Path(path).is_file() and {"audio_patchify_proj.weight", "audio_proj_in.weight"} & set(
        normalize_shapes(read_shapes_of(path))
    ):
        raise CheckpointError(
            f"{path}: an LTX-2 transformer (video and audio streams), not an LTX-Video transformer. "
            'Use model.architecture = "ltx2".'
        )
    return load_release_transformer(
        LTXVideoTransformer3DModel, path, dtype, TRANSFORMER_SPEC, LTX_VIDEO_LAYOUT
    )


def load_vae(path: str | Path, dtype: torch.dtype) -> nn.Module:
    from diffusers import AutoencoderKLLTXVideo

    folder = resolve_folder(path, "vae")
    if folder is None:
        raise CheckpointError(
            f"{path}: the LTX-Video VAE loads from a diffusers folder (`vae/`); point model.vae there."
        )
    return load_diffusers_folder(AutoencoderKLLTXVideo, folder, dtype, "AutoencoderKLLTXVideo")


@torch.no_grad()
def encode_prompts(t5, tokenizer, captions: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """T5's last hidden states `[B, max_length, D]` and the 0/1 mask of the prompt's tokens, as
    `LTXPipeline._get_t5_prompt_embeds`."""
    tokens = tokenize(tokenizer, captions, max_length)
    device = next(t5.parameters()).device
    embeds = t5(tokens.input_ids.to(device))[0]
    return embeds, tokens.attention_mask.to(device)


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# LTXVideoTransformer3DModel.forward without video_coords (training passes the grid's sizes); the contract
# suite checks the parts against the whole forward.


def embed(model: nn.Module, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block on its keyword arguments: (video tokens, text tokens, the
    per-token timestep embedding, rotary cos and sin, the text mask as an additive bias [B, 1, L], the
    embedded timestep the output norm takes)."""
    tokens, mask = inputs["hidden_states"], inputs["encoder_attention_mask"]
    b = tokens.shape[0]
    cos, sin = model.rope(tokens, inputs["num_frames"], inputs["height"], inputs["width"],
                          inputs["rope_interpolation_scale"], None)  # fmt: skip
    bias = ((1 - mask.to(tokens.dtype)) * -10000.0).unsqueeze(1)  # 0 on the caption's rows, -1e4 after
    hidden = model.proj_in(tokens)
    temb, embedded = model.time_embed(inputs["timestep"].flatten(), batch_size=b, hidden_dtype=hidden.dtype)
    text = model.caption_projection(inputs["encoder_hidden_states"]).view(b, -1, hidden.shape[-1])
    return (
        hidden,
        text,
        temb.view(b, -1, temb.shape[-1]),
        cos,
        sin,
        bias,
        embedded.view(b, -1, embedded.shape[-1]),
    )


def run_block(model: nn.Module, block: nn.Module, carried: tuple) -> tuple[torch.Tensor, ...]:
    from tuner.archs.stages import call_block

    hidden, text, temb, cos, sin, bias, embedded = carried
    return (
        call_block(model, block, hidden, text, temb, (cos, sin), bias),
        text,
        temb,
        cos,
        sin,
        bias,
        embedded,
    )


def project_out(model: nn.Module, carried: tuple) -> torch.Tensor:
    """The forward after its last block: the output norm modulated by the embedded timestep, projection
    (output tokens [B, N, C])."""
    hidden, embedded = carried[0], carried[-1]
    shift, scale = (model.scale_shift_table[None, None] + embedded[:, :, None]).unbind(2)
    return model.proj_out(model.norm_out(hidden) * (1 + scale) + shift)
