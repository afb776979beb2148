"""`tuner lora merge`: fold adapters into a model single file, at chosen strengths.

For each adapted weight W and adapter i at strength t_i, W <- W + t_i · ΔW_i, applied in the order given
(a DoRA adapter's ΔW depends on the weight it meets, as it does in ComfyUI: W' - W with
W' = m (W + ΔW) / ‖W + ΔW‖). The sums are taken in fp32 and cast back once at the end, so merging
several adapters into a bf16 model rounds each weight once. The result keeps the input's layout (the
original release's key names, any ComfyUI prefix, tensors the adapters do not touch); with `fp8` its
weight matrices are written as scaled fp8 (see `checkpoint.py`).

Adapters may be in any layout. comfy and kohya stems name original modules and are looked up in the
checkpoint itself (kohya's underscores are matched against the checkpoint's module names, so no table
is needed); diffusers stems need the architecture's name table (`--arch`, or the adapter's metadata, or
the one table that fits), which also fuses q/k/v adapters for originals that keep them as one matrix
(parts with column-wise DoRA are applied to their own rows of it, as ComfyUI does). A checkpoint that
is itself in diffusers' names (FramePack's release, lllyasviel's class) takes every adapter, of any
layout, through the table to those names, unfused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from tuner.dtypes import DTYPES
from tuner.errors import CheckpointError
from tuner.io import save_safetensors
from tuner.networks.architectures import architecture_keys, canonical_modules, detect_architecture
from tuner.networks.delta import ModuleWeights
from tuner.networks.formats import layout_of, original_modules, read_modules
from tuner.networks.fused import FusedParts
from tuner.networks.keys import COMFY_PREFIX, KOHYA_PREFIXES
from tuner.tools.checkpoint import Checkpoint, quantize_scaled_fp8, read_checkpoint


def merge_adapters(
    model: str | os.PathLike,
    adapters: Sequence[tuple[str, float]],
    out: str | os.PathLike,
    *,
    fp8: bool = False,
    dtype: str | None = None,
    arch: str | None = None,
) -> dict[str, int]:
    """Merge `adapters` ((path, strength) pairs) into the checkpoint `model` and write `out` atomically.
    `dtype` recasts the model's floating tensors (default: as stored; a scaled-fp8 input comes back in
    its other tensors' dtype). Returns the number of weights each adapter changed."""
    checkpoint = read_checkpoint(model)
    work: dict[str, torch.Tensor] = {}  # stored key -> fp32 weight being merged into
    changed = {}
    for path, strength in adapters:
        originals, outside = _original_modules(path, checkpoint, arch)
        for (key, part, parts), weights in outside.items():  # SDXL's text encoders, in a bundled file
            if key not in checkpoint.tensors:
                raise CheckpointError(f"{path}: its text-encoder parts merge into a bundled checkpoint that holds "
                                      f"the text encoders; {model} has no {key}")  # fmt: skip
            weight = work.get(key)
            if weight is None:
                weight = work[key] = checkpoint.tensors[key].float()
            rows = weight.chunk(parts)[part]  # a view: q, k or v of a fused in_proj, else the whole weight
            if tuple(rows.shape) != weights.shape:
                raise CheckpointError(f"{path}: {key} does not fit its adapter's {weights.shape} update")
            rows += strength * weights.effective_delta(rows)
        for module, weights in originals.items():
            key = checkpoint.stored[module + ".weight"]
            weight = work.get(key)
            if weight is None:
                weight = work[key] = checkpoint.tensors[key].float()
            if tuple(weight.shape) != weights.shape:
                raise CheckpointError(
                    f"{path}: {module} updates a {weights.shape} weight, the checkpoint's is {tuple(weight.shape)}"
                )
            weight += strength * weights.effective_delta(weight)
        changed[str(path)] = len(originals) + len(outside)
    for key, weight in work.items():
        checkpoint.tensors[key] = weight.to(checkpoint.tensors[key].dtype)
    if dtype:
        for stored_key in checkpoint.stored.values():
            tensor = checkpoint.tensors[stored_key]
            if tensor.is_floating_point():
                checkpoint.tensors[stored_key] = tensor.to(DTYPES[dtype])
    tensors = quantize_scaled_fp8(checkpoint) if fp8 else checkpoint.tensors
    metadata = {
        **checkpoint.metadata,
        "tuner.merged_adapters": json.dumps([[Path(p).name, s] for p, s in adapters]),
    }
    save_safetensors(tensors, out, metadata=metadata)
    return changed


def _original_modules(
    path: str, checkpoint: Checkpoint, arch: str | None
) -> tuple[dict[str, ModuleWeights | FusedParts], dict[tuple[str, int, int], ModuleWeights]]:
    """The adapter's modules by the checkpoint's (original) module names; the parts of a fused layer
    that carry column-wise DoRA stay apart (`FusedParts`) and update the fused weight's rows each. Also
    the modules of models beside the component (SDXL's text encoders), by the table's
    `checkpoint_weight(name)`: (stored key, part, parts) of the rows they update."""
    modules, metadata = read_modules(path)
    names = checkpoint.modules()
    kohya_index = _kohya_index(names)
    out: dict[str, ModuleWeights | FusedParts] = {}
    outside: dict[tuple[str, int, int], ModuleWeights] = {}
    via_table: dict[str, ModuleWeights] = {}
    for stem, weights in modules.items():
        layout = layout_of(stem)
        if layout == "comfy" and (body := stem.removeprefix(COMFY_PREFIX)) in names:
            out[body] = weights
        elif (
            layout == "kohya"
            and stem.startswith(KOHYA_PREFIXES)
            and (body := _kohya_body(stem)) in kohya_index
        ):
            if len(kohya_index[body]) > 1:
                raise CheckpointError(f"{path}: {stem} fits several modules: {sorted(kohya_index[body])}")
            out[next(iter(kohya_index[body]))] = weights
        else:
            via_table[stem] = weights
    if via_table:
        context = [COMFY_PREFIX + name for name in names]  # the checkpoint's modules decide ties
        keys = (
            architecture_keys(arch) if arch else detect_architecture(via_table, metadata, str(path), context)
        )
        canonical = canonical_modules(via_table, keys, metadata, str(path))
        if weight_of := getattr(keys, "checkpoint_weight", None):
            outside = {found: canonical.pop(name) for name in list(canonical) if (found := weight_of(name))}
        # a checkpoint saved in diffusers' names (FramePack's release) takes the modules as they are
        diffusers_names = all(name in names for name in canonical)
        for module, weights in (
            canonical if diffusers_names else original_modules(canonical, keys)[0]
        ).items():
            if module in out:
                raise CheckpointError(f"{path}: {module} is stored twice (under several names)")
            out[module] = weights
    unknown = [m for m in out if m not in names]
    if unknown:
        raise CheckpointError(
            f"{path}: {len(unknown)} adapted modules are not in the checkpoint, e.g. {unknown[:5]} "
            "(another architecture or variant?)"
        )
    return out, outside


def _kohya_body(stem: str) -> str:
    return next(stem.removeprefix(p) for p in KOHYA_PREFIXES if stem.startswith(p))


def _kohya_index(names: Mapping[str, object] | set[str]) -> dict[str, set[str]]:
    index: dict[str, set[str]] = {}
    for name in names:
        index.setdefault(name.replace(".", "_"), set()).add(name)
    return index
