"""Cosmos 1.0 Diffusion Text2World / Video2World (7B, 14B): loading its transformer and VAE.

The network is diffusers' `CosmosTransformer3DModel`, as Cosmos-Predict2's, with another config (NVIDIA's
GeneralDIT: a learnable absolute position embedding beside the RoPE, `extra_pos_embed_type = "learnable"`;
7B: 32 heads of 128, 28 blocks; 14B: 40 heads, 36 blocks; Video2World one input channel more, the condition
mask) and the release's own names (`keys_cosmos1`). What it shares with Predict2 is loaded by
`tuner.archs.cosmos_predict2.loaders`: T5-11B text, the padding mask taken as an input channel
(`build_transformer`), the release's `net.` prefix. Cosmos 1.0 and Predict2 files are told apart by their
names (`blocks.block0.blocks.0...` against `blocks.0.self_attn...`), folders by `extra_pos_embed_type`; each
loader refuses the other's, naming the architecture that trains it.

The VAE is NVIDIA's Cosmos tokenizer CV8x8x8 (`AutoencoderKLCosmos`: 8× in time and space, 16 channels; a
clip of 8k + 1 frames gives k + 1 latent frames, the first frame alone the first). Its latents are
normalized by the per-channel *and per-latent-frame* statistics of its config (`latents_mean` /
`latents_std`, 16 × frames values) and scaled by the pipelines' `sigma_data` (0.5), as
CosmosVideoToWorldPipeline encodes its given video and both pipelines decode.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tuner.archs.cosmos_predict2 import loaders as predict2
from tuner.archs.cosmos_predict2.keys_cosmos1 import COSMOS1_LAYOUT, is_release_only
from tuner.errors import CheckpointError
from tuner.models.identify import variant_table
from tuner.models.loading import (
    load_diffusers_folder,
    read_folder_config,
    resolve_folder,
)

if TYPE_CHECKING:
    from diffusers import AutoencoderKLCosmos, CosmosTransformer3DModel

SIGMA_DATA = 0.5  # the Cosmos 1.0 pipelines' EDMEulerScheduler `sigma_data`: normalized latents × 0.5

TRANSFORMER_VARIANTS = variant_table(
    predict2.CONFIGS / "transformer",
    ("x_embedder.proj.1.weight", "blocks.block{}.blocks.2.block.layer1.weight"),
    {
        # nvidia/Cosmos-1.0-Diffusion-7B-Text2World: 16 latent channels + the padding mask, × 2 × 2 patches
        "7B-text2world": ((4096, 68), (28, (16384, 4096))),
        "14B-text2world": ((5120, 68), (36, (20480, 5120))),
        # nvidia/Cosmos-1.0-Diffusion-*-Video2World: + the condition mask
        "7B-video2world": ((4096, 72), (28, (16384, 4096))),
        "14B-video2world": ((5120, 72), (36, (20480, 5120))),
        # the test fixtures (tuner.archs.cosmos_predict2.fixture_cosmos1): 2 heads of 32, 2 blocks
        "tiny-cosmos1": ((64, 68), (2, (256, 64))),
        "tiny-cosmos1-v2w": ((64, 72), (2, (256, 64))),
    },
)  # fmt: skip

COSMOS1 = predict2.Generation(
    what="Cosmos 1.0 Diffusion transformer",
    variants=TRANSFORMER_VARIANTS,
    original_markers=("x_embedder.proj.1.weight", "blocks.block0.blocks.0.block.attn.to_q.0.weight"),
    diffusers_markers=("patch_embed.proj.weight", "learnable_pos_embed.pos_emb_t"),
    layout=COSMOS1_LAYOUT,
    is_release_only=is_release_only,
    relatives=(
        (
            "blocks.0.self_attn.q_proj.weight",
            'a Cosmos-Predict2 transformer; train it with architecture = "cosmos_predict2" (Text2Image) or '
            '"cosmos_predict2_v2w" (Video2World); cosmos1_* take Cosmos 1.0 Diffusion files',
        ),
    ),
    architectures=("cosmos1_t2w", "cosmos1_v2w"),
    models=("Text2World", "Video2World"),
)
identify_transformer = COSMOS1.identify


def load_transformer(
    path: str | Path, dtype: torch.dtype, video2world: bool = False
) -> CosmosTransformer3DModel:
    """The Cosmos 1.0 Text2World (or, with `video2world`, Video2World) transformer from a diffusers folder or
    a single file (release / ComfyUI names, or diffusers'), in eval mode, its padding mask an input channel."""
    folder = resolve_folder(path, "transformer")
    if folder is None:
        return COSMOS1.load_file(path, dtype, video2world)
    config = read_folder_config(folder)
    if config.get("_class_name") != "CosmosTransformer3DModel" or config.get("in_channels") not in (16, 17):
        raise CheckpointError(f"{folder}: not a Cosmos 1.0 Diffusion transformer folder.")
    if config.get("extra_pos_embed_type") != "learnable":
        raise CheckpointError(
            f"{folder}: a Cosmos-Predict2 (or later) transformer, without Cosmos 1.0's learnable position "
            'embedding; train it with architecture = "cosmos_predict2" or "cosmos_predict2_v2w".'
        )
    COSMOS1.check_model(folder, config["in_channels"], video2world)
    return predict2.build_transformer(config, predict2.load_folder_tensors(folder), dtype, folder)


# ---------------------------------------------------------------------------------------------------
# VAE
# ---------------------------------------------------------------------------------------------------


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKLCosmos:
    """The Cosmos tokenizer CV8x8x8 from a diffusers folder (a Cosmos 1.0 pipeline root or its `vae/`)."""
    from diffusers import AutoencoderKLCosmos

    folder = resolve_folder(path, "vae")
    if folder is None:
        raise CheckpointError(
            f"{path}: the Cosmos 1.0 VAE is read from a diffusers folder (the `vae/` of "
            "nvidia/Cosmos-1.0-Diffusion-7B-Text2World, or that pipeline's root); point model.vae there."
        )
    if read_folder_config(folder).get("_class_name") != "AutoencoderKLCosmos":
        raise CheckpointError(f"{folder}: not an AutoencoderKLCosmos (the Cosmos 1.0 tokenizer CV8x8x8).")
    return load_diffusers_folder(AutoencoderKLCosmos, folder, dtype, "AutoencoderKLCosmos").eval()


def _latent_stats(vae: AutoencoderKLCosmos, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) [1, 16, F, 1, 1] of the first F latent frames, or (0, 1) for a VAE without them."""
    c, f = vae.config.latent_channels, latents.shape[2]
    if vae.config.latents_mean is None:
        return latents.new_zeros(()), latents.new_ones(())
    stats = [torch.tensor(s).view(1, c, -1, 1, 1) for s in (vae.config.latents_mean, vae.config.latents_std)]
    if stats[0].shape[2] < f:
        raise ValueError(
            f"the Cosmos VAE's latent statistics cover {stats[0].shape[2]} latent frames, not {f}"
        )
    return tuple(s[:, :, :f].to(latents) for s in stats)


def encode_video(vae: AutoencoderKLCosmos, pixels: torch.Tensor) -> torch.Tensor:
    """Latents [B, 16, 1 + (F − 1)/8, H/8, W/8] of videos [B, 3, F, H, W] in [-1, 1], normalized and × σ_d."""
    frames, height, width = pixels.shape[2:]
    if (frames - 1) % 8 or height % 8 or width % 8:
        raise ValueError(
            f"the Cosmos VAE needs 1 + 8k frames and sides divisible by 8, got {tuple(pixels.shape)}"
        )
    param = next(vae.parameters())
    latents = vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode()
    mean, std = _latent_stats(vae, latents)
    return (latents - mean) * SIGMA_DATA / std


def decode_latents(vae: AutoencoderKLCosmos, latents: torch.Tensor) -> torch.Tensor:
    """Videos [B, 3, F, H, W] in about [-1, 1] from `encode_video`'s latents, as the pipelines decode."""
    param = next(vae.parameters())
    latents = latents.to(param.device, param.dtype)
    mean, std = _latent_stats(vae, latents)
    return vae.decode(latents * std / SIGMA_DATA + mean).sample
