"""FLUX.2 (dev, klein): loading its three models and turning captions and images into model inputs.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder, or BFL's / ComfyUI's single file (`flux2-dev.safetensors`,
  `flux2_dev_fp8mixed.safetensors`: `double_blocks.0.img_attn.qkv.weight`, `single_blocks.0.linear1`,
  `double_stream_modulation_img.lin.weight`, ...; with or without `model.diffusion_model.`; fp8 files are
  dequantized), converted by `flux2_keys` at any size. The variant (dev, klein 4B / 9B) is read from the
  tensor shapes (a diffusers folder's from `guidance_embeds`): a klein file given to `flux2` names
  `flux2_klein` and a dev file given to `flux2_klein` names `flux2` (their text encoders differ), and a
  FLUX.1 file is refused naming `flux`;
* VAE: a diffusers folder (`AutoencoderKLFlux2`), or BFL's `ae.safetensors` / ComfyUI's
  `flux2-vae.safetensors` (the LDM layout with `encoder.quant_conv`, `decoder.post_quant_conv`, `bn.*`);
* text encoders (Mistral-Small for dev, Qwen3 for klein): see `tuner.archs.flux2.text`.

Model inputs are what Flux2Pipeline / Flux2KleinPipeline compute (text: `flux2_text`). Latents: the
VAE's mode [32, H/8, W/8], patchified 2×2 into [128, H/16, W/16] and normalized by the VAE's BatchNorm running statistics; every latent pixel is then one token, with position ids
(t, row, col, 0): t = 0 for the target, 10, 20, ... for reference images (multi-reference editing,
appended after the target's tokens). Text tokens have ids (0, 0, 0, l). The timestep is t ∈ [0, 1] (the
model scales it); dev's guidance embedding gets `model.guidance` (klein has none).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.flux2.keys import (
    transformer_key_to_original,
    transformer_to_diffusers,
    vae_key_to_original,
    vae_to_diffusers,
)
from tuner.errors import CheckpointError
from tuner.models.component import component_spec, diffusers_class, diffusers_keys, load_component, vae_levels
from tuner.models.identify import CHROMA_MARKER, SingleFileSpec, Variant, identify_single_file, variant_table
from tuner.models.loading import (
    from_state_dict,
    load_diffusers_folder,
    load_tensors,
    normalize_shapes,
    normalize_state_dict,
    read_tensor_shapes,
    resolve_folder,
)

if TYPE_CHECKING:
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

CONFIGS = Path(__file__).parent / "configs"
REFERENCE_T_STEP = 10  # reference image i has position t = 10 · (i + 1)

# ---------------------------------------------------------------------------------------------------
# Known variants (original-layout names; None: the tensor must be absent, pinning the block count)
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("img_in.weight", "txt_in.weight", "guidance_in.in_layer.weight",
     "double_blocks.{}.img_attn.qkv.weight", "single_blocks.{}.linear2.weight"),
    {
        "dev": ((6144, 128), (6144, 15360), (6144, 256), (8, (18432, 6144)), (48, (6144, 24576))),
        "klein-4b": ((3072, 128), (3072, 7680), None, (5, (9216, 3072)), (20, (3072, 12288))),
        "klein-9b": ((4096, 128), (4096, 12288), None, (8, (12288, 4096)), (24, (4096, 16384))),
        # the test fixture (tuner.archs.flux2.fixture): 2 heads of 32, one block of each kind
        "tiny": ((64, 128), (64, 96), (64, 256), (1, (192, 64)), (1, (64, 256))),
        # the klein fixture: the tiny network without the guidance embedding
        "tiny-klein": ((64, 128), (64, 96), None, (1, (192, 64)), (1, (64, 256))),
    },
)  # fmt: skip
KLEIN_VARIANTS = ("klein-4b", "klein-9b", "tiny-klein")

VAE_VARIANTS = variant_table(
    CONFIGS / "vae",
    ("encoder.conv_in.weight", "encoder.conv_out.weight", "decoder.conv_in.weight", "bn.running_mean"),
    {
        "flux2": ((128, 3, 3, 3), (64, 512, 3, 3), (512, 32, 3, 3), (128,)),
        "tiny": ((32, 3, 3, 3), (64, 64, 3, 3), (64, 32, 3, 3), (128,)),
    },
)  # fmt: skip

_ORIGINAL_MARKERS = ("double_stream_modulation_img.lin.weight", "img_in.weight")
FLUX1_MARKER = "double_blocks.0.img_mod.lin.weight"  # FLUX.1 modulates per block; FLUX.2 per kind of block
_ORIGINAL_VAE_MARKERS = ("encoder.down.0.block.0.conv1.weight", "bn.running_mean")


def _vae_keys(variant: Variant) -> list[str]:
    levels = vae_levels("AutoencoderKLFlux2", variant)
    return [
        vae_key_to_original(k, levels)
        for k in diffusers_keys("AutoencoderKLFlux2")(variant)
        if k != _BN_COUNTER
    ]


_BN_COUNTER = "bn.num_batches_tracked"  # a BatchNorm training counter; released files may lack it

_DIFFUSERS_MARKERS = ("double_stream_modulation_img.linear.weight", "x_embedder.weight")
TRANSFORMER_SPEC = component_spec(
    "FLUX.2 transformer", "Flux2Transformer2DModel", TRANSFORMER_VARIANTS,
    _ORIGINAL_MARKERS, _DIFFUSERS_MARKERS, transformer_key_to_original)  # fmt: skip
VAE_SPEC = SingleFileSpec(
    what="FLUX.2 VAE",
    variants=VAE_VARIANTS,
    expected_keys=_vae_keys,
    original_markers=_ORIGINAL_VAE_MARKERS,
    diffusers_markers=("encoder.down_blocks.0.resnets.0.conv1.weight", "bn.running_mean"),
    to_original=vae_key_to_original,  # both known variants have 4 levels
    # BatchNorm's step counter: some files store it, some do not; identification ignores it
    aliases={_BN_COUNTER: "bn.running_mean"},
)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_transformer(path: str | Path, dtype: torch.dtype, klein: bool = False) -> Flux2Transformer2DModel:
    """Load the FLUX.2 dev (or, with `klein`, klein) transformer from a diffusers folder or a single file
    (either layout), in eval mode. A file of the other family is refused naming its architecture."""
    from diffusers import Flux2Transformer2DModel

    folder = resolve_folder(path, "transformer")
    if folder is not None:
        model = load_diffusers_folder(Flux2Transformer2DModel, folder, dtype, "Flux2Transformer2DModel")
        _check_family(path, not model.config.guidance_embeds, klein)
        return model
    shapes = normalize_shapes(read_tensor_shapes(path))
    if FLUX1_MARKER in shapes:
        raise CheckpointError(
            f"{path}: a FLUX.1 transformer (per-block modulation `double_blocks.0.img_mod`), not FLUX.2. "
            'Set model.architecture = "flux" (or "flux_kontext") to train it.'
        )
    if CHROMA_MARKER in shapes:
        raise CheckpointError(
            f'{path}: a Chroma transformer (it has distilled_guidance_layer), not FLUX.2. Set model.architecture = "chroma".'
        )
    _check_family(path, identify_single_file(path, TRANSFORMER_SPEC).name in KLEIN_VARIANTS, klein)
    return load_component(path, dtype, "Flux2Transformer2DModel", "transformer", TRANSFORMER_SPEC,
                          lambda sd, _: transformer_to_diffusers(sd))  # fmt: skip


def _check_family(path: str | Path, is_klein: bool, klein: bool) -> None:
    """dev and klein share the network but not the text encoder (Mistral-Small / Qwen3)."""
    if is_klein and not klein:
        raise CheckpointError(
            f"{path}: a FLUX.2 klein transformer (no guidance embedding), which conditions on Qwen3. "
            'Set model.architecture = "flux2_klein" (with its Qwen3 text encoder) to train it.'
        )
    if klein and not is_klein:
        raise CheckpointError(
            f"{path}: a FLUX.2 dev transformer (with a guidance embedding), which conditions on Mistral-Small. "
            'Set model.architecture = "flux2" to train it.'
        )


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKLFlux2:
    """Load the FLUX.2 VAE from a diffusers folder or a single file, in eval mode."""
    if resolve_folder(path, "vae") is not None:
        return load_component(path, dtype, "AutoencoderKLFlux2", "vae", VAE_SPEC)
    variant = identify_single_file(path, VAE_SPEC)
    state_dict = normalize_state_dict(load_tensors(path), dtype)
    if all(k in state_dict for k in _ORIGINAL_VAE_MARKERS):
        state_dict = vae_to_diffusers(state_dict, vae_levels("AutoencoderKLFlux2", variant))
    state_dict.setdefault(_BN_COUNTER, torch.tensor(0))  # in either layout
    return from_state_dict(
        diffusers_class("AutoencoderKLFlux2"), state_dict, variant.config_dir, dtype, Path(path)
    )


# ---------------------------------------------------------------------------------------------------
# Inputs for the transformer
# ---------------------------------------------------------------------------------------------------


def _bn_stats(vae: AutoencoderKLFlux2, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
        like.device, like.dtype
    )
    return mean, std


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, C · 4, H/2, W/2], features channel-major (c, dy, dx)."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return patches.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify`."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return patches.reshape(b, c // 4, h * 2, w * 2)


@torch.no_grad()
def encode_images(vae: AutoencoderKLFlux2, pixels: torch.Tensor, patch=patchify) -> torch.Tensor:
    """Normalized latents [B, 128, H/16, W/16] of images [B, 3, H, W] in [-1, 1], as Flux2Pipeline encodes
    reference images: the distribution's mode, patchified (by `patch`: Ideogram 4 orders a token's values
    otherwise), minus the BatchNorm mean over its std."""
    if pixels.shape[-1] % 16 or pixels.shape[-2] % 16:
        raise ValueError(f"the FLUX.2 VAE needs sides divisible by 16, got {tuple(pixels.shape)}")
    param = next(vae.parameters())
    latents = patch(vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode())
    mean, std = _bn_stats(vae, latents)
    return (latents - mean) / std


@torch.no_grad()
def decode_latents(vae: AutoencoderKLFlux2, latents: torch.Tensor, unpatch=unpatchify) -> torch.Tensor:
    """Images [B, 3, H, W] in about [-1, 1] from normalized latents (the inverse of `encode_images`)."""
    param = next(vae.parameters())
    latents = latents.to(param.device, param.dtype)
    mean, std = _bn_stats(vae, latents)
    return vae.decode(unpatch(latents * std + mean)).sample


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H · W, C]: one token per latent pixel, rows first."""
    return latents.flatten(2).transpose(1, 2)


