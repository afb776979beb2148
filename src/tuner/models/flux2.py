"""FLUX.2 (dev): loading its three models and turning captions and images into model inputs.

Each loader takes either layout users have (see `tuner.models.loading`):

* transformer: a diffusers folder, or BFL's / ComfyUI's single file (`flux2-dev.safetensors`,
  `flux2_dev_fp8mixed.safetensors`: `double_blocks.0.img_attn.qkv.weight`, `single_blocks.0.linear1`,
  `double_stream_modulation_img.lin.weight`, ...; with or without `model.diffusion_model.`; fp8 files are
  dequantized), converted by `flux2_keys` at any size. The variant (dev, klein 4B / 9B) is read from the
  tensor shapes; klein files are refused by `flux2` (klein trains with another text encoder), and a
  FLUX.1 file is refused naming `flux`;
* VAE: a diffusers folder (`AutoencoderKLFlux2`), or BFL's `ae.safetensors` / ComfyUI's
  `flux2-vae.safetensors` (the LDM layout with `encoder.quant_conv`, `decoder.post_quant_conv`, `bn.*`);
* text encoder, Mistral-Small-3.x 24B: the diffusers folder's `text_encoder/` (a
  Mistral3ForConditionalGeneration) or a single file holding its language model under any of the names it
  is published with (`model.language_model.*`, `language_model.model.*`, or a plain Mistral's
  `model.*`). The prompt is text only, so the hidden states are the language model's: tuner builds just
  transformers' `MistralModel` and leaves the vision tower, projector and LM head unloaded. A single file
  carries no tokenizer: pass the `tokenizer/` folder of FLUX.2-dev.

Model inputs are what Flux2Pipeline computes. Text: the prompt in a chat with BFL's system message, padded
to `max_length` tokens, run with its attention mask; the hidden states after layers 10, 20 and 30 are
stacked per token into [max_length, 3 · 5120] and all rows are kept (the transformer takes no text
mask). Latents: the VAE's mode [32, H/8, W/8], patchified 2×2 into [128, H/16, W/16] and normalized by
the VAE's BatchNorm running statistics; every latent pixel is then one token, with position ids
(t, row, col, 0): t = 0 for the target, 10, 20, ... for reference images (multi-reference editing,
appended after the target's tokens). Text tokens have ids (0, 0, 0, l). The timestep is t ∈ [0, 1] (the
model scales it), dev's guidance embedding gets `model.guidance`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from tuner.errors import CheckpointError
from tuner.models.flux2_keys import (
    transformer_key_to_original,
    transformer_to_diffusers,
    vae_key_to_original,
    vae_to_diffusers,
)
from tuner.models.identify import (
    SingleFileSpec,
    Variant,
    check_keys,
    diffusers_meta_keys,
    identify_single_file,
    pick_variant,
    wrong_architecture,
)
from tuner.models.loading import (
    assert_materialized,
    cast_like_from_pretrained_,
    load_diffusers_folder,
    load_tensors,
    load_tokenizer,
    normalize_shapes,
    normalize_state_dict,
    read_folder_config,
    read_tensor_shapes,
    resolve_folder,
)

if TYPE_CHECKING:
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import MistralModel, PreTrainedTokenizerBase

CONFIGS = Path(__file__).parent / "configs" / "flux2"
TEXT_LAYERS = (10, 20, 30)  # Flux2Pipeline's `text_encoder_out_layers`: hidden states after these layers
REFERENCE_T_STEP = 10  # reference image i has position t = 10 · (i + 1)

# ---------------------------------------------------------------------------------------------------
# Known variants (original-layout names; None: the tensor must be absent, pinning the block count)
# ---------------------------------------------------------------------------------------------------
TRANSFORMER_VARIANTS = (
    Variant(
        "dev",
        CONFIGS / "transformer" / "dev",
        {
            "img_in.weight": (6144, 128),
            "txt_in.weight": (6144, 15360),
            "guidance_in.in_layer.weight": (6144, 256),
            "double_blocks.7.img_attn.qkv.weight": (18432, 6144),
            "double_blocks.8.img_attn.qkv.weight": None,
            "single_blocks.47.linear2.weight": (6144, 24576),
            "single_blocks.48.linear2.weight": None,
        },
    ),
    Variant(
        "klein-4b",
        CONFIGS / "transformer" / "klein-4b",
        {
            "img_in.weight": (3072, 128),
            "txt_in.weight": (3072, 7680),
            "guidance_in.in_layer.weight": None,
            "double_blocks.4.img_attn.qkv.weight": (9216, 3072),
            "double_blocks.5.img_attn.qkv.weight": None,
            "single_blocks.19.linear2.weight": (3072, 12288),
            "single_blocks.20.linear2.weight": None,
        },
    ),
    Variant(
        "klein-9b",
        CONFIGS / "transformer" / "klein-9b",
        {
            "img_in.weight": (4096, 128),
            "txt_in.weight": (4096, 12288),
            "guidance_in.in_layer.weight": None,
            "double_blocks.7.img_attn.qkv.weight": (12288, 4096),
            "double_blocks.8.img_attn.qkv.weight": None,
            "single_blocks.23.linear2.weight": (4096, 16384),
            "single_blocks.24.linear2.weight": None,
        },
    ),
    Variant(  # the test fixture (tuner.fixtures.flux2): 2 heads of 32, one block of each kind
        "tiny",
        CONFIGS / "transformer" / "tiny",
        {
            "img_in.weight": (64, 128),
            "txt_in.weight": (64, 96),
            "guidance_in.in_layer.weight": (64, 256),
            "double_blocks.0.img_attn.qkv.weight": (192, 64),
            "double_blocks.1.img_attn.qkv.weight": None,
            "single_blocks.0.linear2.weight": (64, 256),
            "single_blocks.1.linear2.weight": None,
        },
    ),
)
KLEIN_VARIANTS = ("klein-4b", "klein-9b")

VAE_VARIANTS = (
    Variant(
        "flux2",
        CONFIGS / "vae" / "flux2",
        {
            "encoder.conv_in.weight": (128, 3, 3, 3),
            "encoder.conv_out.weight": (64, 512, 3, 3),
            "decoder.conv_in.weight": (512, 32, 3, 3),
            "bn.running_mean": (128,),
        },
    ),
    Variant(
        "tiny",
        CONFIGS / "vae" / "tiny",
        {
            "encoder.conv_in.weight": (32, 3, 3, 3),
            "encoder.conv_out.weight": (64, 64, 3, 3),
            "decoder.conv_in.weight": (64, 32, 3, 3),
            "bn.running_mean": (128,),
        },
    ),
)

TEXT_ENCODER_VARIANTS = (
    Variant(
        "mistral-small-3",  # Mistral-Small-3.1 / 3.2 24B, the language model
        CONFIGS / "text_encoder" / "mistral-small-3",
        {
            "embed_tokens.weight": (131072, 5120),
            "layers.39.mlp.gate_proj.weight": (32768, 5120),
            "layers.40.mlp.gate_proj.weight": None,
        },
    ),
    Variant(  # the fixture: 30 layers (the pipeline reads the 30th) of width 32
        "tiny",
        CONFIGS / "text_encoder" / "tiny",
        {
            "embed_tokens.weight": (1024, 32),
            "layers.29.mlp.gate_proj.weight": (64, 32),
            "layers.30.mlp.gate_proj.weight": None,
        },
    ),
)

_ORIGINAL_MARKERS = ("double_stream_modulation_img.lin.weight", "img_in.weight")
FLUX1_MARKER = "double_blocks.0.img_mod.lin.weight"  # FLUX.1 modulates per block; FLUX.2 per kind of block
_ORIGINAL_VAE_MARKERS = ("encoder.down.0.block.0.conv1.weight", "bn.running_mean")


def _levels(variant: Variant) -> int:
    from diffusers import AutoencoderKLFlux2

    return len(AutoencoderKLFlux2.load_config(variant.config_dir)["block_out_channels"])


def _transformer_keys(variant: Variant) -> set[str]:
    from diffusers import Flux2Transformer2DModel

    return {
        transformer_key_to_original(k)
        for k in diffusers_meta_keys(Flux2Transformer2DModel, variant.config_dir)
    }


def _vae_keys(variant: Variant) -> list[str]:
    from diffusers import AutoencoderKLFlux2

    levels = _levels(variant)
    keys = diffusers_meta_keys(AutoencoderKLFlux2, variant.config_dir)
    return [vae_key_to_original(k, levels) for k in keys if k != _BN_COUNTER]


_BN_COUNTER = "bn.num_batches_tracked"  # a BatchNorm training counter; released files may lack it

TRANSFORMER_SPEC = SingleFileSpec(
    what="FLUX.2 transformer",
    variants=TRANSFORMER_VARIANTS,
    expected_keys=_transformer_keys,
    original_markers=_ORIGINAL_MARKERS,
    diffusers_markers=("double_stream_modulation_img.linear.weight", "x_embedder.weight"),
    to_original=transformer_key_to_original,
)
VAE_SPEC = SingleFileSpec(
    what="FLUX.2 VAE",
    variants=VAE_VARIANTS,
    expected_keys=_vae_keys,
    original_markers=_ORIGINAL_VAE_MARKERS,
    diffusers_markers=("encoder.down_blocks.0.resnets.0.conv1.weight", "bn.running_mean"),
    to_original=vae_key_to_original,  # both known variants have 4 levels
)


def is_flux2_file(shapes: Mapping[str, object]) -> bool:
    """Whether checkpoint keys (prefix stripped) are a FLUX.2 transformer's, in either layout."""
    return any(
        k in shapes
        for k in ("double_stream_modulation_img.lin.weight", TRANSFORMER_SPEC.diffusers_markers[0])
    )


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_transformer(
    path: str | Path, dtype: torch.dtype, architecture: str = "flux2"
) -> Flux2Transformer2DModel:
    """Load the FLUX.2 transformer from a diffusers folder or a single file (either layout), in eval mode.
    A klein file (no guidance embedding) is refused: it needs klein's text encoder."""
    from diffusers import Flux2Transformer2DModel

    folder = resolve_folder(path, "transformer")
    if folder is not None:
        model = load_diffusers_folder(Flux2Transformer2DModel, folder, dtype, "Flux2Transformer2DModel")
        _check_dev(path, "klein" if not model.config.guidance_embeds else "dev", architecture)
        return model
    shapes = normalize_shapes(read_tensor_shapes(path))
    if FLUX1_MARKER in shapes:
        raise CheckpointError(
            f"{path}: a FLUX.1 transformer (per-block modulation `double_blocks.0.img_mod`), not FLUX.2. "
            'Set model.architecture = "flux" (or "flux_kontext") to train it.'
        )
    variant = identify_single_file(path, TRANSFORMER_SPEC)
    _check_dev(path, variant.name, architecture)
    state_dict = normalize_state_dict(load_tensors(path), dtype)
    if all(k in state_dict for k in _ORIGINAL_MARKERS):
        state_dict = transformer_to_diffusers(state_dict)
    return _from_state_dict(Flux2Transformer2DModel, state_dict, variant.config_dir, dtype, Path(path))


