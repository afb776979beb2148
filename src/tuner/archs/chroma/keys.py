"""Key names of Chroma in diffusers' layout and in its release's (BFL-style) layout, both directions.

Chroma (lodestones' `chroma-unlocked-v*.safetensors`, `Chroma1-HD.safetensors`, ComfyUI's copies) is
FLUX.1-schnell with the per-block modulation linears and the time / pooled-text / guidance embedders
removed. One small network, the distilled guidance approximator, computes every block's modulation
from the timestep instead. The release keeps FLUX.1's names for everything the two share, so this table
is FLUX.1's (`flux_keys`) minus what Chroma lacks, plus the approximator:

* `distilled_guidance_layer.in_proj` / `out_proj` are named alike in both layouts;
* its residual MLPs are `layers.{i}.in_layer` / `out_layer` (diffusers: `linear_1` / `linear_2`) and
  their RMSNorm weights `norms.{i}.scale` (diffusers: `norms.{i}.weight`);
* there is no final modulation linear (the approximator emits it), so no swapped halves.

The fused `qkv` / `linear1` layers are FLUX.1's, so adapters export exactly as FLUX.1's do.
"""

from __future__ import annotations

from tuner.archs.flux.keys import FUSED_LAYERS, NORM_RULES, TRANSFORMER_RULES
from tuner.networks.architectures import COMFY_DIFFUSERS_FORMS, ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

# FLUX.1 modules Chroma does not have: the per-block modulations and the embedders of time, pooled
# CLIP text and guidance (the approximator replaces them all).
_FLUX_ONLY = (
    "transformer_blocks.{i}.norm1.linear",
    "transformer_blocks.{i}.norm1_context.linear",
    "single_transformer_blocks.{i}.norm.linear",
    "time_text_embed.",
)

# (diffusers, original) for the approximator's modules.
APPROXIMATOR_RULES: tuple[tuple[str, str], ...] = (
    ("distilled_guidance_layer.in_proj", "distilled_guidance_layer.in_proj"),
    ("distilled_guidance_layer.out_proj", "distilled_guidance_layer.out_proj"),
    ("distilled_guidance_layer.layers.{i}.linear_1", "distilled_guidance_layer.layers.{i}.in_layer"),
    ("distilled_guidance_layer.layers.{i}.linear_2", "distilled_guidance_layer.layers.{i}.out_layer"),
)

TRANSFORMER_RULES_CHROMA: tuple[tuple[str, str], ...] = (
    tuple(rule for rule in TRANSFORMER_RULES if not rule[0].startswith(_FLUX_ONLY)) + APPROXIMATOR_RULES
)

NORM_RULES_CHROMA: tuple[tuple[str, str], ...] = NORM_RULES + (
    ("distilled_guidance_layer.norms.{i}.weight", "distilled_guidance_layer.norms.{i}.scale"),
)

CHROMA_KEYS = ArchitectureKeys(
    "chroma", TRANSFORMER_RULES_CHROMA, FUSED_LAYERS, comfy_forms=COMFY_DIFFUSERS_FORMS
)
"""The adapter name map (diffusers module name -> release's), carrying FLUX.1's fused layers."""

CHROMA_LAYOUT = CheckpointLayout(CHROMA_KEYS, NORM_RULES_CHROMA)
"""The whole transformer checkpoint, both directions, at any size."""

# diffusers key -> release key; diffusers state dict -> release's; release's -> diffusers'
transformer_key_to_original = CHROMA_LAYOUT.key_to_original
transformer_to_original = CHROMA_LAYOUT.to_original
transformer_to_diffusers = CHROMA_LAYOUT.to_diffusers
