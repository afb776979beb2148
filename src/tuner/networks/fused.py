"""Fused layers: one linear layer of the original release that diffusers splits into several.

FLUX keeps q, k and v of an attention in one `qkv` linear layer (and q, k, v and the MLP input in
`linear1`); HunyuanVideo does the same. diffusers splits them into `to_q`, `to_k`, `to_v`, and so do our
adapters, but ComfyUI builds its key map from the original layout and has no key for `to_q` alone. So
the exporter writes one adapter for the fused layer, built exactly from the separate ones:

    fused(x) = [q(x); k(x); v(x)]      so      ΔW_qkv = [ΔW_q; ΔW_k; ΔW_v]   (rows stacked)

and with ΔW_p = s_p · B_p A_p this is itself a LoRA of rank r_q + r_k + r_v:

    down = [A_q; A_k; A_v]  (concatenated)        up = blockdiag(B_q, B_k, B_v)

since the up row-block of q only meets the down rows of q. Parts with different scales s_p are made
exact by folding s_p into their up block (the fused alpha then gives scale 1); with one shared scale
nothing is folded and the fused alpha is s · (r_q + r_k + r_v). LoHa and LoKr parts are first written in
their exact LoRA form (`delta.to_lora`). Row-wise DoRA magnitudes stack like the rows.

Column-wise DoRA (tuner's own, see `dora.py`) cannot be fused: each part normalises its columns over its
own rows, a fused DoRA over all rows together. Such a group is kept apart (`FusedParts`) and written as
one adapter per part under its diffusers name: ComfyUI maps FLUX's diffusers module names onto row
slices of the fused weight (`transformer.<name>`, `lora_transformer_<name with "_">`) and applies each
adapter, DoRA included, to its own slice, which is exactly what the parts compute.

Each architecture supplies its fused layers as data (`FusedLayer`), alongside its name map (see
`architectures.py`). Reading goes the other way: a fused adapter is split into one per part. The split
is exact for tuner's files, whose metadata (`tuner.fused`) records each part's rank and alpha; a fused
adapter from another tool gives every part the whole down matrix and its own rows of up.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from tuner.errors import CheckpointError, TunerError
from tuner.networks.delta import LORA, ModuleWeights, dora_norm_dim, to_lora

FUSED_METADATA = "tuner.fused"


@dataclass(frozen=True)
class FusedLayer:
    """One fused linear layer: its original name and the diffusers modules that are its row blocks."""

    original: str
    """Original-release module name; `{i}` stands for a block index, e.g. `double_blocks.{i}.img_attn.qkv`."""
    parts: tuple[str, ...]
    """diffusers module names of the row blocks, top to bottom, e.g. `transformer_blocks.{i}.attn.to_q`."""
    proportions: tuple[int, ...] | None = None
    """Relative row counts of the parts (default: equal); used to split a fused file from another tool."""

    @cached_property
    def _part_patterns(self) -> list[re.Pattern[str]]:
        return [_compile(p) for p in self.parts]

    @cached_property
    def _original_patterns(self) -> tuple[re.Pattern[str], re.Pattern[str]]:
        return _compile(self.original), _compile(self.original.replace(".", "_"))

    def part_of(self, name: str) -> tuple[str, int] | None:
        """(fused original name, part index) when `name` is one of this layer's parts."""
        for index, pattern in enumerate(self._part_patterns):
            if m := pattern.fullmatch(name):
                return _fill(self.original, m), index
        return None

    def resolve(self, body: str, kohya: bool = False) -> tuple[str, list[str]] | None:
        """(original name, part names) when `body` (a stem without its prefix; with `kohya`, in kohya's
        underscore spelling) names this fused layer, else None."""
        m = self._original_patterns[kohya].fullmatch(body)
        return None if m is None else (_fill(self.original, m), [_fill(p, m) for p in self.parts])


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)"))


def _fill(pattern: str, m: re.Match[str]) -> str:
    return pattern.replace("{i}", m.groupdict().get("i") or "")


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------


def group_parts(
    names: Sequence[str], fused: Sequence[FusedLayer]
) -> tuple[dict[str, list[str | None]], list[str]]:
    """Split module names into fused groups ({fused original name: part names in row order}) and the
    names that belong to no fused layer. A group with a missing part is an error: the fused layer's
    adapter would have to invent the missing rows' size."""
    groups: dict[str, list[str | None]] = {}
    plain = []
    for name in names:
        for layer in fused:
            if (hit := layer.part_of(name)) is not None:
                original, index = hit
                groups.setdefault(original, [None] * len(layer.parts))[index] = name
                break
        else:
            plain.append(name)
    for original, parts in groups.items():
        if None in parts:
            have = [p for p in parts if p]
            raise TunerError(
                f"the original layout fuses {original} from {len(parts)} layers but only {have} are adapted; "
                "adapt all of them or none (network.include / exclude)"
            )
    return groups, plain


