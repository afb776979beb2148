"""Key names of Anima in diffusers' layout and in the release's (ComfyUI's) layout.

The DiT is Cosmos-Predict2's, under the same release names (`blocks.0.self_attn.q_proj.weight`, ...;
`tuner.archs.cosmos_predict2.keys`); the LLM adapter is one more module, `llm_adapter`, which keeps its
release names on the model (`tuner.archs.anima.adapter`). The release's file (`anima-preview.safetensors`)
stores both under `net.`, as NVIDIA's Cosmos files do; ComfyUI reads it with or without that prefix, and
names its adapter modules `diffusion_model.llm_adapter.blocks.0.self_attn.q_proj` (its key map holds
`diffusion_model.<name>` for every weight of the model, `comfy/lora.py` `model_lora_keys_unet`).
"""

from __future__ import annotations

from tuner.archs.cosmos_predict2.keys import TRANSFORMER_RULES
from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

ADAPTER = "llm_adapter"
"""The adapter's module on the transformer, and its prefix in the release's file."""

# the adapter's linear layers by name (so that kohya stems read back), then the rest of it as is
ADAPTER_RULES: tuple[tuple[str, str], ...] = tuple(
    (name, name)
    for name in (
        *(
            f"{ADAPTER}.blocks.{{i}}.{attn}.{proj}"
            for attn in ("self_attn", "cross_attn")
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
        ),
        f"{ADAPTER}.blocks.{{i}}.mlp.0",
        f"{ADAPTER}.blocks.{{i}}.mlp.2",
        f"{ADAPTER}.out_proj",
        ADAPTER,
    )
)

ANIMA_KEYS = ArchitectureKeys("anima", TRANSFORMER_RULES + ADAPTER_RULES)
ANIMA_LAYOUT = CheckpointLayout(ANIMA_KEYS)

transformer_to_original = ANIMA_LAYOUT.to_original
transformer_to_diffusers = ANIMA_LAYOUT.to_diffusers