def _check_dev(path: str | Path, variant: str, architecture: str) -> None:
    if variant.startswith("klein"):
        raise CheckpointError(
            f"{path}: a FLUX.2 klein transformer ({variant}, no guidance embedding). {architecture} trains "
            "FLUX.2 dev, whose text encoder is Mistral-Small; klein conditions on Qwen3 and is not supported "
            "by tuner yet."
        )


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKLFlux2:
    """Load the FLUX.2 VAE from a diffusers folder or a single file, in eval mode."""
    from diffusers import AutoencoderKLFlux2

    folder = resolve_folder(path, "vae")
    if folder is not None:
        return load_diffusers_folder(AutoencoderKLFlux2, folder, dtype, "AutoencoderKLFlux2")
    variant = identify_single_file(path, VAE_SPEC)
    state_dict = normalize_state_dict(load_tensors(path), dtype)
    if all(k in state_dict for k in _ORIGINAL_VAE_MARKERS):
        state_dict = vae_to_diffusers(state_dict, _levels(variant))
    state_dict.setdefault(_BN_COUNTER, torch.tensor(0))
    return _from_state_dict(AutoencoderKLFlux2, state_dict, variant.config_dir, dtype, Path(path))


def _from_state_dict(
    model_cls: type, state_dict: dict[str, torch.Tensor], config_dir: Path, dtype: torch.dtype, path: Path
) -> torch.nn.Module:
    """A diffusers model of the shipped config holding exactly `state_dict`, cast as `from_pretrained` casts."""
    with torch.device("meta"):
        model = model_cls.from_config(model_cls.load_config(config_dir))
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: cannot be loaded as a {model_cls.__name__}: {e}") from None
    assert_materialized(model, path)
    cast_like_from_pretrained_(model, dtype)
    return model.eval()


