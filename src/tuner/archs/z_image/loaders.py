"""Z-Image (Turbo and Base): loading the transformer, its two checkpoint layouts, and calling it.

Z-Image is a single-stream DiT (diffusers' `ZImageTransformer2DModel`, 6B): image tokens pass through
`noise_refiner` blocks, the caption through `context_refiner` blocks, then both, concatenated per
sample, through the main `layers`. The text side (Qwen3-4B) is in `tuner.archs.z_image.text`; the VAE
is FLUX.1's (16 channels, `ae.safetensors`), loaded by `tuner.archs.flux.loaders`.

The transformer loads from either layout users have:

* a diffusers folder (`Tongyi-MAI/Z-Image-Turbo`'s `transformer/`, or the pipeline root);
* the release's single file (ComfyUI's `z_image_turbo_bf16.safetensors`, fp8 files too, with or without
  `model.diffusion_model.`). It keeps q, k and v of every block in one `attention.qkv` matrix (rows q, k,
  v), names the output projection `attention.out` and the q/k RMSNorms `attention.q_norm` / `k_norm`, and
  drops diffusers' patch-size keys (`x_embedder`, `final_layer` for `all_x_embedder.2-1`,
  `all_final_layer.2-1`). Everything else has diffusers' names. Some files also carry an unused
  `norm_final.weight`, which is ignored (the model's final LayerNorm has no weights).

Turbo (step-distilled, 8 steps without guidance) and Base share the network and every tensor shape, so
a file cannot say which it is; tuner goes by the name (`turbo` in the file or folder name) and only
uses it to warn that training Turbo directly undoes its distillation (`is_turbo`).

Calling the model (`predict_velocity`), as ZImagePipeline does: each sample is its own tensor
[16, 1, H, W] in a list, the caption its own [L, D] tensor of true length; the timestep is 1 - t
(the model's 0 is pure noise), and its output is the negated velocity.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.errors import CheckpointError
from tuner.models.identify import Variant, check_keys, diffusers_meta_keys, pick_variant, wrong_architecture
from tuner.models.loading import (
    as_file_list,
    from_state_dict,
    load_diffusers_folder,
    load_tensors_of,
    normalize_shapes,
    normalize_state_dict,
    read_shapes_of,
    resolve_folder,
)
from tuner.networks.architectures import MUSUBI_DIFFUSERS_NAMES, ArchitectureKeys
from tuner.networks.fused import FusedLayer
from tuner.networks.layouts import CheckpointLayout

# diffusers is imported where a model is built: importing it costs seconds.
if TYPE_CHECKING:
    from diffusers import ZImageTransformer2DModel

CONFIGS = Path(__file__).parent / "configs"
LATENT_CHANNELS = 16
VAE_FACTOR = 8

# ---------------------------------------------------------------------------------------------------
# The release's layout relative to diffusers' ({i}: block index), as data
# ---------------------------------------------------------------------------------------------------
BLOCK_LISTS = ("noise_refiner", "context_refiner", "layers")

# (diffusers, original) modules. The linear layers are listed one by one (so kohya spellings read
# back); then each block and top-level module maps to itself for the tensors no rule above renames.
_RENAMES: tuple[tuple[str, str], ...] = (
    *(
        pair
        for blocks in BLOCK_LISTS
        for pair in (
            (f"{blocks}.{{i}}.attention.to_out.0", f"{blocks}.{{i}}.attention.out"),
            (f"{blocks}.{{i}}.attention.norm_q", f"{blocks}.{{i}}.attention.q_norm"),
            (f"{blocks}.{{i}}.attention.norm_k", f"{blocks}.{{i}}.attention.k_norm"),
            *((f"{blocks}.{{i}}.{m}",) * 2 for m in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")),
            (f"{blocks}.{{i}}.adaLN_modulation.0",) * 2,
            (f"{blocks}.{{i}}",) * 2,  # the block's RMSNorms
        )
    ),
    ("all_x_embedder.2-1", "x_embedder"),
    ("all_final_layer.2-1.linear", "final_layer.linear"),
    ("all_final_layer.2-1.adaLN_modulation.1", "final_layer.adaLN_modulation.1"),
    ("t_embedder.mlp.0",) * 2,
    ("t_embedder.mlp.2",) * 2,
    ("cap_embedder.0",) * 2,  # RMSNorm
    ("cap_embedder.1",) * 2,
    ("x_pad_token",) * 2,
    ("cap_pad_token",) * 2,
)  # fmt: skip

_FUSED = tuple(
    FusedLayer(
        f"{blocks}.{{i}}.attention.qkv",
        tuple(f"{blocks}.{{i}}.attention.{p}" for p in ("to_q", "to_k", "to_v")),
    )
    for blocks in BLOCK_LISTS
)

Z_IMAGE_KEYS = ArchitectureKeys(
    "z_image",
    _RENAMES,
    _FUSED,
    musubi=MUSUBI_DIFFUSERS_NAMES,
    # ComfyUI's `Lumina2` maps `z_image_to_diffusers`' names: Z-Image's diffusers names (Lumina 2's differ)
    comfy_forms=("transformer.{d}", "diffusion_model.{d}", "{d}"),
)
"""The adapter name map (diffusers module -> the release's), with the fused `attention.qkv` layers."""
Z_IMAGE_LAYOUT = CheckpointLayout(Z_IMAGE_KEYS)
"""The whole transformer checkpoint both ways (`to_original` / `to_diffusers`), at any size."""

UNUSED_KEYS = ("norm_final.weight",)
"""Tensors some release files carry that the model has no place for (dropped when loading)."""

# ---------------------------------------------------------------------------------------------------
# Known variants (signatures in the release's names; `None`: must be absent, pinning the block count)
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = (
    Variant(  # Z-Image-Turbo and Z-Image (Base), 6B: 30 layers of width 3840, Qwen3-4B captions (2560)
        "z-image",
        CONFIGS / "transformer" / "base",
        {
            "x_embedder.weight": (3840, 64),
            "cap_embedder.1.weight": (3840, 2560),
            "layers.29.attention.qkv.weight": (11520, 3840),
            "layers.30.attention.qkv.weight": None,
            "noise_refiner.1.attention.qkv.weight": (11520, 3840),
            "siglip_embedder.1.weight": None,  # Z-Image-Omni
        },
    ),
    Variant(  # the test fixture (tuner.archs.z_image.fixture): 3 heads of 32, 1 refiner block each, 2 layers
        "tiny",
        CONFIGS / "transformer" / "tiny",
        {
            "x_embedder.weight": (96, 64),
            "cap_embedder.1.weight": (96, 64),
            "layers.1.attention.qkv.weight": (288, 96),
            "layers.2.attention.qkv.weight": None,
            "siglip_embedder.1.weight": None,
        },
    ),
)
TURBO_CONFIG = CONFIGS / "transformer" / "turbo"

_WHAT = "Z-Image transformer"
_ORIGINAL_MARKERS = ("x_embedder.weight", "cap_embedder.1.weight", "layers.0.attention.qkv.weight")
_DIFFUSERS_MARKERS = ("all_x_embedder.2-1.weight", "cap_embedder.1.weight", "layers.0.attention.to_q.weight")


def is_turbo(path: str | Path) -> bool:
    """Whether a transformer file or folder is Z-Image-Turbo, by its name (the shapes equal Base's): the
    file's, or a diffusers folder's and its parent's (`Z-Image-Turbo/transformer`)."""
    path = Path(path)
    names = [path.name] if path.is_file() else [path.name, path.parent.name]
    return any("turbo" in name.lower() for name in names)


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype) -> ZImageTransformer2DModel:
    """Load the Z-Image transformer from a diffusers folder or a single file (either layout), in eval mode."""
    from diffusers import ZImageTransformer2DModel

    folder = resolve_folder(path, "transformer")
    if folder is not None:
        return load_diffusers_folder(ZImageTransformer2DModel, folder, dtype, "ZImageTransformer2DModel")
    config_dir = identify_transformer_file(path)
    state_dict = normalize_state_dict(load_tensors_of(path), dtype)
    for key in UNUSED_KEYS:
        state_dict.pop(key, None)
    if all(k in state_dict for k in _ORIGINAL_MARKERS):
        state_dict = Z_IMAGE_LAYOUT.to_diffusers(state_dict)
    return from_state_dict(ZImageTransformer2DModel, state_dict, config_dir, dtype, Path(path))


