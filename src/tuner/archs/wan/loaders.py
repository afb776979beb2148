"""Wan 2.1 text-to-video: loading its three models and turning captions and videos into model inputs.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder (`.../transformer` or the pipeline root), the official single file
  (`blocks.0.self_attn.q.weight`, `head.modulation`, ...; with or without ComfyUI's
  `model.diffusion_model.` prefix; ComfyUI's scaled-fp8 files are dequantized), or the official release
  folder (`config.json` of class `WanModel` next to `diffusion_pytorch_model*.safetensors` shards);
* VAE: a diffusers folder, or the original single file (`Wan2.1_VAE.pth`, ComfyUI's
  `wan_2.1_vae.safetensors`); TI2V-5B's 48-channel Wan 2.2 VAE is in `tuner.archs.wan.wan22_vae`, and a
  VAE of the wrong generation is refused by name;
* text encoder: a diffusers folder, or ComfyUI's `umt5_xxl_*.safetensors`, which is the transformers
  T5 encoder layout (`shared.weight`, `encoder.block.0.layer.0.SelfAttention.q.weight`, ...) minus the
  tied `encoder.embed_tokens.weight`. A single file carries no tokenizer: pass `tokenizer_path`.

Single files are recognised from tensor shapes (`tuner.models.identify`; the configs ship in
`configs/wan/`), and so are diffusers folders (from their config). Each variant belongs to the
architectures that train it (`VARIANT_ARCHITECTURES`); a file of another one is refused with the
architecture to use. Wan 2.2 T2V A14B experts have exactly the Wan 2.1 T2V 14B network, so their shapes
cannot tell them apart (nor the high-noise expert from the low-noise one); the Wan 2.2 I2V A14B experts
(36 input channels, no CLIP image layers) and TI2V-5B (48 channels) are told apart from Wan 2.1 I2V. Not supported: the official Wan T5 file
(`models_t5_umt5-xxl-enc-bf16.pth`, Wan's own module names) and sharded single files without a folder.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.wan.keys import (
    diffusers_module_name,
    original_module_name,
    transformer_to_original,
    vae_key_to_original,
    vae_to_original,
)
from tuner.errors import CheckpointError
from tuner.models.component import component_spec, diffusers_keys, load_component
from tuner.models.encoders import T5_COLUMNS, load_encoder, model_keys
from tuner.models.identify import UNCHECKED, SingleFileSpec, Variant, identify_single_file, variant_table
from tuner.models.loading import (
    load_diffusers_folder,
    load_diffusers_single_file,
    load_tensors_of,
    load_tokenizer,
    normalize_state_dict,
    read_folder_config,
    resolve_folder,
)

# diffusers and transformers are imported where a model is built: importing them costs seconds (every
# diffusers model class, torch._dynamo), which a command that loads no model should not pay.
if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import PreTrainedTokenizerBase, UMT5EncoderModel

__all__ = [
    "TRANSFORMER_VARIANTS",
    "VAE_VARIANTS",
    "TEXT_ENCODER_VARIANTS",
    "load_transformer",
    "load_vae",
    "load_text_encoder",
    "encode_prompts",
    "encode_video",
    "decode_latents",
    "original_module_name",
    "diffusers_module_name",
    "transformer_to_original",
    "vae_to_original",
]

CONFIGS = Path(__file__).parent / "configs"

# ---------------------------------------------------------------------------------------------------
# Known variants. Signatures use original-layout names; `None` means the tensor must be absent (it pins
# the number of blocks and tells text-to-video from image-to-video).
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = variant_table(
    CONFIGS / "transformer",
    ("patch_embedding.weight", "text_embedding.0.weight", "blocks.{}.ffn.0.weight",
     "blocks.0.cross_attn.k_img.weight", "img_emb.proj.1.weight", "img_emb.emb_pos",
     "vace_patch_embedding.weight", "vace_blocks.{}.after_proj.weight"),
    {
        "t2v-1.3B": ((1536, 16, 1, 2, 2), (1536, 4096), (30, (8960, 1536)), None, UNCHECKED, UNCHECKED, None, UNCHECKED),
        "t2v-14B": ((5120, 16, 1, 2, 2), (5120, 4096), (40, (13824, 5120)), None, UNCHECKED, UNCHECKED, None, UNCHECKED),
        # img_emb.emb_pos is present only in first-last-frame models
        "i2v-14B": ((5120, 36, 1, 2, 2), (5120, 4096), (40, (13824, 5120)), (5120, 5120), (1280, 1280), None, None, UNCHECKED),
        # Wan 2.1 FLF2V 14B: I2V's network plus a position embedding over the two frames' CLIP tokens
        "flf2v-14B": ((5120, 36, 1, 2, 2), UNCHECKED, (40, (13824, 5120)), (5120, 5120), UNCHECKED, (1, 514, 1280), None, UNCHECKED),
        # either Wan 2.2 I2V A14B expert: noise + conditioning latents + mask in, no CLIP image layers
        "i2v-A14B": ((5120, 36, 1, 2, 2), (5120, 4096), (40, (13824, 5120)), None, UNCHECKED, UNCHECKED, None, UNCHECKED),
        # Wan 2.2 TI2V-5B: the 48-channel latents of the Wan 2.2 VAE
        "ti2v-5B": ((3072, 48, 1, 2, 2), (3072, 4096), (30, (14336, 3072)), None, UNCHECKED, UNCHECKED, None, UNCHECKED),
        # the TI2V test fixture (tuner.archs.wan.fixture_ti2v): the tiny network on 48 channels
        "tiny-ti2v": ((64, 48, 1, 2, 2), (64, 64), (2, (128, 64)), None, UNCHECKED, UNCHECKED, None, UNCHECKED),
        # the test fixture (tuner.archs.wan.fixture): 2 heads of 32, 2 blocks
        "tiny": ((64, 16, 1, 2, 2), (64, 64), (2, (128, 64)), None, UNCHECKED, UNCHECKED, None, UNCHECKED),
        # the I2V test fixture: the tiny network with 36 input channels and the tiny CLIP's width 32
        "tiny-i2v": ((64, 36, 1, 2, 2), UNCHECKED, (2, (128, 64)), UNCHECKED, (32, 32), None, None, UNCHECKED),
        # the Wan 2.2 I2V A14B test fixture's experts: tiny-i2v without the CLIP image layers
        "tiny-i2v-A14B": ((64, 36, 1, 2, 2), UNCHECKED, (2, (128, 64)), None, UNCHECKED, UNCHECKED, None, UNCHECKED),
        # the FLF2V test fixture: tiny-i2v plus the position embedding of two frames' 17 tokens
        "tiny-flf2v": ((64, 36, 1, 2, 2), UNCHECKED, (2, (128, 64)), UNCHECKED, UNCHECKED, (1, 34, 32), None, UNCHECKED),
        # Wan 2.1 VACE: the T2V network plus the control branch (96 channels in: inactive + reactive
        # latents and the 8x8-packed mask), one VACE block every 2 (1.3B) or 5 (14B) blocks; ComfyUI's
        # comfy/model_detection.py also tells it by `vace_patch_embedding.weight` and counts `vace_blocks.N`
        "vace-1.3B": ((1536, 16, 1, 2, 2), (1536, 4096), (30, (8960, 1536)), None, UNCHECKED, UNCHECKED,
                      (1536, 96, 1, 2, 2), (15, (1536, 1536))),
        "vace-14B": ((5120, 16, 1, 2, 2), (5120, 4096), (40, (13824, 5120)), None, UNCHECKED, UNCHECKED,
                     (5120, 96, 1, 2, 2), (8, (5120, 5120))),
        # the VACE test fixture (tuner.archs.wan.fixture_vace): the tiny network with 2 VACE blocks
        "tiny-vace": ((64, 16, 1, 2, 2), (64, 64), (2, (128, 64)), None, UNCHECKED, UNCHECKED,
                      (64, 96, 1, 2, 2), (2, (64, 64))),
    },
)  # fmt: skip

# What each transformer variant is, and the architectures (`model.architecture`) that train it, first the
# one to suggest. Names that are not registered yet are suggested as "not supported yet".
VARIANT_ARCHITECTURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "t2v-1.3B": ("a Wan 2.1 T2V 1.3B transformer", ("wan",)),
    "t2v-14B": ("a Wan 2.1 T2V 14B transformer or a Wan 2.2 T2V A14B expert", ("wan", "wan22_t2v")),
    "i2v-14B": ("a Wan 2.1 I2V 14B transformer (480p or 720p)", ("wan_i2v", "wan_1f")),
    "flf2v-14B": ("a Wan 2.1 FLF2V 14B transformer (first-last-frame)", ("wan_flf2v",)),
    "i2v-A14B": ("a Wan 2.2 I2V A14B expert (image-to-video)", ("wan22_i2v",)),
    "ti2v-5B": ("a Wan 2.2 TI2V-5B transformer", ("wan22_ti2v",)),
    "tiny": ("the tiny test transformer", ("wan", "wan22_t2v")),
    "tiny-ti2v": ("the tiny TI2V test transformer", ("wan22_ti2v",)),
    "tiny-i2v": ("the tiny image-to-video test transformer", ("wan_i2v", "wan_1f")),
    "tiny-flf2v": ("the tiny first-last-frame test transformer", ("wan_flf2v",)),
    "tiny-i2v-A14B": ("the tiny Wan 2.2 I2V A14B test expert (image-to-video)", ("wan22_i2v",)),
    "vace-1.3B": ("a Wan 2.1 VACE 1.3B transformer (control videos)", ("wan_vace",)),
    "vace-14B": ("a Wan 2.1 VACE 14B transformer (control videos)", ("wan_vace",)),
    "tiny-vace": ("the tiny VACE test transformer", ("wan_vace",)),
}

VAE_VARIANTS = variant_table(
    CONFIGS / "vae",
    ("encoder.conv1.weight", "decoder.conv1.weight"),
    {"wan2.1": ((96, 3, 3, 3, 3), (384, 16, 3, 3, 3)), "tiny": ((16, 3, 3, 3, 3), (64, 16, 3, 3, 3))},
)

TEXT_ENCODER_VARIANTS = variant_table(
    CONFIGS / "text_encoder",
    T5_COLUMNS,
    {"umt5-xxl": ((256384, 4096), (24, (10240, 4096))), "tiny": ((512, 64), (2, (128, 64)))},
)


_ORIGINAL_MARKERS = ("head.modulation", "blocks.0.self_attn.q.weight")
_DIFFUSERS_MARKERS = ("scale_shift_table", "blocks.0.attn1.to_q.weight")
_VAE_MARKERS = ("encoder.conv1.weight", "decoder.conv1.weight", "encoder.middle.1.to_qkv.weight")
_VAE_DIFFUSERS_MARKERS = ("encoder.conv_in.weight", "decoder.conv_in.weight", "quant_conv.weight")

# The encoder's embedding is tied to `shared`; ComfyUI's files store only `shared.weight`.
_TIED_EMBEDDING = {"encoder.embed_tokens.weight": "shared.weight"}


def transformer_class_name(variant: Variant) -> str:
    """The diffusers class of a transformer variant: its config's (VACE's is WanVACETransformer3DModel)."""
    return read_folder_config(variant.config_dir)["_class_name"]


TRANSFORMER_SPEC = replace(
    component_spec("Wan 2.1 transformer", "WanTransformer3DModel", TRANSFORMER_VARIANTS, _ORIGINAL_MARKERS,
                   _DIFFUSERS_MARKERS, original_module_name),
    expected_keys=lambda v: diffusers_keys(transformer_class_name(v), original_module_name)(v),
)  # fmt: skip
VAE_SPEC = component_spec(
    "Wan 2.1 VAE", "AutoencoderKLWan", VAE_VARIANTS, _VAE_MARKERS, _VAE_DIFFUSERS_MARKERS, vae_key_to_original
)
TEXT_ENCODER_SPEC = SingleFileSpec(
    what="UMT5 text encoder",
    variants=TEXT_ENCODER_VARIANTS,
    expected_keys=model_keys("UMT5EncoderModel", leave_out=tuple(_TIED_EMBEDDING)),
    original_markers=("shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight"),
    aliases=_TIED_EMBEDDING,
)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_transformer(
    path: str | Path, dtype: torch.dtype, architecture: str = "wan", subfolder: str = "transformer"
) -> WanTransformer3DModel:
    """Load a Wan transformer (a WanTransformer3DModel, or for VACE a WanVACETransformer3DModel) from a
    diffusers folder (its `subfolder` when `path` is a pipeline root) or a single file, in eval mode. A
    variant that `architecture` does not train is refused, naming the one that does."""
    import diffusers

    folder = resolve_folder(path, subfolder)
    if folder is None:
        files = [Path(path)]
    elif read_folder_config(folder).get("_class_name") in _RELEASE_CLASSES:
        # The official release folder (Wan-AI/Wan2.1-T2V-*, Wan2.2-*/high_noise_model, Wan2.1-VACE-*):
        # original keys, sharded.
        files = sorted(folder.glob("diffusion_pytorch_model*.safetensors"))
    else:
        check_variant(folder_variant(folder), architecture, folder)
        name = read_folder_config(folder).get("_class_name", "WanTransformer3DModel")
        if name not in _DIFFUSERS_CLASSES:
            raise CheckpointError(
                f"{folder}: a {name}, not a Wan transformer ({' or '.join(_DIFFUSERS_CLASSES)})."
            )
        return load_diffusers_folder(getattr(diffusers, name), folder, dtype, name)
    variant = identify_single_file(files, TRANSFORMER_SPEC)
    where = files[0] if folder is None else folder
    check_variant(variant.name, architecture, where)
    state_dict = fill_converter_gaps(normalize_state_dict(load_tensors_of(files), dtype))
    model_class = getattr(diffusers, transformer_class_name(variant))
    return load_diffusers_single_file(model_class, state_dict, variant.config_dir, dtype, where)


# the release folders' config classes (the official code's) and the diffusers classes tuner loads
_RELEASE_CLASSES = ("WanModel", "VaceWanModel")
_DIFFUSERS_CLASSES = ("WanTransformer3DModel", "WanVACETransformer3DModel")


# diffusers 0.42's original -> diffusers Wan converter has no rule for FLF2V's `img_emb.emb_pos` (it would
# stay unexpected and `pos_embed` unloaded); renamed here, its other rules leave the diffusers name alone.
# tests/test_wan_i2v.py fails if the converter starts renaming it (or stops passing it through).
_UNCONVERTED = {"img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed"}


def fill_converter_gaps(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_UNCONVERTED.get(k, k): v for k, v in state_dict.items()}


# the config entries that tell the shipped variants apart
_VARIANT_KEYS = (
    "in_channels",
    "num_layers",
    "num_attention_heads",
    "attention_head_dim",
    "ffn_dim",
    "image_dim",
    "pos_embed_seq_len",
    "vace_layers",
)


def folder_variant(folder: Path) -> str | None:
    """The shipped transformer variant a diffusers folder's config describes, or None for another one."""
    config = read_folder_config(folder)
    for variant in TRANSFORMER_VARIANTS:
        shipped = read_folder_config(variant.config_dir)
        if all(config.get(k) == shipped.get(k) for k in _VARIANT_KEYS):
            return variant.name
    return None