class TextEncoder(NamedTuple):
    """FLUX.2 dev's prompt encoder: Mistral-Small's language model and its tokenizer, in eval mode."""

    model: MistralModel
    tokenizer: PreTrainedTokenizerBase


# Prefixes the language model's weights are published under, tried in order: transformers 5's
# Mistral3ForConditionalGeneration, transformers 4's, a plain Mistral causal LM.
_LM_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_NOT_LM = (
    "vision_tower.",
    "multi_modal_projector.",
    "lm_head.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def language_model_names(names: Sequence[str]) -> dict[str, str]:
    """`MistralModel` key -> stored key for the language model's tensors of a checkpoint."""
    names = [n for n in names if not n.startswith(_NOT_LM)]
    for prefix in _LM_PREFIXES:
        if any(n.startswith(prefix) for n in names):
            return {n.removeprefix(prefix): n for n in names if n.startswith(prefix)}
    return {n: n for n in names}


def load_text_encoder(path: str | Path, tokenizer: str | Path | None, dtype: torch.dtype) -> TextEncoder:
    """Load Mistral-Small's language model from a diffusers folder or a single file, with its tokenizer
    (`tokenizer` may be None for a diffusers folder: the sibling `tokenizer/`)."""
    from transformers import MistralConfig, MistralModel

    folder = resolve_folder(path, "text_encoder")
    if folder is not None:
        config = read_folder_config(folder)
        if config.get("model_type") not in ("mistral3", "mistral"):
            raise CheckpointError(
                f"{folder}: config.json describes a {config.get('model_type')!r} model, not FLUX.2 dev's "
                "Mistral-Small text encoder (mistral3)."
            )
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no .safetensors weights in this text encoder folder.")
        found = folder.parent / "tokenizer" if (folder.parent / "tokenizer").is_dir() else None
    else:
        files, found = [Path(path)], None
    shapes = {k: v for f in files for k, v in read_tensor_shapes(f).items()}
    names = language_model_names(list(shapes))
    lm_shapes = {k: shapes[stored] for k, stored in names.items()}
    markers = ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight")
    if not all(k in lm_shapes for k in markers):
        raise wrong_architecture(path, list(shapes), "Mistral-Small text encoder", markers)
    variant = pick_variant(lm_shapes, TEXT_ENCODER_VARIANTS, path, "Mistral-Small text encoder")
    config = MistralConfig.from_pretrained(variant.config_dir)
    with torch.device("meta"):
        expected = MistralModel(config).state_dict()
    check_keys(expected, lm_shapes, path, f"Mistral-Small text encoder {variant.name}")
    tensors = {k: v for f in files for k, v in load_tensors(f).items()}
    state_dict = normalize_state_dict({k: tensors[stored] for k, stored in names.items()}, dtype)
    model = MistralModel.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype).eval()
    what = "Mistral-Small tokenizer (the tokenizer/ folder of FLUX.2-dev)"
    return TextEncoder(model, load_tokenizer(tokenizer or found, path, what))