def identify_transformer_file(files: str | Path) -> Path:
    """The config folder for a single transformer file (either layout), after checking it is complete
    (headers only). Turbo's config when the name says Turbo (the two have the same shapes)."""
    from diffusers import ZImageTransformer2DModel

    files = as_file_list(files)
    path = files[0]
    shapes = normalize_shapes(read_shapes_of(files))
    for key in UNUSED_KEYS:
        shapes.pop(key, None)
    if all(k in shapes for k in _DIFFUSERS_MARKERS):
        shapes = _original_shapes(shapes, path)
    elif not all(k in shapes for k in _ORIGINAL_MARKERS):
        raise wrong_architecture(path, shapes, _WHAT, _ORIGINAL_MARKERS)
    variant = pick_variant(shapes, TRANSFORMER_VARIANTS, path, _WHAT)
    expected = Z_IMAGE_LAYOUT.to_original(
        dict.fromkeys(diffusers_meta_keys(ZImageTransformer2DModel, variant.config_dir), torch.empty(1))
    )
    check_keys(expected, shapes, path, f"{_WHAT} {variant.name}")
    if variant.name != "tiny" and is_turbo(path):
        return TURBO_CONFIG
    return variant.config_dir


def _original_shapes(shapes: dict[str, tuple[int, ...]], path: Path) -> dict[str, tuple[int, ...]]:
    """The shapes of a file in diffusers' layout as the release's tensors would have them (q, k, v
    fused); keys outside the layout are kept, so that check_keys names them."""
    known, unknown = {}, {}
    for key, shape in shapes.items():
        try:
            Z_IMAGE_LAYOUT.key_to_original(key)
            known[key] = torch.empty(shape, device="meta")
        except KeyError:
            unknown[key] = shape
    try:
        fused = Z_IMAGE_LAYOUT.to_original(known)
    except KeyError as e:
        raise CheckpointError(f"{path}: an incomplete {_WHAT} in diffusers' layout: {e}") from None
    return {**{k: tuple(v.shape) for k, v in fused.items()}, **unknown}