def image_ids(height: int, width: int, t: int = 0, device: torch.device | None = None) -> torch.Tensor:
    """Position ids [H · W, 4] of a [.., height, width] latent's tokens: (t, row, col, 0)."""
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    return torch.stack([torch.full_like(rows, t), rows, cols, torch.zeros_like(rows)], dim=1)


def text_ids(length: int, device: torch.device | None = None) -> torch.Tensor:
    """Position ids [length, 4] of the text tokens: (0, 0, 0, l)."""
    ids = torch.zeros(length, 4, dtype=torch.long, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


def model_inputs(
    model: Flux2Transformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    prompt_embeds: torch.Tensor,
    guidance: float,
    references: Sequence[torch.Tensor] = (),
) -> dict[str, torch.Tensor]:
    """The transformer's keyword arguments for latents `noisy` [B, 128, H, W] at t ∈ [0, 1].

    `references` are reference latents [B, 128, H', W'] (multi-reference editing): their tokens follow
    the target's, with position t = 10, 20, ..., and their outputs are dropped (`velocity`). The model's velocity is
    `velocity(model(**model_inputs(...), return_dict=False)[0], noisy)`.
    """
    b, _, h, w = noisy.shape
    tokens, ids = [pack(noisy)], [image_ids(h, w, 0, noisy.device)]
    for i, ref in enumerate(references):
        tokens.append(pack(ref.to(noisy.dtype)))
        ids.append(image_ids(ref.shape[-2], ref.shape[-1], REFERENCE_T_STEP * (i + 1), noisy.device))
    embedded_guidance = None
    if model.config.guidance_embeds:
        embedded_guidance = torch.full((b,), guidance, device=noisy.device, dtype=torch.float32)
    return {
        "hidden_states": torch.cat(tokens, dim=1),
        "timestep": t,
        "guidance": embedded_guidance,
        "encoder_hidden_states": prompt_embeds.to(noisy.dtype),
        "txt_ids": text_ids(prompt_embeds.shape[1], noisy.device).expand(b, -1, -1),
        "img_ids": torch.cat(ids).expand(b, -1, -1),
    }


def velocity(out: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """The output tokens → the target's velocity (the references' tokens dropped)."""
    b, _, h, w = noisy.shape
    return out[:, : h * w].transpose(1, 2).reshape(b, -1, h, w)


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# Flux2Transformer2DModel.forward without its KV cache (generation's reference reuse, never in training);
# the contract suite checks the parts against the whole forward.


def embed(model: Flux2Transformer2DModel, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block: (image tokens, text tokens, the dual-stream blocks' image and
    text modulation, the single-stream blocks' modulation, rotary cos, rotary sin (text then image), the
    conditioning embedding)."""
    hidden = model.x_embedder(inputs["hidden_states"])
    guidance = inputs["guidance"]
    guidance = None if guidance is None else guidance.to(inputs["hidden_states"].dtype) * 1000
    temb = model.time_guidance_embed(inputs["timestep"].to(inputs["hidden_states"].dtype) * 1000, guidance)
    modulations = (model.double_stream_modulation_img(temb), model.double_stream_modulation_txt(temb),
                   model.single_stream_modulation(temb))  # fmt: skip
    text = model.context_embedder(inputs["encoder_hidden_states"])
    text_rope, image_rope = model.pos_embed(inputs["txt_ids"][0]), model.pos_embed(inputs["img_ids"][0])
    cos, sin = (torch.cat([a, b], dim=0) for a, b in zip(text_rope, image_rope, strict=True))
    return hidden, text, *modulations, cos, sin, temb


def run_block(model: Flux2Transformer2DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    """One dual-stream block, or one single-stream block on the text then image tokens joined (split again
    after it: the next joins them as they were)."""
    from diffusers.models.transformers.transformer_flux2 import Flux2TransformerBlock

    from tuner.archs.stages import call_block

    hidden, text, image_mod, text_mod, single_mod, cos, sin, temb = carried
    if isinstance(block, Flux2TransformerBlock):
        text, hidden = call_block(model, block, hidden, text, image_mod, text_mod, (cos, sin), None)
    else:
        joined = call_block(
            model, block, torch.cat([text, hidden], dim=1), None, single_mod, (cos, sin), None
        )
        text, hidden = joined[:, : text.shape[1]], joined[:, text.shape[1] :]
    return hidden, text, image_mod, text_mod, single_mod, cos, sin, temb


def project_out(model: Flux2Transformer2DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last block: output norm, projection, the target's velocity."""
    hidden, temb = carried[0], carried[-1]
    return velocity(model.proj_out(model.norm_out(hidden, temb)), noisy)
