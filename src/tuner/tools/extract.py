"""`tuner lora extract`: a LoRA from the difference between two checkpoints, by SVD.

For every weight matrix that differs, D = W_tuned - W_base is factored by the singular value
decomposition D = U diag(S) Vᵀ. Keeping the r largest singular values gives the best rank-r
approximation of D (Eckart-Young): up = U_r diag(√S_r), down = diag(√S_r) V_rᵀ, alpha = r (scale 1). The
square root is split between the two sides so both have the same scale, which suits further training.
When D has rank ≤ r (a merged LoRA of rank ≤ r) the result reproduces D to fp32 rounding.

Only weight matrices can be carried by a LoRA: changed biases, norms and other tensors are counted and
reported, not written. Both files must be the same model in the same layout (original single files,
e.g. a base model and tuner's full fine-tune of it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tuner.dtypes import DTYPES
from tuner.errors import CheckpointError, TunerError
from tuner.io import save_safetensors
from tuner.networks.architectures import architecture_keys, canonical_modules, detect_architecture
from tuner.networks.delta import LORA, ModuleWeights
from tuner.networks.formats import describe_modules, layout_state
from tuner.networks.keys import COMFY_PREFIX
from tuner.registry import resolve_save_format
from tuner.tools.checkpoint import read_checkpoint


def extract_lora(
    base: str | os.PathLike,
    tuned: str | os.PathLike,
    rank: int,
    out: str | os.PathLike,
    *,
    format: str = "comfy",
    arch: str | None = None,
    dtype: str = "fp32",
    device: str = "cpu",
    threshold: float = 0.0,
) -> dict[str, int]:
    """Write the rank-`rank` LoRA of `tuned - base`; modules whose largest change is at most
    `threshold` are left out. `format` is a layout, or "auto" (the architecture's `save_format`).
    Returns counts of extracted modules and of other changed tensors."""
    if rank < 1:
        raise TunerError(f"--rank must be at least 1, got {rank}")
    base_ckpt, tuned_ckpt = read_checkpoint(base), read_checkpoint(tuned)
    base_weights, tuned_weights = base_ckpt.component(), tuned_ckpt.component()
    if set(base_weights) != set(tuned_weights):
        only = sorted(set(base_weights) ^ set(tuned_weights))
        raise CheckpointError(f"{base} and {tuned} are not the same model: keys in only one, e.g. {only[:5]}")
    modules: dict[str, ModuleWeights] = {}
    other_changes = 0
    for key, before in base_weights.items():
        after = tuned_weights[key]
        if before.shape != after.shape:
            raise CheckpointError(f"{key}: {tuple(before.shape)} in {base}, {tuple(after.shape)} in {tuned}")
        if not before.is_floating_point():
            continue
        diff = after.to(device, torch.float32) - before.to(device, torch.float32)
        if diff.abs().max().item() <= threshold:
            continue
        if not (key.endswith(".weight") and diff.ndim == 2):
            other_changes += 1
            continue
        modules[key.removesuffix(".weight")] = _low_rank(diff, rank)
    if not modules:
        raise TunerError(f"{tuned} has no weight matrix that differs from {base} by more than {threshold}")
    stems = {COMFY_PREFIX + name: weights for name, weights in modules.items()}
    matrices = [COMFY_PREFIX + k.removesuffix(".weight") for k, t in base_weights.items()
                if k.endswith(".weight") and t.ndim == 2]  # fmt: skip
    keys = None
    if format == "auto":  # the layout training writes by default for this architecture
        keys = architecture_keys(arch) if arch else detect_architecture(stems, {}, str(tuned), matrices)
        format = resolve_save_format(arch or keys.name, format)
    if format == "comfy":
        state, layout_metadata = layout_state(modules, "comfy", dtype=DTYPES[dtype])
    else:  # kohya and diffusers go through the architecture's names
        keys = keys or (
            architecture_keys(arch) if arch else detect_architecture(stems, {}, str(tuned), matrices)
        )
        canonical = canonical_modules(stems, keys, {}, str(tuned))
        state, layout_metadata = layout_state(canonical, format, keys, dtype=DTYPES[dtype])
    metadata = {
        **layout_metadata,
        **describe_modules(modules),
        "tuner.format": format,
        "tuner.extracted_from": json.dumps({"base": Path(base).name, "tuned": Path(tuned).name}),
    }
    if arch:
        metadata["tuner.architecture"] = arch
    save_safetensors(state, out, metadata=metadata)
    return {"modules": len(modules), "other_changed_tensors": other_changes}


def _low_rank(diff: torch.Tensor, rank: int) -> ModuleWeights:
    u, s, vh = torch.linalg.svd(diff, full_matrices=False)
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    tensors = {"down": (root[:, None] * vh[:r]).cpu(), "up": (u[:, :r] * root).cpu()}
    return ModuleWeights(LORA, tensors, float(r))
