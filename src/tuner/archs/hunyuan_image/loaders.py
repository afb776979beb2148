"""HunyuanImage 2.1 (base, distilled): loading the transformer and VAE, and calling the transformer as
HunyuanImagePipeline does. The text encoders are `tuner.archs.hunyuan_image.text`'s.

* transformer (diffusers' `HunyuanImageTransformer2DModel`, 17B: 20 double + 40 single blocks of 3584):
  a diffusers folder (`hunyuanvideo-community/HunyuanImage-2.1-Diffusers`, `...-Distilled-Diffusers`), or
  the release's / ComfyUI's single file (`dit/hunyuanimage2.1.safetensors`,
  `hunyuanimage2.1_bf16.safetensors`, `hunyuanimage2.1_distilled_*`: HunyuanVideo 1.0's names and fused
  q/k/v, `tuner.archs.hunyuan_image.keys`; with or without `model.diffusion_model.`; fp8 dequantized), or
  the network saved in diffusers' names. The distilled model is told apart by its tensors: a guidance
  embedder (`guidance_in`) and MeanFlow's second time embedder (`time_r_in`). The refiner (a 3D-patch
  network of width 3328, `img_in` a Conv3d) and HunyuanVideo 1.0 / 1.5 files are refused by name;
* VAE (`AutoencoderKLHunyuanImage`: 64 channels, 32× smaller, scaling factor 0.75289, no shift): a
  diffusers folder, a single file in diffusers' names, or in Tencent's (`encoder.down.0.block.0.conv1`,
  `decoder.up.0.upsample`, `mid.attn_1.proj_out`: the names diffusers'
  `scripts/convert_hunyuan_image_to_diffusers.py` reads), whose per-level blocks diffusers numbers in
  one flat list (`_vae_renames`).

Calling the model (`predict_velocity`): latents [B, 64, H/32, W/32] (z · 0.75289), the timestep t × 1000
in the latents' dtype, the Qwen states and ByT5 glyph states with their masks. The distilled model is
also given its embedded guidance (the pipeline's `distilled_guidance_scale` 3.25, × 1000) and MeanFlow's
interval end r (the pipeline's next timestep: `t_next` in `cond`, else r = t, the instantaneous velocity).
It predicts the velocity noise − x0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.hunyuan_image.keys import HUNYUAN_IMAGE_LAYOUT
from tuner.errors import CheckpointError
from tuner.models.component import component_spec, diffusers_keys, load_component
from tuner.models.identify import SingleFileSpec, Variant, variant_table
from tuner.models.loading import normalize_shapes, read_folder_config, read_tensor_shapes, resolve_folder

if TYPE_CHECKING:
    from diffusers import AutoencoderKLHunyuanImage, HunyuanImageTransformer2DModel

CONFIGS = Path(__file__).parent / "configs"
VAE_FACTOR = 32
LATENT_CHANNELS = 64
DISTILLED_GUIDANCE = 3.25  # HunyuanImagePipeline's default `distilled_guidance_scale`

TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("img_in.proj.weight", "txt_in.input_embedder.weight", "byt5_in.fc1.weight", "guidance_in.mlp.0.weight",
     "time_r_in.mlp.0.weight", "double_blocks.{}.img_mod.linear.weight", "single_blocks.{}.linear2.weight"),
    {
        # 17B: 20 double + 40 single blocks of 3584 (28 heads of 128); distilled: + guidance and MeanFlow r
        "base": ((3584, 64, 1, 1), (3584, 3584), (2048, 1472), None, None, (20, (21504, 3584)),
                 (40, (3584, 17920))),
        "distilled": ((3584, 64, 1, 1), (3584, 3584), (2048, 1472), (3584, 256), (3584, 256),
                      (20, (21504, 3584)), (40, (3584, 17920))),
        # the test fixtures (tuner.archs.hunyuan_image.fixture): 2 heads of 32, one block of each kind
        "tiny": ((64, 64, 1, 1), (64, 64), (2048, 64), None, None, (1, (384, 64)), (1, (64, 320))),
        "tiny_distilled": ((64, 64, 1, 1), (64, 64), (2048, 64), (64, 256), (64, 256), (1, (384, 64)),
                           (1, (64, 320))),
    },
)  # fmt: skip


def _refuse_other_networks(shapes: Mapping[str, tuple[int, ...]], path: Path) -> None:
    """The refiner and HunyuanVideo 1.0 / 1.5 share block names with HunyuanImage 2.1."""
    img_in = shapes.get("img_in.proj.weight") or shapes.get("x_embedder.proj.weight") or ()
    if len(img_in) == 5 and "byt5_in.fc1.weight" not in shapes and "vector_in.in_layer.weight" not in shapes:
        _refuse_refiner(path)
    if "vector_in.in_layer.weight" in shapes or "vision_in.proj.0.weight" in shapes:
        other = "hunyuan_video" if "vector_in.in_layer.weight" in shapes else "hunyuan_video15"
        raise CheckpointError(
            f"{path}: a HunyuanVideo transformer, another network than HunyuanImage 2.1's. Set "
            f'model.architecture = "{other}" to train it.'
        )


def _refuse_refiner(path: str | Path) -> None:
    raise CheckpointError(
        f"{path}: the HunyuanImage 2.1 refiner (a 3D-patch network without the ByT5 mapper), which tuner "
        "does not train. Point model.transformer at the base (hunyuanimage2.1_bf16.safetensors) or "
        "distilled model."
    )


def refuse_hunyuan_image(shapes: Mapping[str, tuple[int, ...]], path: str | Path) -> None:
    """Raise naming `hunyuan_image` for a HunyuanImage 2.1 transformer file (the ByT5 mapper beside single
    blocks, in either naming): HunyuanVideo 1.0's and 1.5's loaders call it, their block names being its."""
    byt5 = "byt5_in.fc1.weight" in shapes or "context_embedder_2.linear_1.weight" in shapes
    if byt5 and any(k.startswith(("single_blocks.", "single_transformer_blocks.")) for k in shapes):
        raise CheckpointError(
            f"{path}: a HunyuanImage 2.1 transformer (a ByT5 mapper and single-stream blocks), another network. "
            'Set model.architecture = "hunyuan_image" to train it.'
        )


TRANSFORMER_SPEC = component_spec(
    "HunyuanImage 2.1 transformer",
    "HunyuanImageTransformer2DModel",
    TRANSFORMER_VARIANTS,
    ("double_blocks.0.img_attn_qkv.weight", "byt5_in.fc1.weight"),
    ("transformer_blocks.0.attn.to_q.weight", "context_embedder_2.linear_1.weight"),
    HUNYUAN_IMAGE_LAYOUT.key_to_original,
    refuse=_refuse_other_networks,
)


def is_distilled(path: str | Path) -> bool:
    """Whether a transformer file or folder is the distilled model: its guidance embedder, in the file's
    header or the folder's config (no weights read)."""
    folder = resolve_folder(path, "transformer")
    if folder is not None:
        return bool(read_folder_config(folder).get("guidance_embeds"))
    names = normalize_shapes(read_tensor_shapes(path))
    return any(
        k in names
        for k in ("guidance_in.mlp.0.weight", "time_guidance_embed.guidance_embedder.linear_1.weight")
    )


