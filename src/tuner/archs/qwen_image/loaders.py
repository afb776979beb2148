"""Qwen-Image and Qwen-Image-Edit: loading the transformer and VAE, and turning latents into model inputs.

The text side (Qwen2.5-VL, prompt templates, control images seen by the VL model) is in
`tuner.archs.qwen_image.text`.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder, or the single file (ComfyUI's `qwen_image_bf16.safetensors`,
  `qwen_image_edit_2509_bf16.safetensors`, ...). Qwen's release already uses diffusers' module names
  (`transformer_blocks.0.attn.to_q.weight`, `img_mod.1`, `txt_mlp.net.2`, ...), so the single file is
  the diffusers state dict, with or without ComfyUI's `model.diffusion_model.` prefix. ComfyUI marks
  Qwen-Image-Edit-2511 files with an empty `__index_timestep_zero__` tensor: that model gives the
  control-image tokens timestep 0 (diffusers' `zero_cond_t`), so the marker picks the `-edit-2511`
  config of the variant the shapes name. Every other Qwen-Image model (2512, Edit, Edit-2509) has the
  plain config.
* VAE: a diffusers folder, or ComfyUI's `qwen_image_vae.safetensors`. The Qwen-Image VAE is the Wan 2.1
  VAE architecture (its decoder fine-tuned), and the single file uses the original Wan key layout
  (`encoder.conv1.weight`, `decoder.upsamples.0.residual.0.gamma`, ...), so `tuner.archs.wan.keys`
  renames it. diffusers has no single-file loader for `AutoencoderKLQwenImage`; this module builds it.
  Because the shapes equal Wan 2.1's, a Wan 2.1 VAE file also loads here (with the wrong decoder).

Latents: 16 channels, 8× spatial compression, one frame, normalized per channel with the VAE config's
`latents_mean` / `latents_std`. The transformer sees them as 2×2 patches packed into tokens of 64
values; Qwen-Image-Edit appends the packed control latents as further image tokens (each with its own
entry in `img_shapes`, which positions it in the 3-D RoPE) and its output keeps the target tokens.
The transformer's timestep is the flow-matching t ∈ [0, 1] itself (the pipeline passes
`scheduler_t / 1000`; the model scales by 1000 inside).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from tuner.archs.wan import loaders as wan
from tuner.archs.wan.keys import vae_key_to_original
from tuner.models.component import component_spec, diffusers_class, diffusers_keys, load_component
from tuner.models.identify import Variant, diffusers_meta_keys, variant_table
from tuner.models.loading import normalize_shapes, read_tensor_shapes
from tuner.networks.architectures import COMFY_BARE_FORMS, ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

# diffusers is imported where a model is built: importing it costs seconds (every diffusers model class,
# torch._dynamo), which a command that loads no model should not pay.
if TYPE_CHECKING:
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

__all__ = [
    "TRANSFORMER_VARIANTS",
    "VAE_VARIANTS",
    "load_transformer",
    "load_vae",
    "encode_images",
    "decode_latents",
    "pack_latents",
    "unpack_latents",
    "predict_velocity",
]

CONFIGS = Path(__file__).parent / "configs"
T = TypeVar("T")
LATENT_CHANNELS = 16
VAE_FACTOR = 8

# ComfyUI's marker tensor in Qwen-Image-Edit-2511 single files (no data; its presence is the flag).
INDEX_TIMESTEP_ZERO = "__index_timestep_zero__"

# ---------------------------------------------------------------------------------------------------
# Known variants. `None` means the tensor must be absent (it pins the number of blocks).
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("img_in.weight", "txt_in.weight", "transformer_blocks.{}.img_mod.1.weight",
     "time_text_embed.addition_t_embedding.weight"),
    {
        # Qwen-Image, -2512, -Edit, -Edit-2509, -Edit-2511 (20B): 60 blocks of width 3072
        "qwen-image": ((3072, 64), (3072, 3584), (60, (18432, 3072)), None),
        # the test fixture (tuner.archs.qwen_image.fixture): 2 heads of 32, 2 blocks, text width 64
        "tiny": ((64, 64), (64, 64), (2, (384, 64)), None),
    },
)  # fmt: skip

VAE_VARIANTS = variant_table(
    CONFIGS / "vae",
    ("encoder.conv1.weight", "decoder.conv1.weight"),
    {
        "qwen-image": ((96, 3, 3, 3, 3), (384, 16, 3, 3, 3)),
        "tiny": ((16, 3, 3, 3, 3), (64, 16, 3, 3, 3)),
    },
)  # fmt: skip

# The transformer's linear layers ({i}: block index). The release uses these diffusers names, so the
# adapter key table (`tuner.networks.architectures`) is the identity over them; listing them lets
# kohya-style names (dots turned into underscores) be read back unambiguously.
LINEAR_MODULES = (
    *(
        f"transformer_blocks.{{i}}.{name}"
        for name in (
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
            "img_mod.1", "txt_mod.1",
            "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
        )
    ),
    "img_in", "txt_in", "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2", "norm_out.linear", "proj_out",
)  # fmt: skip
QWEN_IMAGE_KEYS = ArchitectureKeys(
    "qwen_image",
    tuple((name, name) for name in LINEAR_MODULES),
    same_names=True,
    comfy_forms=COMFY_BARE_FORMS,
)
"""The key table of Qwen-Image and Qwen-Image-Edit: the release's names are diffusers'."""
QWEN_IMAGE_LAYOUT = CheckpointLayout(QWEN_IMAGE_KEYS)

_TRANSFORMER_MARKERS = ("img_in.weight", "txt_norm.weight", "transformer_blocks.0.img_mod.1.weight")
TRANSFORMER_SPEC = component_spec(
    "Qwen-Image transformer", "QwenImageTransformer2DModel", TRANSFORMER_VARIANTS, _TRANSFORMER_MARKERS
)


def _zero_cond_config(variant: Variant) -> Path:
    """The config of a variant's Edit-2511 form (diffusers' `zero_cond_t=True`)."""
    return variant.config_dir.with_name(f"{variant.config_dir.name}-edit-2511")


# the Wan 2.1 VAE's layout, names and markers
_vae_keys = diffusers_keys("AutoencoderKLQwenImage", vae_key_to_original)
VAE_SPEC = replace(wan.VAE_SPEC, what="Qwen-Image VAE", variants=VAE_VARIANTS, expected_keys=_vae_keys)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype) -> QwenImageTransformer2DModel:
    """Load the Qwen-Image transformer from a diffusers folder or a single file, in eval mode (a file
    carrying Edit-2511's marker with that release's config)."""
    path = Path(path)
    edit_2511 = path.is_file() and INDEX_TIMESTEP_ZERO in normalize_shapes(read_tensor_shapes(path))
    return load_component(
        path,
        dtype,
        "QwenImageTransformer2DModel",
        "transformer",
        TRANSFORMER_SPEC,
        config=_zero_cond_config if edit_2511 else None,
        entries=_without_marker,
        diffusers_converter=True,
    )


def _without_marker(entries: dict[str, T]) -> dict[str, T]:
    return {k: v for k, v in entries.items() if k != INDEX_TIMESTEP_ZERO}


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKLQwenImage:
    """Load the Qwen-Image VAE from a diffusers folder or a single file (Wan 2.1 original keys)."""
    return load_component(path, dtype, "AutoencoderKLQwenImage", "vae", VAE_SPEC, _vae_to_diffusers)


def _vae_to_diffusers(state_dict: dict[str, torch.Tensor], variant: Variant) -> dict[str, torch.Tensor]:
    """The original layout's tensors under diffusers' keys (renamed by the model's own key list)."""
    keys = diffusers_meta_keys(diffusers_class("AutoencoderKLQwenImage"), variant.config_dir)
    by_original = {vae_key_to_original(k): k for k in keys}
    return {by_original[k]: v for k, v in state_dict.items()}


# ---------------------------------------------------------------------------------------------------
# Latents
# ---------------------------------------------------------------------------------------------------


def _latent_stats(vae: AutoencoderKLQwenImage, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the latent channels, shaped to broadcast over [B, C, F, H, W]."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, std


@torch.no_grad()
def encode_images(vae: AutoencoderKLQwenImage, pixels: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, 16, 1, H/8, W/8] of images [B, 3, 1, H, W] in [-1, 1].

    The mean of the latent distribution (the pipelines' `sample_mode="argmax"`), then
    (latents − latents_mean) / latents_std, as QwenImageEditPipeline encodes its input image.
    """
    if pixels.ndim != 5 or pixels.shape[2] != 1 or pixels.shape[3] % 16 or pixels.shape[4] % 16:
        raise ValueError(
            f"Qwen-Image takes single frames with sides divisible by 16, got {tuple(pixels.shape)}"
        )
    param = next(vae.parameters())
    latents = vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode()
    mean, std = _latent_stats(vae, latents)
    return (latents - mean) / std


@torch.no_grad()
def decode_latents(vae: AutoencoderKLQwenImage, latents: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, 1, H, W] in about [-1, 1] from normalized latents (the inverse of `encode_images`)."""
    param = next(vae.parameters())
    latents = latents.to(param.device, param.dtype)
    mean, std = _latent_stats(vae, latents)
    return vae.decode(latents * std + mean).sample


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, 1, H, W] → tokens [B, (H/2)(W/2), 4C]: each 2×2 patch, channel-major within the token."""
    b, c, f, h, w = latents.shape
    if f != 1 or h % 2 or w % 2:
        raise ValueError(f"Qwen-Image packs one frame with even latent sides, got {tuple(latents.shape)}")
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_latents` for a latent of `height` × `width`."""
    b, _, d = tokens.shape
    x = tokens.reshape(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, 1, height, width)


def model_inputs(
    noisy: torch.Tensor,
    t: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_mask: torch.Tensor | None = None,
    controls: list[torch.Tensor] = (),
) -> dict:
    """The transformer's keyword arguments for latents `noisy` [B, 16, 1, H, W] at t ∈ [0, 1], as the
    pipelines call it: target tokens first, then each control latent's tokens; `img_shapes` lists the patch
    grid of each; the text mask is dropped when it masks nothing (as `encode_prompt` does)."""
    tokens = [pack_latents(noisy)] + [pack_latents(c.to(noisy.dtype)) for c in controls]
    grids = [(1, x.shape[-2] // 2, x.shape[-1] // 2) for x in [noisy, *controls]]
    if prompt_mask is not None and bool(prompt_mask.all()):
        prompt_mask = None
    return {
        "hidden_states": torch.cat(tokens, dim=1),
        "timestep": t.to(noisy.dtype),
        "encoder_hidden_states": prompt_embeds.to(noisy.dtype),
        "encoder_hidden_states_mask": prompt_mask,
        "img_shapes": [grids] * noisy.shape[0],
    }


def predict_velocity(
    model: QwenImageTransformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_mask: torch.Tensor | None = None,
    controls: list[torch.Tensor] = (),
) -> torch.Tensor:
    """The transformer's velocity (the target's tokens of its output) on `model_inputs`."""
    out = model(**model_inputs(noisy, t, prompt_embeds, prompt_mask, controls), return_dict=False)[0]
    return velocity(out, noisy)


def velocity(out: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """The output tokens → the target latents' velocity (the control latents' tokens dropped)."""
    height, width = noisy.shape[-2:]
    return unpack_latents(out[:, : (height // 2) * (width // 2)], height, width)


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# QwenImageTransformer2DModel.forward without ControlNet residuals or guidance (training passes neither);
# the contract suite checks the parts against the whole forward. The rotary tables are complex: they travel
# as real pairs (torch.view_as_real).


def embed(model: QwenImageTransformer2DModel, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block: (image tokens, text tokens, text mask or empty, timestep
    embedding, image and text rotary tables as real pairs, per-token modulation index or empty). Models
    with `zero_cond_t` (Edit 2511) embed a second, zero timestep for the control tokens; the index picks it."""
    from math import prod

    from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

    from tuner.archs.stages import optional

    hidden = model.img_in(inputs["hidden_states"])
    timestep, shapes = inputs["timestep"].to(hidden.dtype), inputs["img_shapes"]
    index = None
    if model.zero_cond_t:
        timestep = torch.cat([timestep, timestep * 0])
        index = torch.tensor([[0] * prod(grids[0]) + [1] * sum(prod(g) for g in grids[1:]) for grids in shapes],
                             device=timestep.device, dtype=torch.int)  # fmt: skip
    text = model.txt_in(model.txt_norm(inputs["encoder_hidden_states"]))
    text_length, _, mask = compute_text_seq_len_from_mask(text, inputs["encoder_hidden_states_mask"])
    temb = model.time_text_embed(timestep, hidden)
    image_rope, text_rope = model.pos_embed(shapes, max_txt_seq_len=text_length, device=hidden.device)
    return (hidden, text, optional(mask, hidden), temb, torch.view_as_real(image_rope),
            torch.view_as_real(text_rope), optional(index, hidden))  # fmt: skip


def run_block(model: QwenImageTransformer2DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    """One dual-stream block on the carried tensors."""
    from tuner.archs.stages import call_block, given

    hidden, text, mask, temb, image_rope, text_rope, index = carried
    rope = (torch.view_as_complex(image_rope), torch.view_as_complex(text_rope))
    text, hidden = call_block(model, block, hidden, text, given(mask), temb, rope, None, given(index))
    return hidden, text, mask, temb, image_rope, text_rope, index


def project_out(model: QwenImageTransformer2DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last block: output norm (on the target's timestep), projection, velocity."""
    hidden, temb = carried[0], carried[3]
    if model.zero_cond_t:
        temb = temb.chunk(2, dim=0)[0]
    return velocity(model.proj_out(model.norm_out(hidden, temb)), noisy)
