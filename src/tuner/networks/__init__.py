"""Adapter networks attached to a model from outside: targeting, adapter types, and their file layouts.

- `targets.py`: which linear layers get an adapter (`TargetSpec`, `find_targets`).
- `base.py`: the forward patch every adapter type shares, and the network collection.
- `delta.py`: what a file stores per module (`ModuleWeights`) and the update ΔW it stands for.
- `lora.py`, `loha.py`, `lokr.py`: the adapter types; `dora.py`: weight decomposition around any of them.
- `full.py`: full fine-tuning behind the same interface, with stochastic rounding for bf16 weights.
- `keys.py`, `formats.py`: the comfy / kohya / diffusers key layouts, reading and writing them.
- `fused.py`, `architectures.py`: per-architecture name tables and fused layers (data), exact fusing.
- `factory.py`: `build_network` (from the `[network]` config) and `apply_adapter_file` (inference).
- `options.py`: which `[network]` settings go together (torch-free, for the config schema).

The names below are imported on first use, so `tuner.networks.options` can be read while a config is
loaded without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AdapterModule": "base",
    "AdapterNetwork": "base",
    "DoRAModule": "dora",
    "FullNetwork": "full",
    "LoHaModule": "loha",
    "LoHaNetwork": "loha",
    "LoKrModule": "lokr",
    "LoKrNetwork": "lokr",
    "LoRAModule": "lora",
    "LoRANetwork": "lora",
    "LoRAWeights": "lora",
    "ModuleWeights": "delta",
    "NameMap": "keys",
    "StochasticRounding": "full",
    "TargetSpec": "targets",
    "apply_adapter_file": "factory",
    "build_network": "factory",
    "find_targets": "targets",
    "identity_name_map": "keys",
    "load_lora_file": "lora",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