def load_transformer(path: str | Path, dtype: torch.dtype) -> HunyuanImageTransformer2DModel:
    """The HunyuanImage 2.1 transformer (base or distilled) from a diffusers folder or a single file, in
    eval mode. The refiner's folder (the same class, a 3D patch) is refused by name."""
    folder = resolve_folder(path, "transformer")
    if folder is not None and len(read_folder_config(folder).get("patch_size", ())) == 3:
        _refuse_refiner(folder)
    return load_component(
        path,
        dtype,
        "HunyuanImageTransformer2DModel",
        "transformer",
        TRANSFORMER_SPEC,
        lambda state_dict, _: HUNYUAN_IMAGE_LAYOUT.to_diffusers(state_dict),
    )


# ---------------------------------------------------------------------------------------------------
# The VAE
# ---------------------------------------------------------------------------------------------------
VAE_VARIANTS = variant_table(
    CONFIGS / "vae",
    ("encoder.conv_in.weight", "decoder.conv_in.weight", "encoder.conv_out.weight"),
    {
        "hunyuan_image_2.1": ((128, 3, 3, 3), (1024, 64, 3, 3), (128, 1024, 3, 3)),
        "tiny": ((32, 3, 3, 3), (128, 64, 3, 3), (128, 128, 3, 3)),  # 32× and 64 channels, narrow
    },
)
_VAE_MID = (("mid.block_1.", "mid_block.resnets.0."), ("mid.block_2.", "mid_block.resnets.1."),
            *((f"mid.attn_1.{p}.", f"mid_block.attentions.0.to_{p}.") for p in "qkv"),
            ("mid.attn_1.proj_out.", "mid_block.attentions.0.proj."), ("mid.attn_1.norm.", "mid_block.attentions.0.norm."))  # fmt: skip


