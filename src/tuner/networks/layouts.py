"""A model's two checkpoint layouts, diffusers' and its original release's, converted both ways by one table.

diffusers renames the modules of most original releases and splits some of their layers. tuner reads
original single files (what users download) and writes full fine-tunes back in that layout (what ComfyUI
and the official code load). An architecture declares the difference once, as data (`CheckpointLayout`),
and the same rules are read in both directions, so a round trip is exact: tensors are renamed, cut into
row blocks or joined from them, never recomputed. The rules, in the order they are tried:

* fused layers (`keys.fused`): one original tensor holds the row blocks of several diffusers tensors,
  top to bottom, in the layer's proportions (FLUX's `img_attn.qkv` = `to_q`, `to_k`, `to_v`);
* swapped halves: the same matrix with its two row halves exchanged (FLUX's final modulation emits
  (shift, scale), diffusers' emits (scale, shift));
* tensor renames: whole tensor keys whose own name changes (FLUX's q/k RMSNorm `weight` is `scale`);
* module renames (`keys.renames`, `{i}` a block index): every tensor under the module keeps its leaf
  name (`blocks.{i}.attn1.to_q` renames `blocks.0.attn1.to_q.weight` and `.bias`).

Every diffusers tensor is a row range of exactly one original tensor, so an original tensor converts on
its own (`tensor_to_diffusers`). ComfyUI's fp8 files rely on that: a fused fp8 layer splits into its
parts, each keeping the stored fp8 rows and the layer's per-tensor scale.

A layout is also a name map in the sense of `tuner.networks.keys.NameMap` (diffusers module -> original,
carrying its fused layers, which the adapter exporter fuses), and `layout.inverse` is the original ->
diffusers map that loaders take. Code that receives a name map of either kind converts whole
checkpoints with `original_state_dict` / `diffusers_state_dict` / `diffusers_tensors`: through the
layout when it is one, else key by key through the plain function (architectures whose release only
renames, or uses diffusers' names).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.fused import FusedLayer

NameMap = Callable[[str], str]


@dataclass(frozen=True)
class CheckpointLayout:
    """One architecture's original single-file layout relative to diffusers' (see the module docstring)."""

    keys: ArchitectureKeys
    """Module renames (diffusers, original) and fused layers: the adapter name map's table."""
    tensor_renames: tuple[tuple[str, str], ...] = ()
    """(diffusers tensor key, original tensor key) patterns for tensors whose leaf name changes."""
    swapped_halves: tuple[tuple[str, str], ...] = ()
    """(diffusers module, original module) whose weight and bias rows are the same halves swapped."""
    bundled: tuple[str, ...] = ()
    """Original-name prefixes of other components a release's file holds under the model's own prefix
    (LTX-2's text connectors beside its transformer): not the model's, skipped by its loaders."""
    read_for_dtype: tuple[str, ...] = ()
    """Regexes over diffusers module names of the linear layers whose weight dtype the model reads to cast
    their input (Kandinsky 6's modulation `out_layer`): fp8 storage would make that input fp8, so a ComfyUI
    fp8 file's values for them stay as the loader put them (dequantized). Beside `tuner.fp8.READ_FOR_DTYPE`,
    which every model shares."""

    @cached_property
    def _tensors(self) -> ArchitectureKeys:
        return ArchitectureKeys(f"{self.keys.name} tensor", self.tensor_renames)

    @cached_property
    def _swaps(self) -> ArchitectureKeys:
        return ArchitectureKeys(f"{self.keys.name} swapped", self.swapped_halves)

    # ---- the name map: diffusers module -> original module, with the fused layers -----------------
    @property
    def fused(self) -> tuple[FusedLayer, ...]:
        return self.keys.fused

    def __call__(self, diffusers_name: str) -> str:
        return self.keys(diffusers_name)

    def stem(self, name: str, layout: str) -> str | None:
        """The stem the table names a module itself (`ArchitectureKeys.stem`), or None."""
        return self.keys.stem(name, layout)

    def for_layout(self, layout: str) -> ArchitectureKeys:
        """The table a layout's stems are written from (`ArchitectureKeys.for_layout`)."""
        return self.keys.for_layout(layout)

    @cached_property
    def inverse(self) -> ToDiffusers:
        """original -> diffusers names (what loaders take as `name_map_inverse`), carrying this layout."""
        return ToDiffusers(self)

    # ---- diffusers -> original -------------------------------------------------------------------
    def key_to_original(self, key: str) -> str:
        """The original key of a diffusers tensor key; a part of a fused layer gives the fused key."""
        module, _, leaf = key.rpartition(".")
        if (part := self._fused_part(module)) is not None:
            return f"{part[0]}.{leaf}"
        for table in (self._swaps, self._tensors, self.keys):
            if (name := _lookup(table, key)) is not None:
                return name
        raise KeyError(f"no rule maps {key!r} to the {self.keys.name} original layout")

    def to_original(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A diffusers state dict in the original layout. Raises KeyError for a key outside the layout
        or a fused layer some of whose parts are missing."""
        out: dict[str, torch.Tensor] = {}
        pending: dict[str, list[torch.Tensor | None]] = {}
        for key, value in state_dict.items():
            module, _, leaf = key.rpartition(".")
            if (part := self._fused_part(module)) is not None:
                fused, index, count = part
                pending.setdefault(f"{fused}.{leaf}", [None] * count)[index] = value
            elif (name := _lookup(self._swaps, key)) is not None:
                out[name] = _swap_halves(value)
            else:
                out[self.key_to_original(key)] = value
        for key, parts in pending.items():
            if any(p is None for p in parts):
                raise KeyError(f"{key}: the state dict lacks some of the layers it fuses")
            out[key] = torch.cat(parts)  # type: ignore[arg-type]
        return out

    def _fused_part(self, module: str) -> tuple[str, int, int] | None:
        """(fused original module, part index, number of parts) for a diffusers module in a fused layer."""
        for layer in self.keys.fused:
            if (hit := layer.part_of(module)) is not None:
                return hit[0], hit[1], len(layer.parts)
        return None

    # ---- original -> diffusers -------------------------------------------------------------------
    def tensor_to_diffusers(self, key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """The diffusers tensors one original tensor holds (several for a fused layer, as new tensors:
        parameters sharing one storage cannot be saved with safetensors). Works for any dtype, fp8 too."""
        module, _, leaf = key.rpartition(".")
        for layer in self.keys.fused:
            if (found := layer.resolve(module)) is not None:
                rows = _part_rows(layer, module, value.shape[0])
                return {f"{p}.{leaf}": c.clone() for p, c in zip(found[1], value.split(rows), strict=True)}
        if (name := _lookup(self._swaps, key, inverse=True)) is not None:
            return {name: _swap_halves(value)}
        if (name := _lookup(self._tensors, key, inverse=True)) is not None:
            return {name: value}
        return {self.keys.to_diffusers(key): value}

    def to_diffusers(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An original state dict (no prefix) in diffusers' layout, at any model size. Raises KeyError
        for a key outside the layout."""
        return {
            k: v for key, value in state_dict.items() for k, v in self.tensor_to_diffusers(key, value).items()
        }


@dataclass(frozen=True)
class ToDiffusers:
    """A layout's original -> diffusers name map. Callable on module names like any inverse name map (a
    fused layer has no single diffusers name: KeyError); whole checkpoints convert through `layout`."""

    layout: CheckpointLayout

    def __call__(self, original_name: str) -> str:
        return self.layout.keys.to_diffusers(original_name)


def _lookup(table: ArchitectureKeys, key: str, inverse: bool = False) -> str | None:
    try:
        return table.to_diffusers(key) if inverse else table(key)
    except KeyError:
        return None


def _part_rows(layer: FusedLayer, module: str, rows: int) -> list[int]:
    proportions = layer.proportions or (1,) * len(layer.parts)
    unit, rest = divmod(rows, sum(proportions))
    if rest:
        raise KeyError(f"{module}: {rows} rows do not split into parts of proportions {proportions}")
    return [unit * p for p in proportions]


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first])


