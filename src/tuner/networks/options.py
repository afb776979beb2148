"""Which `[network]` settings go together: checked when the config is loaded, and again by the factory.

Plain attribute checks with no torch import, so the config schema can call them at load time
(`NetworkConfig.__post_init__`) without loading any model code.
"""

from __future__ import annotations

from typing import Any

from tuner.errors import ConfigError

NETWORK_TYPES = ("lora", "loha", "lokr", "full")


def check_network_options(cfg: Any) -> None:
    """Refuse combinations of `[network]` keys that cannot work, naming the keys (`ConfigError`)."""
    if cfg.type not in NETWORK_TYPES:
        raise ConfigError(f"network.type must be one of {', '.join(NETWORK_TYPES)}, got {cfg.type!r}")
    if cfg.type == "full" and (cfg.dora or cfg.include or cfg.exclude or cfg.loraplus_lr_ratio):
        raise ConfigError(
            "network.type = 'full' trains every weight: network.dora, include, exclude and "
            "loraplus_lr_ratio apply to adapters only"
        )
    if cfg.stochastic_rounding and cfg.type != "full":
        raise ConfigError(
            "network.stochastic_rounding applies to network.type = 'full' (adapters train in fp32)"
        )
    if cfg.type != "lokr" and (cfg.decompose_both or cfg.full_matrix or cfg.factor != -1):
        raise ConfigError("network.factor, decompose_both and full_matrix apply to network.type = 'lokr'")
    if cfg.decompose_both and cfg.full_matrix:
        raise ConfigError("network.decompose_both and network.full_matrix exclude each other")
    if cfg.factor == 0 or cfg.factor < -1:
        raise ConfigError(f"network.factor must be -1 (automatic) or a positive size, got {cfg.factor}")


def check_save_format(dora: bool, layout: str) -> None:
    """tuner's DoRA normalises columns, which the diffusers (PEFT) layout cannot express, nor `comfy_folded`
    (written as diffusers' is). `layout` is the resolved one (`tuner.registry.resolve_save_format`), never "auto"."""
    if dora and layout in ("diffusers", "comfy_folded"):
        raise ConfigError(
            f"network.dora = true cannot be saved with save.format = '{layout}' (PEFT's DoRA normalises rows, "
            "tuner's columns, as ComfyUI and LyCORIS files do); use 'auto', 'comfy' or 'kohya'"
        )