def transformer_variant(path: str | Path, subfolder: str = "transformer") -> str | None:
    """The variant of a transformer checkpoint (file or folder), from headers or config only."""
    folder = resolve_folder(path, subfolder)
    if folder is not None and read_folder_config(folder).get("_class_name") not in _RELEASE_CLASSES:
        return folder_variant(folder)
    files = [Path(path)] if folder is None else sorted(folder.glob("diffusion_pytorch_model*.safetensors"))
    return identify_single_file(files, TRANSFORMER_SPEC).name


def check_variant(variant: str | None, architecture: str, where: str | Path) -> None:
    """CheckpointError naming the right architecture when `architecture` does not train `variant`."""
    if variant is None or architecture in VARIANT_ARCHITECTURES[variant][1]:
        return
    from tuner.registry import ARCHITECTURES

    what, archs = VARIANT_ARCHITECTURES[variant]
    fix = f'use architecture = "{archs[0]}"'
    if archs[0] not in ARCHITECTURES:
        fix += " (tuner does not support it yet)"
    raise CheckpointError(
        f"{where}: this is {what}, which architecture {architecture!r} does not train; {fix}."
    )


def load_vae(
    path: str | Path, dtype: torch.dtype, generation: str = "2.1", architecture: str = "wan"
) -> AutoencoderKLWan:
    """Load the Wan `generation` ("2.1" or "2.2", `tuner.archs.wan.wan22_vae`) VAE from a diffusers folder
    or an original single file (.safetensors or .pth). A VAE of the other generation is refused, naming
    the one `architecture` needs."""
    from tuner.archs.wan.wan22_vae import check_vae_generation, load_vae22

    check_vae_generation(path, generation, architecture)
    if generation == "2.2":
        return load_vae22(path, dtype)
    return load_component(path, dtype, "AutoencoderKLWan", "vae", VAE_SPEC, diffusers_converter=True)