# ---------------------------------------------------------------------------------------------------
# Whole checkpoints through whatever name map a caller has
# ---------------------------------------------------------------------------------------------------


def original_state_dict(
    state_dict: Mapping[str, torch.Tensor], name_map: NameMap | None
) -> dict[str, torch.Tensor]:
    """`state_dict` (diffusers keys) in the original layout: through the layout when `name_map` is a
    `CheckpointLayout`, else key by key through `name_map` (identity when None)."""
    if isinstance(name_map, CheckpointLayout):
        return name_map.to_original(state_dict)
    return {rename_key(k, name_map): v for k, v in state_dict.items()}


def diffusers_tensors(
    key: str, value: torch.Tensor, name_map_inverse: NameMap | None
) -> dict[str, torch.Tensor]:
    """The diffusers tensors an original tensor holds: through the layout when `name_map_inverse` is a
    layout's `inverse`, else the one tensor renamed by `name_map_inverse` (identity when None)."""
    if isinstance(name_map_inverse, ToDiffusers):
        return name_map_inverse.layout.tensor_to_diffusers(key, value)
    return {rename_key(key, name_map_inverse): value}


def diffusers_state_dict(
    state_dict: Mapping[str, torch.Tensor], name_map_inverse: NameMap | None
) -> dict[str, torch.Tensor]:
    """`state_dict` (original keys, no prefix) in diffusers' layout; see `diffusers_tensors`. A layout
    converts the whole checkpoint at once (`CheckpointLayout.to_diffusers`), so one whose rules depend on
    other tensors (SD3's pre-only block, told by its modulation weight's shape) sees them all."""
    if isinstance(name_map_inverse, ToDiffusers):
        return name_map_inverse.layout.to_diffusers(state_dict)
    return {
        k: v
        for key, value in state_dict.items()
        for k, v in diffusers_tensors(key, value, name_map_inverse).items()
    }


def rename_key(key: str, name_map: NameMap | None) -> str:
    """A tensor key through a module-name map: the whole key if the map knows it (Wan's tables do),
    else its module part with the leaf name kept (`<module>.weight`)."""
    if name_map is None:
        return key
    try:
        return name_map(key)
    except KeyError:
        module, _, leaf = key.rpartition(".")
        return f"{name_map(module)}.{leaf}"
