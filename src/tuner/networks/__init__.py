"""Adapter networks attached to a model from outside: targeting, LoRA, and their file layouts.

- `targets.py`: which linear layers get an adapter (`TargetSpec`, `find_targets`).
- `base.py`: the forward patch every adapter type shares, and the network collection.
- `keys.py`: file key layouts (original/"comfy", kohya, diffusers/PEFT) and name resolution.
- `lora.py`: LoRA itself, its files, and applying a LoRA file for inference.
"""

from tuner.networks.keys import NameMap, identity_name_map
from tuner.networks.lora import LoRAModule, LoRANetwork, LoRAWeights, apply_lora_file, load_lora_file
from tuner.networks.targets import TargetSpec, find_targets

__all__ = [
    "LoRAModule",
    "LoRANetwork",
    "LoRAWeights",
    "NameMap",
    "TargetSpec",
    "apply_lora_file",
    "find_targets",
    "identity_name_map",
    "load_lora_file",
]