@dataclass
class FusedParts:
    """The parts of a fused layer kept as separate adapters, because no one adapter of the fused layer
    computes exactly what they do (see `fusable`). It updates the fused weight row block by row block."""

    original: str
    """The fused layer's original name."""
    parts: dict[str, ModuleWeights]
    """By diffusers module name, in row order."""

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in) of the fused weight."""
        shapes = [weights.shape for weights in self.parts.values()]
        return sum(rows for rows, _ in shapes), shapes[0][1]

    def effective_delta(self, weight: torch.Tensor | None) -> torch.Tensor:
        """What the parts add to the fused `weight` at strength 1 (fp32): each its own rows."""
        deltas, row = [], 0
        for weights in self.parts.values():
            rows = weights.shape[0]
            deltas.append(weights.effective_delta(None if weight is None else weight[row : row + rows]))
            row += rows
        return torch.cat(deltas)


def fusable(parts: Sequence[ModuleWeights]) -> bool:
    """Whether one adapter of the fused layer computes exactly what `parts` do: none carries DoRA, or
    all carry per-row magnitudes (which stack like the rows)."""
    magnitudes = [p.dora_scale for p in parts]
    return all(m is None for m in magnitudes) or all(
        m is not None and dora_norm_dim(m) == 1 for m in magnitudes
    )


def fuse(parts: Sequence[ModuleWeights]) -> tuple[ModuleWeights, list[list]]:
    """The exact adapter of the fused layer whose row blocks the `parts` adapt; and what `split` needs to
    undo it ([rank, rows, alpha] per part)."""
    loras = [to_lora(p) for p in parts]
    scales = [p.scale for p in loras]
    downs = [p.tensors["down"].float() for p in loras]
    ups = [p.tensors["up"].float() for p in loras]
    total_rank = sum(d.shape[0] for d in downs)
    if len(set(scales)) == 1:
        alpha = scales[0] * total_rank
    else:  # fold each part's scale into its rows; the fused scale is 1
        alpha = float(total_rank)
        ups = [u * s for u, s in zip(ups, scales)]
    dora = _stack_magnitudes([p.dora_scale for p in loras])
    tensors = {"down": torch.cat(downs), "up": torch.block_diag(*ups)}
    record = [[d.shape[0], u.shape[0], p.alpha] for d, u, p in zip(downs, ups, loras)]
    return ModuleWeights(LORA, tensors, alpha, dora), record


def _stack_magnitudes(magnitudes: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(m is None for m in magnitudes):
        return None
    if any(m is None or dora_norm_dim(m) != 1 for m in magnitudes):
        raise TunerError(
            "a fused layer can carry DoRA only when all its parts have per-row magnitudes; write parts with "
            "column-wise DoRA apart (FusedParts)"
        )
    return torch.cat([m.float() for m in magnitudes])


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------


def split(
    weights: ModuleWeights, names: Sequence[str], layer: FusedLayer, record: Sequence | None
) -> dict[str, ModuleWeights]:
    """One adapter per part of a fused adapter. `record` is what `fuse` returned (from the file's
    metadata); without it every part shares the whole down matrix (exact, at the fused rank)."""
    lora = to_lora(weights)
    down, up = lora.tensors["down"], lora.tensors["up"]
    rows = _part_rows(up.shape[0], layer, record, len(names))
    out: dict[str, ModuleWeights] = {}
    row0 = rank0 = 0
    for index, (name, n_rows) in enumerate(zip(names, rows)):
        dora = None
        if lora.dora_scale is not None:
            if dora_norm_dim(lora.dora_scale) != 1:
                raise CheckpointError(f"{name}: a column-wise DoRA of a fused layer cannot be split")
            dora = lora.dora_scale[row0 : row0 + n_rows]
        if record is None:
            part = ModuleWeights(LORA, {"down": down, "up": up[row0 : row0 + n_rows]}, lora.alpha, dora)
        else:
            rank, _, alpha = record[index]
            part_up = up[row0 : row0 + n_rows, rank0 : rank0 + rank]
            part = ModuleWeights(LORA, {"down": down[rank0 : rank0 + rank], "up": part_up}, alpha, dora)
            if not math.isclose(part.scale, lora.scale, rel_tol=1e-12):  # fuse folded its scale into its rows
                part.tensors["up"] = part_up / (part.scale / lora.scale)
            rank0 += rank
        out[name] = part
        row0 += n_rows
    return out


def _part_rows(total: int, layer: FusedLayer, record: Sequence | None, n_parts: int) -> list[int]:
    if record is not None:
        rows = [int(r[1]) for r in record]
    else:
        proportions = layer.proportions or (1,) * n_parts
        unit, rest = divmod(total, sum(proportions))
        rows = [unit * p for p in proportions] if not rest else []
    if sum(rows) != total or len(rows) != n_parts:
        raise CheckpointError(
            f"{layer.original}: cannot split {total} fused rows into {n_parts} parts {layer.parts}"
        )
    return rows


def expand_fused(
    modules: Mapping[str, ModuleWeights],
    fused: Sequence[FusedLayer],
    metadata: Mapping[str, str],
    comfy_prefix: str,
    kohya_prefixes: Sequence[str],
) -> dict[str, ModuleWeights]:
    """Replace every fused stem (comfy or kohya spelling) of `modules` with diffusers stems
    (`transformer.<part>`) of its parts; other stems are kept as they are."""
    if not fused:
        return dict(modules)
    records = json.loads(metadata.get(FUSED_METADATA, "{}"))
    out: dict[str, ModuleWeights] = {}
    for stem, weights in modules.items():
        found = _fused_stem(stem, fused, comfy_prefix, kohya_prefixes)
        if found is None:
            out[stem] = weights
            continue
        layer, original, names = found
        for name, part in split(weights, names, layer, records.get(original)).items():
            out["transformer." + name] = part
    return out


def _fused_stem(stem: str, fused: Sequence[FusedLayer], comfy_prefix: str, kohya_prefixes: Sequence[str]):
    candidates = [(stem.removeprefix(comfy_prefix), False)] if stem.startswith(comfy_prefix) else []
    candidates += [(stem.removeprefix(p), True) for p in kohya_prefixes if stem.startswith(p)]
    for body, kohya in candidates:
        for layer in fused:
            if (found := layer.resolve(body, kohya)) is not None:
                return layer, *found
    return None