def load_text_encoder(
    path: str | Path, tokenizer_path: str | Path | None, dtype: torch.dtype
) -> tuple[UMT5EncoderModel, PreTrainedTokenizerBase]:
    """Load the UMT5 encoder and its tokenizer, in eval mode.

    `tokenizer_path` may be None when `path` is a diffusers pipeline root or its `text_encoder` folder
    (the sibling `tokenizer/` folder is used); a single file needs it.
    """
    from transformers import UMT5EncoderModel

    folders = ("text_encoder", "tokenizer")
    model, found = load_encoder(path, dtype, UMT5EncoderModel, "umt5", folders, TEXT_ENCODER_SPEC)
    what = "UMT5 tokenizer (the tokenizer/ folder of a Wan 2.1 diffusers release, or google/umt5-xxl)"
    return model, load_tokenizer(tokenizer_path or found, path, what)


# ---------------------------------------------------------------------------------------------------
# Inputs for the transformer
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_prompts(
    text_encoder: UMT5EncoderModel,
    tokenizer: PreTrainedTokenizerBase,
    captions: list[str],
    max_length: int = 512,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """UMT5 embeddings of each caption at its true token length (with `</s>`): one [L, D] tensor each.

    Tokens are padded to `max_length` and masked, as WanPipeline does, so the kept rows are the ones the
    pipeline computes. The official model and WanPipeline feed the transformer these rows followed by
    zeros up to 512 tokens; whoever batches them must pad the same way. Whitespace is collapsed first,
    as in both (diffusers additionally runs ftfy and html unescaping, which is left out here).
    """
    device = torch.device(device) if device is not None else text_encoder.device
    tokens = tokenizer(
        [" ".join(c.split()) for c in captions],
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mask = tokens.attention_mask.to(device)
    hidden = text_encoder(tokens.input_ids.to(device), attention_mask=mask).last_hidden_state
    return [h[:n] for h, n in zip(hidden, mask.sum(dim=1).tolist())]


def _latent_stats(vae: AutoencoderKLWan, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, 1/std) of the latent channels, shaped to broadcast over [B, C, F, H, W]."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, inv_std


@torch.no_grad()
def encode_video(vae: AutoencoderKLWan, pixels: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, C, 1 + (F-1)/4, H/s, W/s] of videos [B, 3, F, H, W] in [-1, 1]: C = 16 and
    s = 8 for the Wan 2.1 VAE, C = 48 and s = 16 for Wan 2.2's (its config's `scale_factor_spatial`).

    Uses the mean of the latent distribution (`latent_dist.mode()`; no sampling, so caching is
    deterministic) and normalizes per channel with the VAE config's `latents_mean` / `latents_std`, the
    statistics WanPipeline undoes before decoding.
    """
    frames, height, width = pixels.shape[2:]
    side = vae.config.scale_factor_spatial
    if (frames - 1) % 4 or height % side or width % side:
        raise ValueError(
            f"Wan VAE needs 1 + 4k frames and sides divisible by {side}, got {tuple(pixels.shape)}"
        )
    param = next(vae.parameters())
    latents = vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode()
    mean, inv_std = _latent_stats(vae, latents)
    return (latents - mean) * inv_std


@torch.no_grad()
def decode_latents(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """Videos [B, 3, F, H, W] in about [-1, 1] from normalized latents (the inverse of `encode_video`)."""
    param = next(vae.parameters())
    latents = latents.to(param.device, param.dtype)
    mean, inv_std = _latent_stats(vae, latents)
    return vae.decode(latents / inv_std + mean).sample


# --- the forward cut at its blocks, for pipeline stages (`tuner.distributed.pipeline`) ----------------
# WanTransformer3DModel.forward for text-to-video inputs (one timestep per sample, no image context);
# tests/test_distributed_pipeline.py checks the parts against the whole forward.


def embed(model: WanTransformer3DModel, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The forward up to its first block on its keyword arguments: (video tokens, text tokens (after the
    image's CLIP tokens where given), the blocks' timestep projection, rotary cos, rotary sin, timestep
    embedding). A timestep per token ([B, tokens], Wan 2.2 TI2V) gives per-token projections."""
    latents, timestep = inputs["hidden_states"], inputs["timestep"]
    cos, sin = model.rope(latents)
    hidden = model.patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()
    per_token = timestep.shape[1] if timestep.ndim == 2 else None
    temb, projection, text, image = model.condition_embedder(
        timestep.flatten(), inputs["encoder_hidden_states"], inputs.get("encoder_hidden_states_image"),
        timestep_seq_len=per_token,
    )  # fmt: skip
    if image is not None:
        text = torch.cat([image, text], dim=1)
    return hidden, text, projection.unflatten(1 if per_token is None else 2, (6, -1)), cos, sin, temb


def run_block(
    model: WanTransformer3DModel, block: torch.nn.Module, carried: tuple
) -> tuple[torch.Tensor, ...]:
    """One transformer block on the carried tensors."""
    from tuner.archs.stages import call_block

    hidden, text, projection, cos, sin, temb = carried
    return call_block(model, block, hidden, text, projection, (cos, sin)), text, projection, cos, sin, temb


def project_out(model: WanTransformer3DModel, carried: tuple, latents: torch.Tensor) -> torch.Tensor:
    """The forward after its last block: output norm, projection and unpatchify to `latents`' shape."""
    hidden, temb = carried[0], carried[-1]
    if temb.ndim == 3:  # per token [B, tokens, width] (Wan 2.2 TI2V)
        shift, scale = (model.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
        shift, scale = (model.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    hidden = model.proj_out((model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden))
    b, _, frames, height, width = latents.shape
    p_t, p_h, p_w = model.config.patch_size
    hidden = hidden.reshape(b, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
    return hidden.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)
