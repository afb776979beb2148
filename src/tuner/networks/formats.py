"""Adapter files in the key layouts of `keys.py`: reading any of them, writing any of them.

A file holds, per module, `<stem>.<suffix>` tensors. The stems are described in `keys.py`; the suffixes:

| tensor         | comfy                         | kohya                            | diffusers / PEFT                  |
|----------------|-------------------------------|----------------------------------|-----------------------------------|
| LoRA down, up  | `lora_A.weight lora_B.weight` | `lora_down.weight lora_up.weight`| `lora_A.weight lora_B.weight`     |
| LoHa           | `hada_w1_a hada_w1_b hada_w2_a hada_w2_b` | the same             | its exact LoRA form (`delta.py`)  |
| LoKr           | `lokr_w1` or `lokr_w1_a lokr_w1_b`, the same for w2 | the same   | its exact LoRA form               |
| alpha          | `alpha` (fp32 scalar)         | `alpha`                          | none: folded into `lora_B`        |
| DoRA magnitude | `dora_scale` [1, in] / [out, 1] | `dora_scale`                   | `lora_magnitude_vector.weight` [out] |

The diffusers layout has no alpha (PEFT computes W + lora_B @ lora_A), so the scale s = alpha / rank is
multiplied into lora_B and every loader applies the same update. tuner records the alpha it folded in
its metadata (`tuner.folded_alpha`), so converting back restores the original tensors: bit for bit when
s is a power of two (alpha = rank, rank / 2, 1 with a power-of-two rank...), else to fp32 rounding.
`comfy_folded` is the comfy layout written the same way (LoRA only, the scale in lora_B, no `.alpha`
keys, which ComfyUI reads as scale 1): diffusers' loaders that refuse `.alpha` keys but convert the
release's names (LTX-Video, LTX-2, HiDream, FLUX.2) read it too.
PEFT knows only per-row DoRA magnitudes; a per-column DoRA (tuner's own, see `dora.py`) has no exact
diffusers form and is refused there. In the comfy and kohya layouts the parts of a fused layer (FLUX's
`qkv`, `linear1`) are written as one fused adapter, except when they carry per-column DoRA: then each
part is written under its diffusers name (`transformer.<name>` in comfy files, `lora_transformer_<name
with "_">` in kohya files), names ComfyUI maps onto the fused weight's rows (see `fused.py`).

The `musubi` layout is kohya's spelling of musubi-tuner's module names, for the architectures where they
are not ComfyUI's (`kohya` is ComfyUI's, which musubi-tuner reads too wherever the two agree; a file of
either reads back). musubi-tuner names an adapter `lora_unet_` + its model's module name with "_"
(`create_modules` in `musubi_tuner/networks/lora.py`) and loads a file with `load_state_dict(strict=False)`,
so a key its model lacks is dropped without an error. Its Z-Image model (`musubi_tuner/zimage/
zimage_model.py`, adapted by `networks/lora_zimage.py`) and FramePack model (`networks/lora_framepack.py`
targets diffusers' block classes) keep diffusers' names: q, k and v unfused (`attention_to_q`,
`attention_to_out_0`; `MUSUBI_DIFFUSERS_NAMES`), where ComfyUI's `kohya` names are the
release's fused `attention_qkv` / `attention_out`. For HunyuanVideo musubi-tuner keeps the release's
`img_mlp_fc1`, where ComfyUI's is `img_mlp_0` (`kohya_names`). Where its model has names and fused layers of
its own, the name map carries musubi's table (`ArchitectureKeys.musubi`, taken through `keys.layout_name_map`):
HunyuanVideo 1.5's is Tencent's release, q, k and v apart (`img_attn_q`) where ComfyUI fuses them.
Elsewhere `musubi` writes what `kohya` writes: the architectures musubi-tuner does not train as well, so
one setting fits every run.

Where the layouts load (measured; `save.format = "auto"` picks, per architecture, one ComfyUI loads, see
`Architecture.save_format`; every architecture's answer per tool is `receivers.py`'s table):

- Wan 2.1: comfy in both (diffusers converts original-layout Wan files itself). ComfyUI does not map
  diffusers' Wan names.
- FLUX.1: kohya in both (diffusers' kohya FLUX converter splits the fused layers again); comfy loads in
  ComfyUI only (diffusers ignores it with a warning); diffusers in both.
- Qwen-Image: comfy in both (the release's module names are diffusers' own).

diffusers takes LoRA only (LoHa and LoKr load there only in the diffusers layout, as their exact LoRA
form) and drops `dora_scale` with a warning.

Files are read strictly: every key must be a known adapter tensor, so a file of another kind (or a conv
adapter) is refused with the keys named instead of being half-loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from tuner.errors import CheckpointError, TunerError
from tuner.networks.delta import (
    KIND_NAMES,
    LOHA,
    LOKR,
    LORA,
    ROLES,
    ModuleWeights,
    dora_norm_dim,
    to_lora,
    validate,
)
from tuner.networks.fused import FUSED_METADATA, FusedParts, fusable, fuse, group_parts
from tuner.networks.keys import (
    COMFY_PREFIX,
    DIFFUSERS_PREFIXES,
    KOHYA_PREFIXES,
    KOHYA_TEXT_PREFIXES,
    NameMap,
    describe_source,
    identity_name_map,
    layout_name_map,
    own_stem,
    read_safetensors,
    split_keys,
)

Layout = Literal["comfy", "comfy_folded", "diffusers", "kohya", "musubi"]
LAYOUTS: tuple[str, ...] = ("comfy", "comfy_folded", "diffusers", "kohya", "musubi")
FOLDED = ("diffusers", "comfy_folded")  # LoRA only, alpha folded into lora_B: no `.alpha` keys
KOHYA_SPELLED = ("kohya", "musubi")  # `lora_unet_` stems with "_", `lora_down` / `lora_up` / `alpha`
FOLDED_ALPHA = "tuner.folded_alpha"
KOHYA_PREFIX, KOHYA_TRANSFORMER_PREFIX = KOHYA_PREFIXES  # original names, diffusers names
DIFFUSERS_PREFIX = DIFFUSERS_PREFIXES[0]

# File suffix -> role. Several suffixes may share a role; longer suffixes first, so
# `lora_magnitude_vector.weight` is not taken for `lora_magnitude_vector`.
_COMMON_SUFFIXES = {
    "alpha": "alpha",
    "dora_scale": "dora_scale",
    "lora_magnitude_vector.weight": "dora_scale",
    "lora_magnitude_vector": "dora_scale",
}
_KIND_SUFFIXES = {
    LORA: {
        "lora_A.weight": "down",
        "lora_down.weight": "down",
        "lora_B.weight": "up",
        "lora_up.weight": "up",
    },
    LOHA: {role: role for role in ROLES[LOHA]},
    LOKR: {role: role for role in ROLES[LOKR]},
}
_KIND_OF_ROLE = {role: kind for kind, roles in ROLES.items() for role in roles}


def layout_of(stem: str) -> str:
    """The layout a stem is written in, by its prefix: comfy, kohya, diffusers or unknown."""
    if stem.startswith(COMFY_PREFIX):
        return "comfy"
    if stem.startswith(KOHYA_PREFIXES + KOHYA_TEXT_PREFIXES):
        return "kohya"
    if stem.startswith(DIFFUSERS_PREFIXES):
        return "diffusers"
    return "unknown"


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------


def read_modules(
    source: str | os.PathLike | Mapping[str, torch.Tensor], kinds: Iterable[str] | None = None
) -> tuple[dict[str, ModuleWeights], dict[str, str]]:
    """Every module of an adapter file (or state dict) by its stem as written, and the file's metadata.
    `kinds` limits the adapter types accepted (others are reported as unknown keys)."""
    if isinstance(source, Mapping):
        tensors, metadata = dict(source), {}
    else:
        tensors, metadata = read_safetensors(source)
    return parse_modules(tensors, metadata, describe_source(source), kinds), metadata


def parse_modules(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    where: str,
    kinds: Iterable[str] | None = None,
) -> dict[str, ModuleWeights]:
    kinds = tuple(kinds or ROLES)
    suffixes = {s: r for k in kinds for s, r in _KIND_SUFFIXES[k].items()} | _COMMON_SUFFIXES
    what = "/".join(KIND_NAMES[k] for k in kinds) if len(kinds) < len(ROLES) else "adapter"
    peft_alpha = _peft_alpha(metadata, where)
    folded = _read_per_module(metadata.get(FOLDED_ALPHA), where)
    modules = {}
    for stem, roles in split_keys(tensors, suffixes, what, where).items():
        alpha = roles.pop("alpha", None)
        dora = roles.pop("dora_scale", None)
        found = {_KIND_OF_ROLE[r] for r in roles}
        if len(found) != 1:
            raise CheckpointError(
                f"{where}: module {stem!r} has "
                + (f"tensors of several adapter types {sorted(roles)}" if found else "no adapter tensors")
            )
        kind = found.pop()
        _require_roles(kind, roles, stem, where)
        weights = ModuleWeights(kind, roles, float(alpha.item()) if alpha is not None else None)
        if dora is not None:
            weights.dora_scale = dora.float().reshape(-1, 1) if dora.ndim == 1 else dora.float()
        if weights.alpha is None and stem.startswith(DIFFUSERS_PREFIXES):
            weights.alpha = _unfold(weights, folded, stem) if folded is not None else peft_alpha
        elif weights.alpha is None and folded is not None and stem.startswith(COMFY_PREFIX):  # comfy_folded
            weights.alpha = _unfold(weights, folded, stem)
        validate(weights, where, stem)
        modules[stem] = weights
    return modules


def _require_roles(kind: str, roles: Mapping[str, torch.Tensor], stem: str, where: str) -> None:
    if kind == LOKR:
        missing = [f"w{w}" for w in "12" if f"lokr_w{w}" not in roles and f"lokr_w{w}_a" not in roles]
    else:
        missing = [r for r in ROLES[kind] if r not in roles]
    if missing:
        raise CheckpointError(f"{where}: {KIND_NAMES[kind]} module {stem!r} lacks {missing}")


def _unfold(weights: ModuleWeights, folded: float | dict, stem: str) -> float | None:
    """Undo tuner's alpha folding of a diffusers-layout file: restore alpha, divide it out of up."""
    name = stem.split(".", 1)[1]
    alpha = folded.get(name) if isinstance(folded, dict) else folded
    if alpha is None:
        return None
    scale = alpha / weights.rank
    if scale != 1.0:
        weights.tensors["up"] = weights.tensors["up"].float() / scale
    return float(alpha)