# ---------------------------------------------------------------------------------------------------
# Inputs for the transformer
# ---------------------------------------------------------------------------------------------------


def chat(caption: str) -> list[dict]:
    """The conversation Flux2Pipeline wraps a prompt in: BFL's system message, then the prompt."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
        {"role": "user", "content": [{"type": "text", "text": caption.replace("[IMG]", "")}]},
    ]


@torch.no_grad()
def encode_prompts(encoder: TextEncoder, captions: list[str], max_length: int = 512) -> list[torch.Tensor]:
    """Per caption [max_length, 3 · D]: the hidden states after `TEXT_LAYERS`, side by side per token."""
    model, tokenizer = encoder
    inputs = tokenizer.apply_chat_template(
        [chat(c) for c in captions], add_generation_prompt=False, tokenize=True, return_dict=True,
        return_tensors="pt", padding="max_length", truncation=True, max_length=max_length,
    )  # fmt: skip
    device = next(model.parameters()).device
    out = model(
        input_ids=inputs["input_ids"].to(device),
        attention_mask=inputs["attention_mask"].to(device),
        output_hidden_states=True,
        use_cache=False,
    )
    stacked = torch.stack([out.hidden_states[k] for k in TEXT_LAYERS], dim=2)  # [B, L, layers, D]
    return list(stacked.flatten(2))


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
def encode_images(vae: AutoencoderKLFlux2, pixels: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, 128, H/16, W/16] of images [B, 3, H, W] in [-1, 1], as Flux2Pipeline encodes
    reference images: the distribution's mode, patchified, minus the BatchNorm mean over its std."""
    if pixels.shape[-1] % 16 or pixels.shape[-2] % 16:
        raise ValueError(f"FLUX.2 needs sides divisible by 16, got {tuple(pixels.shape)}")
    param = next(vae.parameters())
    latents = patchify(vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode())
    mean, std = _bn_stats(vae, latents)
    return (latents - mean) / std