# ---------------------------------------------------------------------------------------------------
# Calling the model
# ---------------------------------------------------------------------------------------------------


def predict_velocity(
    model: ZImageTransformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_mask: torch.Tensor,
) -> torch.Tensor:
    """The velocity (noise - x0) for latents `noisy` [B, 16, H, W] at t ∈ [0, 1] (1 = noise), given the
    captions' hidden states padded to [B, L, D] with `prompt_mask` [B, L] marking the real rows."""
    latents = list(noisy.unsqueeze(2).unbind(0))  # one [16, 1, H, W] per sample
    captions = [
        rows[keep] for rows, keep in zip(prompt_embeds.to(noisy.dtype), prompt_mask.bool(), strict=True)
    ]
    out = model(latents, 1.0 - t.float(), captions, return_dict=False)[0]
    return -torch.stack(out).squeeze(2)


# --- the forward cut at its layers, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# ZImageTransformer2DModel.forward in its basic mode (one image per caption), at the forward's default
# patch sizes, through the model's own sequence helpers (patchify_and_embed, _prepare_sequence,
# _build_unified_sequence, unpatchify). The noise and caption refiners run in the prologue (their adapters
# are outside the stages' layers), the main layers are the blocks. The contract suite checks the parts
# against the whole forward. The rotary table is complex: it travels as real pairs (torch.view_as_real).
PATCH, FRAME_PATCH = 2, 1  # the forward's defaults, as `predict_velocity` calls it
EMBEDDER = f"{PATCH}-{FRAME_PATCH}"


def embed(model: ZImageTransformer2DModel, noisy: torch.Tensor, t: torch.Tensor, prompt_embeds: torch.Tensor,
          prompt_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`predict_velocity`'s forward up to its first main layer: (the unified image and caption sequence,
    its mask or empty, its rotary table as real pairs, the timestep embedding)."""
    from tuner.archs.stages import call_block, optional

    latents = list(noisy.unsqueeze(2).unbind(0))
    captions = [
        rows[keep] for rows, keep in zip(prompt_embeds.to(noisy.dtype), prompt_mask.bool(), strict=True)
    ]
    adaln = model.t_embedder((1.0 - t.float()) * model.t_scale).type_as(latents[0])
    image, text, _, image_ids, text_ids, image_pad, text_pad = model.patchify_and_embed(latents, captions, PATCH,
                                                                                      FRAME_PATCH)  # fmt: skip
    image_lengths, text_lengths = [len(x) for x in image], [len(x) for x in text]
    image = model.all_x_embedder[EMBEDDER](torch.cat(image)).split(image_lengths)
    image, image_rope, image_mask, _, noise = model._prepare_sequence(list(image), image_ids, image_pad,
                                                                      model.x_pad_token, None, noisy.device)  # fmt: skip
    for layer in model.noise_refiner:
        image = call_block(model, layer, image, image_mask, image_rope, adaln, noise, None, None)
    text = model.cap_embedder(torch.cat(text)).split(text_lengths)
    text, text_rope, text_mask, _, _ = model._prepare_sequence(list(text), text_ids, text_pad, model.cap_pad_token,
                                                               None, noisy.device)  # fmt: skip
    for layer in model.context_refiner:
        text = call_block(model, layer, text, text_mask, text_rope)
    unified, rope, mask, _ = model._build_unified_sequence(
        image, image_rope, image_lengths, None, text, text_rope, text_lengths, None, None, None, None, None, False,
        noisy.device,
    )  # fmt: skip
    return unified, optional(mask, unified), torch.view_as_real(rope), adaln


def run_block(model: ZImageTransformer2DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    from tuner.archs.stages import call_block, given

    unified, mask, rope, adaln = carried
    unified = call_block(
        model, block, unified, given(mask), torch.view_as_complex(rope), adaln, None, None, None
    )
    return unified, mask, rope, adaln


def project_out(model: ZImageTransformer2DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last layer: the final layer, each sample's image unpatchified, negated (the
    velocity)."""
    unified, adaln = carried[0], carried[-1]
    out = model.all_final_layer[EMBEDDER](unified, c=adaln)
    sizes = [(1, *noisy.shape[-2:])] * noisy.shape[0]
    return -torch.stack(model.unpatchify(list(out.unbind(0)), sizes, PATCH, FRAME_PATCH)).squeeze(2)