def _peft_alpha(metadata: Mapping[str, str], where: str) -> float | None:
    """The `lora_alpha` diffusers stores in `lora_adapter_metadata` (keys optionally prefixed with
    `transformer.` when saved by a pipeline). Per-module alpha patterns are refused rather than
    silently ignored."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: lora_adapter_metadata is not JSON: {e}") from e
    config = {key.removeprefix("transformer."): value for key, value in config.items()}
    if config.get("alpha_pattern"):
        raise CheckpointError(f"{where}: per-module alphas (PEFT alpha_pattern) are not supported")
    alpha = config.get("lora_alpha")
    return float(alpha) if alpha else None


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------


def module_tensors(weights: ModuleWeights, layout: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One module's tensors keyed by suffix. For the diffusers layout, `weights` must already be a LoRA
    with its scale folded in (see `layout_state`). alpha and DoRA magnitudes stay fp32 whatever
    `dtype`: readers take alpha with .item(), and bf16 would round values such as 0.3."""
    if weights.kind == LORA:
        down, up = (
            ("lora_down.weight", "lora_up.weight")
            if layout in KOHYA_SPELLED
            else ("lora_A.weight", "lora_B.weight")
        )
        out = {down: weights.tensors["down"], up: weights.tensors["up"]}
    elif layout in FOLDED:
        raise TunerError(f"the {layout} layout stores LoRA only, not {KIND_NAMES[weights.kind]}")
    else:
        out = dict(weights.tensors)
    out = {k: v.detach().to(device="cpu", dtype=dtype) for k, v in out.items()}
    if layout not in FOLDED:
        # Every module gets an explicit alpha (LyCORIS's loader requires one): alpha / rank is the scale,
        # and a LoKr with two full factors has no rank and scale 1, which alpha 1 states.
        alpha = 1.0 if weights.rank is None else weights.alpha or float(weights.rank)
        out["alpha"] = torch.tensor(alpha, dtype=torch.float32)
    if weights.dora_scale is not None:
        magnitude = weights.dora_scale.detach().to(device="cpu", dtype=torch.float32)
        if layout == "diffusers":
            out["lora_magnitude_vector.weight"] = magnitude.flatten()
        else:
            out["dora_scale"] = magnitude
    return out


