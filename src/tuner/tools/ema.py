"""`tuner lora ema`: an exponential moving average of saved checkpoints, computed after training.

An EMA of the weights smooths out the noise of the last optimizer steps and often generalises better
than the last checkpoint. Computed after the fact from the saves of one run, θ_1 … θ_n in training
order:

    ema_1 = θ_1,    ema_k = β · ema_{k-1} + (1 - β) · θ_k

so checkpoint k has weight (1 - β) β^(n-k) (the first one keeps β^(n-1)). β is per checkpoint, not per
optimizer step: with saves every 100 steps, β = 0.9 averages over roughly the last 1,000 steps. Like an
EMA kept during training, it averages each stored tensor (LoRA's down and up separately, which is what
training-time EMA does too), so every file must have the same keys and shapes, and the same alphas.
Works for adapter files and full model files alike.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from tuner.errors import CheckpointError, TunerError
from tuner.io import save_safetensors
from tuner.networks.keys import read_safetensors


def ema_checkpoints(
    paths: Sequence[str | os.PathLike], out: str | os.PathLike, *, beta: float = 0.9, order: str = "steps"
) -> list[str]:
    """Write the EMA of `paths` to `out`; `order` "steps" sorts them by tuner's `tuner.steps` metadata,
    "given" keeps the command line's order. Returns the files in the order used."""
    if not 0.0 <= beta < 1.0:
        raise TunerError(f"--beta must be in [0, 1), got {beta}")
    if len(paths) < 2:
        raise TunerError("an EMA needs at least two checkpoints")
    files = [(Path(p), *read_safetensors(p)) for p in paths]
    if order == "steps":
        missing = [str(p) for p, _, meta in files if "tuner.steps" not in meta]
        if missing:
            raise TunerError(f"{missing[0]} has no tuner.steps metadata; use --order given")
        files.sort(key=lambda f: int(f[2]["tuner.steps"]))
    first_path, first, _ = files[0]
    ema = {k: v.float() if v.is_floating_point() else v for k, v in first.items()}
    for path, tensors, _ in files[1:]:
        _check_same(first_path, first, path, tensors)
        for key, value in tensors.items():
            if value.is_floating_point() and not key.endswith(".alpha") and key != "alpha":
                ema[key].mul_(beta).add_(value.float(), alpha=1.0 - beta)
    state = {k: v.to(first[k].dtype) for k, v in ema.items()}
    newest_metadata = files[-1][2]
    record = {"beta": beta, "files": [p.name for p, _, _ in files]}
    save_safetensors(state, out, metadata={**newest_metadata, "tuner.trainers.ema": json.dumps(record)})
    return [str(p) for p, _, _ in files]


def _check_same(first_path: Path, first: dict, path: Path, tensors: dict) -> None:
    if set(first) != set(tensors):
        only = sorted(set(first) ^ set(tensors))
        raise CheckpointError(f"{path} and {first_path} hold different tensors, e.g. {only[:5]}")
    for key, value in tensors.items():
        if value.shape != first[key].shape:
            raise CheckpointError(
                f"{path}: {key} is {tuple(value.shape)}, {tuple(first[key].shape)} in {first_path}"
            )
        if (key.endswith(".alpha") or key == "alpha") and not torch.equal(value.float(), first[key].float()):
            raise CheckpointError(f"{path}: {key} differs from {first_path}; averaging needs equal alphas")