def _vae_renames(variant: Variant) -> tuple[tuple[str, str], ...]:
    """(Tencent's prefix, diffusers') of every block of a VAE variant: diffusers numbers the resnets and
    resamplers of all levels in one list (`down_blocks.N`), Tencent per level (`down.i.block.r`,
    `down.i.downsample`); levels below log2(32) but the last resample (as both models build them)."""
    config = json.loads((variant.config_dir / "config.json").read_text())
    levels, per_level = len(config["block_out_channels"]), config["layers_per_block"]
    resampled = [
        i < math.log2(config["spatial_compression_ratio"]) and i != levels - 1 for i in range(levels)
    ]
    renames = []
    for side, blocks, resample, resnets in (("encoder", "down", "downsample", per_level),
                                            ("decoder", "up", "upsample", per_level + 1)):  # fmt: skip
        n = 0
        for i in range(levels):
            for r in range(resnets):
                renames.append((f"{side}.{blocks}.{i}.block.{r}.", f"{side}.{blocks}_blocks.{n}."))
                n += 1
            if resampled[i]:
                renames.append((f"{side}.{blocks}.{i}.{resample}.", f"{side}.{blocks}_blocks.{n}."))
                n += 1
        renames += [(f"{side}.{o}", f"{side}.{d}") for o, d in _VAE_MID]
    return tuple(renames)


