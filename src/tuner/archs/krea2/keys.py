"""Krea 2's release layout (the `krea-ai/krea-2` checkpoint ComfyUI loads) relative to diffusers'.

The facts are those of diffusers' single-file converter for the model
(`convert_krea2_transformer_checkpoint_to_diffusers` in `diffusers/loaders/single_file_utils.py`) and of
its LoRA converter (`_convert_non_diffusers_krea2_lora_to_diffusers` in `lora_conversion_utils.py`):

| diffusers                                   | release                                     |
|---------------------------------------------|---------------------------------------------|
| `transformer_blocks.{i}.attn.to_q/k/v`      | `blocks.{i}.attn.wq/wk/wv`                  |
| `...attn.to_out.0`, `...attn.to_gate`       | `...attn.wo`, `...attn.gate`                |
| `...attn.norm_q.weight` / `norm_k.weight`   | `...attn.qknorm.qnorm.scale` / `knorm.scale`|
| `...ff.gate/up/down`                        | `...mlp.gate/up/down`                       |
| `...norm1.weight`, `...norm2.weight`        | `...prenorm.scale`, `...postnorm.scale`     |
| `transformer_blocks.{i}.scale_shift_table` [6, D] | `blocks.{i}.mod.lin` [6·D], flattened |
| `text_fusion.{layerwise,refiner}_blocks.*`  | `txtfusion.{layerwise,refiner}_blocks.*` (the same block names) |
| `img_in`, `time_embed.linear_1/2`, `time_mod_proj` | `first`, `tmlp.0/2`, `tproj.1`       |
| `txt_in.norm.weight`, `txt_in.linear_1/2`   | `txtmlp.0.scale`, `txtmlp.1/3`              |
| `final_layer.linear/norm/scale_shift_table` | `last.linear`, `last.norm.scale`, `last.modulation.lin` |

No layer is fused; the one change beyond names is the blocks' modulation table, stored flattened
(`Krea2Layout` reshapes it both ways). ComfyUI's files put `model.diffusion_model.` before every key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.layouts import CheckpointLayout

TEXT_BLOCK_LISTS = ("text_fusion.layerwise_blocks", "text_fusion.refiner_blocks")
BLOCK_LISTS = ("transformer_blocks",)

_ATTENTION = (("to_q", "wq"), ("to_k", "wk"), ("to_v", "wv"), ("to_out.0", "wo"), ("to_gate", "gate"))
_FEED_FORWARD = (("ff.gate", "mlp.gate"), ("ff.up", "mlp.up"), ("ff.down", "mlp.down"))
_BLOCKS = (
    ("transformer_blocks", "blocks"),
    *((name, name.replace("text_fusion.", "txtfusion.")) for name in TEXT_BLOCK_LISTS),
)


def _block_rules(diffusers: str, original: str) -> tuple[tuple[str, str], ...]:
    d, o = f"{diffusers}.{{i}}", f"{original}.{{i}}"
    return (
        *((f"{d}.attn.{a}", f"{o}.attn.{b}") for a, b in _ATTENTION),
        *((f"{d}.{a}", f"{o}.{b}") for a, b in _FEED_FORWARD),
    )


# (diffusers module, release module); every linear layer is listed, so kohya spellings read back
_RENAMES = (
    *(rule for diffusers, original in _BLOCKS for rule in _block_rules(diffusers, original)),
    ("img_in", "first"),
    ("time_embed.linear_1", "tmlp.0"),
    ("time_embed.linear_2", "tmlp.2"),
    ("time_mod_proj", "tproj.1"),
    ("txt_in.linear_1", "txtmlp.1"),
    ("txt_in.linear_2", "txtmlp.3"),
    ("text_fusion.projector", "txtfusion.projector"),
    ("final_layer.linear", "last.linear"),
)


def _norm_rules(diffusers: str, original: str) -> tuple[tuple[str, str], ...]:
    d, o = f"{diffusers}.{{i}}", f"{original}.{{i}}"
    return (
        (f"{d}.attn.norm_q.weight", f"{o}.attn.qknorm.qnorm.scale"),
        (f"{d}.attn.norm_k.weight", f"{o}.attn.qknorm.knorm.scale"),
        (f"{d}.norm1.weight", f"{o}.prenorm.scale"),
        (f"{d}.norm2.weight", f"{o}.postnorm.scale"),
    )


MODULATION = ("transformer_blocks.{i}.scale_shift_table", "blocks.{i}.mod.lin")
"""The blocks' modulation table: [6, D] in diffusers, flattened to [6·D] in the release."""

_TENSOR_RENAMES = (
    *(rule for diffusers, original in _BLOCKS for rule in _norm_rules(diffusers, original)),
    MODULATION,
    ("txt_in.norm.weight", "txtmlp.0.scale"),
    ("final_layer.norm.weight", "last.norm.scale"),
    ("final_layer.scale_shift_table", "last.modulation.lin"),
)

KREA2_KEYS = ArchitectureKeys("krea2", _RENAMES)
"""The adapter name map (diffusers module -> release module): renames only, nothing fused."""


@dataclass(frozen=True)
class Krea2Layout(CheckpointLayout):
    """The release's layout: the renames above, and each block's modulation table flattened."""

    def to_original(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().to_original(state_dict)
        return {k: v.flatten() if _is_modulation(k) else v for k, v in out.items()}

    def tensor_to_diffusers(self, key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        if _is_modulation(key):
            value = value.reshape(6, -1)
        return super().tensor_to_diffusers(key, value)


def _is_modulation(original_key: str) -> bool:
    return original_key.startswith("blocks.") and original_key.endswith(".mod.lin")


KREA2_LAYOUT = Krea2Layout(KREA2_KEYS, tensor_renames=_TENSOR_RENAMES)
"""The whole transformer checkpoint both ways (`to_original` / `to_diffusers`), at any size."""