def original_modules(
    modules: Mapping[str, ModuleWeights], name_map: NameMap | None = None
) -> tuple[dict[str, ModuleWeights | FusedParts], dict[str, list]]:
    """The modules under their original-release names (what comfy and kohya stems are made of): the
    name map renames, and the fused layers it declares (a `fused` attribute, see `fused.py`) are built
    from their parts, or kept as `FusedParts` when no fused adapter is exact. Also returns the fused
    layers' split records for the metadata."""
    name_map = name_map or identity_name_map
    groups, plain = group_parts(list(modules), getattr(name_map, "fused", ()))
    out: dict[str, ModuleWeights | FusedParts] = {}
    owner: dict[str, str] = {}
    for name in plain:
        original = name_map(name)
        if original in owner:
            raise TunerError(f"the name map sends both {owner[original]} and {name} to {original}")
        owner[original] = name
        out[original] = modules[name]
    records = {}
    for original, parts in groups.items():
        weights = [modules[p] for p in parts if p]
        if fusable(weights):
            out[original], records[original] = fuse(weights)
        else:
            out[original] = FusedParts(original, {p: modules[p] for p in parts if p})
    return out, records


def layout_state(
    modules: Mapping[str, ModuleWeights],
    layout: str,
    name_map: NameMap | None = None,
    *,
    prefix: str = COMFY_PREFIX,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file tensors of `modules` (keyed by diffusers module name) in `layout`, and the metadata the
    layout needs to be read back exactly. comfy stems are `prefix` + original name."""
    if layout not in LAYOUTS:
        raise TunerError(f"unknown adapter layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    state: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    name_map = layout_name_map(name_map, layout)
    own = {name: stem for name in modules if (stem := own_stem(name_map, name, layout)) is not None}
    if layout == "comfy_folded":
        modules = {name: to_lora(weights) for name, weights in modules.items()}
    if layout == "diffusers":
        folded = {}
        for name, weights in modules.items():
            lora = _fold(to_lora(weights), name)
            folded[name] = weights.scale * lora.rank
            for suffix, tensor in module_tensors(lora, layout, dtype).items():
                state[f"{own.get(name, DIFFUSERS_PREFIX + name)}.{suffix}"] = tensor
        metadata[FOLDED_ALPHA] = uniform_or_json(folded)
        return state, metadata
    stems: dict[str, ModuleWeights] = {stem: modules[name] for name, stem in own.items()}
    originals, records = original_modules({n: w for n, w in modules.items() if n not in own}, name_map)
    for original, weights in originals.items():
        if isinstance(weights, FusedParts):
            stems |= {part_stem(name, layout): part for name, part in weights.parts.items()}
        elif layout in ("comfy", "comfy_folded"):
            stems[prefix + original] = weights
        else:
            stems[KOHYA_PREFIX + original.replace(".", "_")] = weights
    if layout == "comfy_folded":  # as diffusers' layout: the scale in lora_B, the alpha in the metadata
        metadata[FOLDED_ALPHA] = uniform_or_json(
            {s.split(".", 1)[1]: w.scale * w.rank for s, w in stems.items()}
        )
        stems = {stem: _fold(weights, stem) for stem, weights in stems.items()}
    for stem, weights in stems.items():
        for suffix, tensor in module_tensors(weights, layout, dtype).items():
            state[f"{stem}.{suffix}"] = tensor
    if records:
        metadata[FUSED_METADATA] = json.dumps(records)
    return state, metadata


def part_stem(name: str, layout: str) -> str:
    """The stem of a fused layer's part written apart (`FusedParts`): its diffusers name, spelled as the
    layout's other keys are (ComfyUI maps both spellings onto the fused weight's rows for FLUX)."""
    if layout in KOHYA_SPELLED:
        return KOHYA_TRANSFORMER_PREFIX + name.replace(".", "_")
    return DIFFUSERS_PREFIX + name


def _fold(lora: ModuleWeights, name: str) -> ModuleWeights:
    if lora.dora_scale is not None and dora_norm_dim(lora.dora_scale) != 1:
        raise TunerError(
            f"{name}: a column-wise DoRA (dora_scale [1, in]) has no diffusers/PEFT form (PEFT's magnitudes "
            "are per row); save it in the comfy or kohya layout"
        )
    up = lora.tensors["up"].float()
    scale = lora.scale
    tensors = {"down": lora.tensors["down"], "up": up * scale if scale != 1.0 else up}
    return ModuleWeights(LORA, tensors, None, lora.dora_scale)


def describe_modules(modules: Mapping[str, ModuleWeights], layout: str = "comfy") -> dict[str, str]:
    """File metadata summarising the modules as `layout` stores them: adapter type, rank and alpha (one
    value, or JSON per module), DoRA. The folded layouts store LoHa and LoKr as LoRA; the type they
    were trained as is kept in `tuner.trained_as`."""
    metadata = {}
    if layout in FOLDED:
        trained = _network_type(modules)
        modules = {name: to_lora(w) for name, w in modules.items()}
        if trained != LORA:
            metadata["tuner.trained_as"] = trained
    metadata |= {
        "tuner.network_type": _network_type(modules),
        "tuner.rank": uniform_or_json({n: w.rank or "full" for n, w in modules.items()}),
    }
    alphas = {n: w.alpha for n, w in modules.items() if w.rank and w.alpha}
    if alphas:
        metadata["tuner.alpha"] = uniform_or_json(alphas)
    if any(w.dora_scale is not None for w in modules.values()):
        metadata["tuner.dora"] = "true"
    return metadata


def _network_type(modules: Mapping[str, ModuleWeights]) -> str:
    kinds = {w.kind for w in modules.values()}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def uniform_or_json(values: Mapping[str, float | int]) -> str:
    """One value when all modules share it (the usual case), else a JSON object per module."""
    distinct = set(values.values())
    return str(distinct.pop()) if len(distinct) == 1 else json.dumps(dict(values))


def _read_per_module(raw: str | None, where: str) -> float | dict | None:
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: metadata {FOLDED_ALPHA} is neither a number nor JSON: {e}") from e