def _rename(key: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def _vae_keys(variant: Variant) -> set[str]:
    back = tuple((d, o) for o, d in _vae_renames(variant))
    return {_rename(k, back) for k in diffusers_keys("AutoencoderKLHunyuanImage")(variant)}


def _vae_to_diffusers(state_dict: dict[str, torch.Tensor], variant: Variant) -> dict[str, torch.Tensor]:
    renames = _vae_renames(variant)
    return {_rename(k, renames): v for k, v in state_dict.items()}


VAE_SPEC = SingleFileSpec(
    what="HunyuanImage 2.1 VAE (Tencent's names)",
    variants=VAE_VARIANTS,
    expected_keys=_vae_keys,
    original_markers=("encoder.down.0.block.0.conv1.weight", "decoder.mid.attn_1.proj_out.weight"),
)
_DIFFUSERS_VAE_MARKERS = ("encoder.down_blocks.0.conv1.weight", "decoder.mid_block.attentions.0.proj.weight")
DIFFUSERS_VAE_SPEC = SingleFileSpec(
    what="HunyuanImage 2.1 VAE (diffusers' names)",
    variants=VAE_VARIANTS,
    expected_keys=diffusers_keys("AutoencoderKLHunyuanImage"),
    original_markers=_DIFFUSERS_VAE_MARKERS,
)
"""A single file saved in diffusers' names (the flat block numbering depends on the variant, so the two
namings are two specs rather than one with a key map)."""


def vae_to_original(state_dict: Mapping[str, torch.Tensor], variant: str = "tiny") -> dict[str, torch.Tensor]:
    """A diffusers VAE state dict in Tencent's names (the fixture writes its single file so)."""
    found = next(v for v in VAE_VARIANTS if v.name == variant)
    back = tuple((d, o) for o, d in _vae_renames(found))
    return {_rename(k, back): v for k, v in state_dict.items()}


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKLHunyuanImage:
    """The VAE from a diffusers folder or a single file (Tencent's or diffusers' names), in eval mode. The
    refiner's 3D VAE (5-D convolutions) is refused by name."""
    shapes = normalize_shapes(read_tensor_shapes(path)) if Path(path).is_file() else {}
    if any(len(shape) == 5 for name, shape in shapes.items() if name.startswith(("encoder.", "decoder."))):
        raise CheckpointError(
            f"{path}: the HunyuanImage 2.1 refiner's 3D VAE (AutoencoderKLHunyuanImageRefiner), which tuner "
            "does not use. Point model.vae at the base model's VAE (hunyuan_image_2.1_vae_fp16.safetensors)."
        )
    if shapes and all(k in shapes for k in _DIFFUSERS_VAE_MARKERS):
        return load_component(path, dtype, "AutoencoderKLHunyuanImage", "vae", DIFFUSERS_VAE_SPEC)
    return load_component(path, dtype, "AutoencoderKLHunyuanImage", "vae", VAE_SPEC, _vae_to_diffusers)


@torch.no_grad()
def encode_images(vae: AutoencoderKLHunyuanImage, pixels: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, 64, H/32, W/32] of images [B, 3, H, W] in [-1, 1]: the distribution's mode
    times the scaling factor (no shift)."""
    height, width = pixels.shape[-2:]
    if height % VAE_FACTOR or width % VAE_FACTOR:
        raise ValueError(f"the HunyuanImage 2.1 VAE needs sides divisible by 32, got {tuple(pixels.shape)}")
    param = next(vae.parameters())
    latents = vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode()
    return latents * vae.config.scaling_factor


@torch.no_grad()
def decode_latents(vae: AutoencoderKLHunyuanImage, latents: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in about [-1, 1] from normalized latents, as the pipeline decodes."""
    param = next(vae.parameters())
    return vae.decode(latents.to(param.device, param.dtype) / vae.config.scaling_factor).sample


# ---------------------------------------------------------------------------------------------------
# Calling the transformer
# ---------------------------------------------------------------------------------------------------


def model_inputs(model: HunyuanImageTransformer2DModel, noisy: torch.Tensor, t: torch.Tensor,
                 cond: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # fmt: skip
    """The transformer's keyword arguments for latents `noisy` [B, 64, h, w] at t ∈ [0, 1], given collated
    text (`text`, `mask`, `glyph`, `glyph_mask`). The distilled (MeanFlow) model is also given the end r of
    the interval it steps: `t_next` in generation (the record's `flow_next_time`, as HunyuanImagePipeline
    passes the next step's time), else r = t (training: the instantaneous velocity)."""
    dtype = noisy.dtype
    # the scheduler's timestep in the latents' dtype, as the pipeline's
    timestep = (t.float() * 1000).to(dtype)
    inputs = {
        "hidden_states": noisy,
        "timestep": timestep,
        "encoder_hidden_states": cond["text"].to(dtype),
        "encoder_attention_mask": cond["mask"],
        "encoder_hidden_states_2": cond["glyph"].to(dtype),
        "encoder_attention_mask_2": cond["glyph_mask"],
        "guidance": None,
        "timestep_r": None,
    }
    if model.config.guidance_embeds:
        inputs["guidance"] = torch.full_like(timestep, DISTILLED_GUIDANCE * 1000.0)
    if model.config.use_meanflow:
        inputs["timestep_r"] = (cond.get("t_next", t).float() * 1000).to(dtype)
    return inputs


def predict_velocity(model: HunyuanImageTransformer2DModel, noisy: torch.Tensor, t: torch.Tensor,
                     cond: Mapping[str, torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """The velocity (shape of `noisy`) on `model_inputs`."""
    return model(**model_inputs(model, noisy, t, cond), return_dict=False)[0]


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# HunyuanImageTransformer2DModel.forward on 2D latents; the contract suite checks the parts against the
# whole forward.


def embed(model: HunyuanImageTransformer2DModel, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block: (image tokens, text tokens, conditioning embedding, the joint
    attention mask [B, 1, 1, N], rotary cos and sin). With the glyph (ByT5) encoder, each sample's text is
    its valid glyph rows, its valid prompt rows, then the padding of each, the mask reordered alike."""
    latents, timestep = inputs["hidden_states"], inputs["timestep"]
    cos, sin = model.rope(latents)
    mask = inputs["encoder_attention_mask"].bool()
    temb = model.time_guidance_embed(timestep, guidance=inputs["guidance"], timestep_r=inputs["timestep_r"])
    hidden = model.x_embedder(latents)
    text = model.context_embedder(inputs["encoder_hidden_states"], timestep, mask)
    if model.context_embedder_2 is not None:
        glyph, glyph_mask = (
            model.context_embedder_2(inputs["encoder_hidden_states_2"]),
            inputs["encoder_attention_mask_2"].bool(),
        )
        rows = [(torch.cat([g[gm], x[m], g[~gm], x[~m]]), torch.cat([gm[gm], m[m], gm[~gm], m[~m]]))
                for x, m, g, gm in zip(text, mask, glyph, glyph_mask, strict=True)]  # fmt: skip
        text, mask = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    joint = torch.nn.functional.pad(mask, (hidden.shape[1], 0), value=True)[:, None, None]
    return hidden, text, temb, joint, cos, sin


def run_block(model: HunyuanImageTransformer2DModel, block: torch.nn.Module, carried: tuple) -> tuple:
    """One dual- or single-stream block (both take and return the two streams)."""
    from tuner.archs.stages import call_block

    hidden, text, temb, mask, cos, sin = carried
    hidden, text = call_block(model, block, hidden, text, temb, mask, (cos, sin))
    return hidden, text, temb, mask, cos, sin


def project_out(model: HunyuanImageTransformer2DModel, carried: tuple, noisy: torch.Tensor) -> torch.Tensor:
    """The forward after its last block: output norm, projection, unpatchify to `noisy`'s shape (each
    token's values are channel, then row and column within its patch)."""
    hidden, _, temb = carried[:3]
    tokens = model.proj_out(model.norm_out(hidden, temb))
    p_h, p_w = model.config.patch_size
    b, _, height, width = noisy.shape
    grid = tokens.reshape(b, height // p_h, width // p_w, -1, p_h, p_w)
    return grid.permute(0, 3, 1, 4, 2, 5).reshape(b, -1, height, width)