@torch.no_grad()
def decode_latents(vae: AutoencoderKLFlux2, latents: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in about [-1, 1] from normalized latents (the inverse of `encode_images`)."""
    param = next(vae.parameters())
    latents = latents.to(param.device, param.dtype)
    mean, std = _bn_stats(vae, latents)
    return vae.decode(unpatchify(latents * std + mean)).sample


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


def predict_velocity(
    model: Flux2Transformer2DModel,
    noisy: torch.Tensor,
    t: torch.Tensor,
    prompt_embeds: torch.Tensor,
    guidance: float,
    references: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """The model's velocity for latents `noisy` [B, 128, H, W] at t ∈ [0, 1] (shape of `noisy`).

    `references` are reference latents [B, 128, H', W'] (multi-reference editing): their tokens follow
    the target's, with position t = 10, 20, ..., and their outputs are dropped.
    """
    b, _, h, w = noisy.shape
    tokens, ids = [pack(noisy)], [image_ids(h, w, 0, noisy.device)]
    for i, ref in enumerate(references):
        tokens.append(pack(ref.to(noisy.dtype)))
        ids.append(image_ids(ref.shape[-2], ref.shape[-1], REFERENCE_T_STEP * (i + 1), noisy.device))
    embedded_guidance = None
    if model.config.guidance_embeds:
        embedded_guidance = torch.full((b,), guidance, device=noisy.device, dtype=torch.float32)
    out = model(
        hidden_states=torch.cat(tokens, dim=1),
        timestep=t,
        guidance=embedded_guidance,
        encoder_hidden_states=prompt_embeds.to(noisy.dtype),
        txt_ids=text_ids(prompt_embeds.shape[1], noisy.device).expand(b, -1, -1),
        img_ids=torch.cat(ids).expand(b, -1, -1),
        return_dict=False,
    )[0]
    return out[:, : h * w].transpose(1, 2).reshape(b, -1, h, w)
