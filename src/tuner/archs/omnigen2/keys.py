"""OmniGen2's key layout: the release's names are the model's own.

The release (`OmniGen2/OmniGen2`'s `transformer/diffusion_pytorch_model*.safetensors`) is the state dict
of its diffusers-style `OmniGen2Transformer2DModel`, and ComfyUI's `omnigen2_fp16.safetensors` holds the
same keys (ComfyUI's `comfy/ldm/omnigen/omnigen2.py` names its modules as the release does), with or
without the `model.diffusion_model.` prefix. `tuner.archs.omnigen2.model` keeps those names, so the
layout is the identity: q, k and v stay separate linears (`attn.to_q / to_k / to_v`), nothing is fused.
ComfyUI's LoRA key map has no OmniGen2-specific entries; it reads every model's `diffusion_model.<name>`
and `lora_unet_<name with _>` stems, which the `comfy` layout writes.
"""

from __future__ import annotations

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

BLOCK_LISTS = ("context_refiner", "noise_refiner", "ref_image_refiner", "layers")

# The transformer's linear layers ({i}: block index); listing them lets kohya-style stems (dots turned
# into underscores) be read back unambiguously.
_BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                  "feed_forward.linear_1", "feed_forward.linear_2", "feed_forward.linear_3")  # fmt: skip
LINEAR_MODULES = (
    *(f"{b}.{{i}}.{name}" for b in BLOCK_LISTS for name in _BLOCK_LINEARS),
    *(f"{b}.{{i}}.norm1.linear" for b in BLOCK_LISTS if b != "context_refiner"),
    "x_embedder", "ref_image_patch_embedder",
    "time_caption_embed.timestep_embedder.linear_1", "time_caption_embed.timestep_embedder.linear_2",
    "time_caption_embed.caption_embedder.1", "norm_out.linear_1", "norm_out.linear_2",
)  # fmt: skip

OMNIGEN2_KEYS = ArchitectureKeys("omnigen2", tuple((name, name) for name in LINEAR_MODULES), same_names=True)
"""The adapter name map: the release's names are the model's."""
OMNIGEN2_LAYOUT = CheckpointLayout(OMNIGEN2_KEYS)
