"""Fused backward: each parameter's optimizer step runs inside backward, as soon as its gradient is whole.

A normal step holds every trained parameter's gradient at once: backward writes them all, then the
optimizer reads them all. For a full fine-tune that is a second copy of the model (in the weights'
dtype) at the peak of memory. Here a hook on each parameter (`register_post_accumulate_grad_hook`, called
once its gradient for this backward is accumulated) steps the optimizer for that parameter alone and
frees the gradient at once, so gradients exist only for the parameters whose backward is in flight.

One optimizer keeps its state and param groups as usual (the LR schedule, checkpoints and resume see
nothing different); a hook steps it with every group's `params` narrowed to the one parameter. That is
exact for optimizers that update each parameter on its own (AdamW, the 8-bit ones, Lion, Adafactor,
CAME, Automagic, AdamW8bitKahan, GenericOptim, SGD): the weights equal the unfused run's. Optimizers
that look at all parameters in one step (Prodigy's step-size estimate, schedule-free's averaging
counters) would change meaning, and are refused, as is everything that needs every gradient before the
first update: gradient clipping by the total norm, gradient accumulation, fp16's gradient scaler, and
gradient averaging across processes (`tuner.config` and the trainer say so).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

NOT_PER_PARAMETER = ("prodigy", "adamw_schedulefree")
"""Named optimizers whose step couples parameters (see the module docstring)."""


class FusedBackward:
    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]):
        self.optimizer = optimizer
        self.group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.enabled = True
        self.handles = [p.register_post_accumulate_grad_hook(self._step) for p in params if p.requires_grad]

    def _step(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        index = self.group_of[param]
        try:
            for i, group in enumerate(groups):
                group["params"] = [param] if i == index else []
            self.optimizer.step()
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
        param.grad = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
