"""Two-expert models: two transformers that split the denoising path at a boundary timestep.

Wan 2.2 A14B is two networks of Wan 2.1 14B's shape. The *high-noise* expert denoises from pure noise
down to the boundary (t >= boundary, where the layout is decided), the *low-noise* expert takes it from
there to the clean video (t < boundary, the detail). Only one runs for any t, so a step's cost is one
14B model's; the other can wait in host memory. diffusers' pipeline calls them `transformer` (high
noise) and `transformer_2` (low noise), and so does the config (`model.transformer`,
`model.transformer_2`).

A record declares two experts by its `boundary`; `tuner.archs.model.ArchitectureModel` then narrows the
timestep sampler to the trained expert (`expert_sampler`), applies memory settings to each expert
(`apply_memory_per_expert`) and builds one adapter per expert (`ExpertAdapters`).
`TimestepExperts` holds both and says which one a timestep belongs to; the family's `predict` sends
each sample of a batch to its expert, so training both, sampling and generation switch at the
boundary without the loop knowing. When experts take turns on a device, the idle one is parked in host
memory (unless block swap already streams its blocks). `ExpertAdapters` is the pair of adapter
networks trained together: one optimizer over both (an expert that saw no sample in a step has no
gradient and is left as it is), saved as one file per expert, named for the ComfyUI loader each goes
into: `<name>_high_noise.safetensors` and `<name>_low_noise.safetensors`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

EXPERTS = ("high", "low")
"""The experts by config name: `high` is `model.transformer`, `low` is `model.transformer_2`."""
EXPERT_FIELDS = {"high": "transformer", "low": "transformer_2"}
"""The config field that holds each expert."""


def expert_file(path: str | os.PathLike, expert: str) -> Path:
    """The adapter file of one expert next to `path`: `<stem>_high_noise.safetensors` or `_low_noise`."""
    path = Path(path)
    return path.with_name(f"{path.stem}_{expert}_noise{path.suffix}")


def expert_range(expert: str, boundary: float) -> tuple[float, float]:
    """The timesteps [lo, hi] one expert is trained on (the high-noise expert owns t >= boundary)."""
    return (boundary, 1.0) if expert == "high" else (0.0, boundary)


def expert_sampler(sampler, expert: str, boundary: float):
    """The timestep sampler `sampler` truncated to the range of the trained `expert` (shape kept; the
    configured min/max narrow it further); unchanged when both train."""
    if expert == "both":
        return sampler
    lo, hi = expert_range(expert, boundary)
    return replace(
        sampler, min_timestep=max(sampler.min_timestep, lo), max_timestep=min(sampler.max_timestep, hi)
    )


def apply_memory_per_expert(experts: TimestepExperts, apply: Callable[[nn.Module, str], Any], blocks_to_swap: int,
                            device) -> ExpertHandles:  # fmt: skip
    """Memory settings on each expert: `apply(expert, config_field)` returns its handle. The low-noise
    expert goes first: without block swap it is parked in host memory before the high-noise one (which
    runs first when sampling) comes to the device, so one expert is there."""
    handles = {}
    for name in ("low", "high"):
        handles[name] = apply(experts.expert(name), EXPERT_FIELDS[name])
        if name == "low" and blocks_to_swap == 0:
            experts.take_turns(torch.device(device))
    return ExpertHandles(handles)


class ExpertHandles:
    """The memory handles of both experts, summarized as one."""

    def __init__(self, handles: dict):
        self.handles = handles

    def summary(self) -> str:
        return "; ".join(f"{name} expert: {h.summary()}" for name, h in self.handles.items())

    def remove(self) -> None:
        for handle in self.handles.values():
            handle.remove()


class TimestepExperts(nn.Module):
    """The high-noise expert (`transformer`) for t >= `boundary`, the low-noise one (`transformer_2`)
    below it; t in [0, 1]."""

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary: float):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary = boundary
        self._park: torch.device | None = None  # the device experts take turns on, when they do
        self._active: nn.Module | None = None

    def expert(self, name: str) -> nn.Module:
        return self.transformer if name == "high" else self.transformer_2

    def is_high(self, t: torch.Tensor) -> torch.Tensor:
        """Per sample: whether t (in [0, 1]) belongs to the high-noise expert."""
        return t >= self.boundary

    def enable_gradient_checkpointing(self) -> None:
        for model in (self.transformer, self.transformer_2):
            model.enable_gradient_checkpointing()

    def take_turns(self, device: torch.device) -> None:
        """From now on only the expert about to run is on `device`; the other waits in host memory.
        For experts placed whole on the device (not block-swapped): parks `transformer_2` now and
        expects `transformer` to be (or go) on the device."""
        if torch.device(device).type != "cpu":
            self._park = torch.device(device)
            self.transformer_2.to("cpu")
            self._active = self.transformer

    def activate(self, name: str) -> nn.Module:
        """The expert `name`, on the device if experts take turns."""
        model = self.expert(name)
        if self._park is not None and self._active is not model:
            self._active.to("cpu")
            model.to(self._park)
            self._active = model
        return model


class ExpertAdapters(nn.Module):
    """The adapters of both experts, trained together (the `TrainableNetwork` interface of one)."""

    def __init__(self, high: nn.Module, low: nn.Module):
        super().__init__()
        self.high, self.low = high, low

    def networks(self) -> dict[str, Any]:
        return {"high": self.high, "low": self.low}

    def __len__(self) -> int:
        return len(self.high) + len(self.low)

    def param_groups(self, lr: float, loraplus_lr_ratio: float | None = None) -> list[dict[str, Any]]:
        return [
            {**group, "name": f"{expert}_{group['name']}"}
            for expert, network in self.networks().items()
            for group in network.param_groups(lr, loraplus_lr_ratio)
        ]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer  # adapters train in fp32 and need nothing (full fine-tunes are one expert at a time)

    def load_weights(self, source, name_map_inverse=None) -> dict[str, str]:
        raise NotImplementedError("continue training one expert at a time (checked when the config is read)")

    def files(self, path: str | os.PathLike) -> list[Path]:
        """The files `save(path)` writes: one per expert."""
        return [Path(expert_file(path, expert)) for expert in self.networks()]

    def save(self, path: str | os.PathLike, name_map=None, *, metadata=None, dtype=torch.float32,
             format: str = "comfy") -> None:  # fmt: skip
        """One file per expert beside `path` (see `expert_file`), each recording its expert."""
        for expert, network in self.networks().items():
            meta = {**(metadata or {}), "tuner.expert": f"{expert}_noise"}
            network.save(expert_file(path, expert), name_map, metadata=meta, dtype=dtype, format=format)
