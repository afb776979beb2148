"""Full fine-tuning: every weight of the transformer trains, and the result is saved as a whole model.

There is no adapter: `FullNetwork` is the model itself behind the interface the trainer uses for adapter
networks (parameter groups, save, load, `len`). It saves the whole transformer in the original
release's single-file layout (`blocks.0.self_attn.q.weight`, ..., what ComfyUI and the official code
load), converted by the architecture's `tuner.networks.layouts.CheckpointLayout` (FLUX's q, k and v are
joined into one `qkv` tensor, as the release has them), or in diffusers' key names with
`format = "diffusers"`.

Memory: weights, gradients and optimizer state for every parameter. In bf16 that is 2 + 2 bytes per
parameter plus the state: AdamW keeps two moments (8 bytes in fp32), 8-bit AdamW 2 bytes, Adafactor
a row and a column vector per matrix (almost nothing). For a 14B model only the last two fit one GPU.

*Stochastic rounding*. bf16 keeps 8 significant bits: next to 1.0 its values are 2⁻⁷ ≈ 0.008 apart. A
typical step changes a weight by about the learning rate (1e-5..1e-4), far below half that gap, so
ordinary rounding (to the nearest bf16) returns the old weight every step and training silently stalls.
Stochastic rounding rounds up with probability equal to how far the exact result lies towards the upper
neighbour, so the rounded weight equals the exact one *on average* and small updates add up. bf16 is the
upper half of an fp32's bits, which makes this cheap: add a uniform random 16-bit integer to the fp32's
bit pattern, then clear the lower 16 bits (`stochastic_round_`).

For that the optimizer must compute each new weight in fp32 before it is rounded. `StochasticRounding`
wraps any optimizer (torch's, bitsandbytes' 8-bit AdamW, transformers' Adafactor) and steps the bf16
parameters one at a time: upcast the parameter and its gradient, run the wrapped optimizer on that one
parameter, round the result back into the bf16 storage. Only one parameter is ever held in fp32; the
wrapped optimizer's state for bf16 parameters is kept in fp32 (with AdamW that doubles its state: use an
8-bit or factored optimizer for large models). The random bits come from a generator seeded by the step
count, so every process of a multi-GPU run rounds identically and a resumed run repeats the same draws.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tuner.errors import CheckpointError, TunerError
from tuner.io import save_safetensors
from tuner.networks.formats import LAYOUTS
from tuner.networks.keys import NameMap, describe_source, read_safetensors
from tuner.networks.layouts import diffusers_state_dict, original_state_dict

_LOW_BITS = 1 << 16


def stochastic_round_(
    target: torch.Tensor, source: torch.Tensor, generator: torch.Generator | None = None
) -> None:
    """Write fp32 `source` into bf16 `target`, rounding up with probability equal to the fraction of the
    gap to the next bf16 value (so the expectation is exact)."""
    bits = source.detach().float().contiguous().view(torch.int32)
    noise = torch.randint(
        0, _LOW_BITS, bits.shape, device=bits.device, dtype=torch.int32, generator=generator
    )
    rounded = ((bits + noise) & -_LOW_BITS).view(torch.float32)  # low half cleared: exact in bf16
    target.copy_(rounded)


class StochasticRounding(torch.optim.Optimizer):
    """Wraps an optimizer so bf16 parameters are updated in fp32 and rounded stochastically. Shares the
    wrapped optimizer's `param_groups` and `state` (LR schedulers and checkpointing see one optimizer)."""

    def __init__(self, optimizer: torch.optim.Optimizer, seed: int = 0) -> None:
        # torch.optim.Optimizer.__init__ is not called: the parameters belong to the wrapped optimizer.
        self.optimizer = optimizer
        self.seed = seed
        self.steps = 0

    def __getattr__(self, name: str) -> Any:  # defaults, hooks, ... of the wrapped optimizer
        if "optimizer" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["optimizer"], name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {**self.optimizer.state_dict(), "stochastic_rounding_steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.steps = int(state_dict.pop("stochastic_rounding_steps", 0))
        self.optimizer.load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        if closure is not None:
            raise TunerError("stochastic rounding does not support optimizer closures")
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        generators: dict[torch.device, torch.Generator] = {}
        try:
            # Everything not stored in bf16 steps as usual, in one call.
            for group, params in zip(groups, saved):
                group["params"] = [p for p in params if p.dtype != torch.bfloat16]
            self.optimizer.step()
            for group in groups:
                group["params"] = []
            for group, params in zip(groups, saved):
                for p in params:
                    if p.dtype == torch.bfloat16 and p.grad is not None:
                        group["params"] = [p]
                        self._step_in_fp32(p, generators)
                group["params"] = []
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
        self.steps += 1

    def _step_in_fp32(self, p: torch.Tensor, generators: dict[torch.device, torch.Generator]) -> None:
        if p.device not in generators:
            generators[p.device] = torch.Generator(p.device).manual_seed(self.seed * 1_000_003 + self.steps)
        stored, grad = p.data, p.grad
        p.data, p.grad = stored.float(), grad.float()
        try:
            self.optimizer.step()
            stochastic_round_(stored, p.data, generators[p.device])
        finally:
            p.data, p.grad = stored, grad


class FullNetwork(nn.Module):
    """The whole model as the trained "network"."""

    network_type = "full"

    def __init__(self, model: nn.Module, *, stochastic_rounding: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.model = model
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        model.requires_grad_(True)

    def __len__(self) -> int:
        return len(self.trainable_parameters())

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def param_groups(self, lr: float, loraplus_lr_ratio: float | None = None) -> list[dict[str, Any]]:
        if loraplus_lr_ratio:
            raise TunerError("network.loraplus_lr_ratio applies to adapters, not to a full fine-tune")
        return [{"params": self.trainable_parameters(), "lr": lr, "name": "full"}]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """With stochastic rounding, the optimizer wrapped in `StochasticRounding`; else as it is."""
        return StochasticRounding(optimizer, self.seed) if self.stochastic_rounding else optimizer

    def file_state_dict(
        self, name_map: NameMap | None = None, dtype: torch.dtype = torch.float32, format: str = "comfy"
    ) -> dict[str, torch.Tensor]:
        """The model's weights on the CPU, floating ones in `dtype`, in the original release's layout
        (comfy, kohya, musubi: converted by `name_map`, which may be the architecture's
        `CheckpointLayout`, so fused layers are joined) or under diffusers names (diffusers). Cast while
        copying to the CPU: casting on the GPU first would need a second copy of the model there."""
        if format not in LAYOUTS:
            raise TunerError(f"unknown save format {format!r}; choose one of {', '.join(LAYOUTS)}")
        state = {
            key: tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype)
            for key, tensor in self.model.state_dict().items()
        }
        if format == "diffusers":
            return state
        try:
            return original_state_dict(state, name_map)
        except KeyError as e:
            raise CheckpointError(
                f"cannot write the model in its original layout ({e}); save.format = 'diffusers' writes "
                "diffusers' names"
            ) from None

    def save(
        self,
        path: str | os.PathLike,
        name_map: NameMap | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
        dtype: torch.dtype = torch.float32,
        format: str = "comfy",
    ) -> None:
        """Write the whole transformer atomically as one .safetensors file in the original layout
        (`format` comfy, kohya or musubi: all mean the original release's single file here, what ComfyUI
        and the official code load) or diffusers' names."""
        merged = {**(metadata or {}), "tuner.network_type": "full", "tuner.format": format}
        save_safetensors(self.file_state_dict(name_map, dtype, format), path, metadata=merged)

    @torch.no_grad()
    def load_weights(
        self, source: str | os.PathLike | Mapping[str, torch.Tensor], name_map_inverse: NameMap | None = None
    ) -> dict[str, str]:
        """Continue from a saved model file (original layout or diffusers names, ComfyUI prefixes and
        scaled fp8 allowed; `name_map_inverse` converts the original layout, see
        `tuner.networks.layouts.diffusers_state_dict`); every weight must be present. Returns the file's
        metadata."""
        from tuner.models.loading import normalize_state_dict

        if isinstance(source, Mapping):
            tensors, metadata = dict(source), {}
        else:
            tensors, metadata = read_safetensors(source)
        own = self.model.state_dict()
        tensors = normalize_state_dict(tensors, next(iter(own.values())).dtype)
        where = describe_source(source)
        if not set(tensors) <= set(own):
            try:
                tensors = diffusers_state_dict(tensors, name_map_inverse)
            except KeyError as e:
                raise CheckpointError(f"{where}: a key has no name in this model's layout ({e})") from None
        missing = sorted(set(own) - set(tensors))
        unexpected = sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise CheckpointError(
                f"{where}: not a checkpoint of this model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        self.model.load_state_dict(tensors)
        return metadata
