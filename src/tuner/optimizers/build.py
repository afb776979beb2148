"""Optimizers and learning-rate schedules, built from plain names and numbers.

Optimizer names (`build_optimizer`), matched without regard to case; `docs/optimizers.md` says what
each is for, its memory per parameter and its arguments:

- `adamw`: `torch.optim.AdamW`, with the fused kernel when every parameter is on CUDA (one kernel
  launch for all tensors) and the multi-tensor `foreach` path otherwise.
- `adafactor`: transformers' Adafactor, which keeps factored second moments (a row and a column vector
  per matrix instead of a full matrix). Given an lr it runs as a plain optimizer (relative_step,
  scale_parameter and warmup_init off); with lr None it computes its own relative step size.
- the names in `NAMED`: bitsandbytes' 8-bit and paged AdamW and Lion, Prodigy (`prodigyopt`),
  schedule-free AdamW (`schedulefree`), CAME (`pytorch_optimizer`), and our Automagic,
  AdamW8bitKahan and GenericOptim (`tuner.optimizers`). Those from optional packages name the extra that installs them.
- any other class in `torch.optim` by name (`SGD`, `RAdam`, ...; `LBFGS` is left out because it needs
  a closure each step), or a dotted import path `package.module.Class` (`torch.optim.Adafactor`, whose
  short name `adafactor` means transformers' version here).

Schedule-free optimizers keep two sequences of weights: the one gradients are taken at (`train()` mode)
and the average that is the model to use (`eval()` mode). `averaged_weights` switches to `eval()` around
sampling, validation and adapter export, so samples and saved adapters are the averaged weights.

Schedules (`build_scheduler`) multiply the optimizer's lr by a factor f(step):

- warmup: f rises linearly from 0 at step 0 to 1 at `warmup_steps` (the transformers/diffusers
  convention, so the same settings give the same curve as in other tools);
- then `constant`: 1; `linear`: straight down to `min_lr_ratio` at `total_steps`; `cosine`: half a
  cosine down to `min_lr_ratio`; `cosine_with_restarts`: `num_cycles` such half cosines, each jumping
  back to 1.

diffusers' and transformers' `get_scheduler` cover these shapes but not a floor (`min_lr_ratio`) for
linear and restarts, so the factor is the small pure function `lr_factor` below, wrapped in torch's
`LambdaLR`; its `state_dict` (step count and base lrs) is all a resume needs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tuner.errors import ConfigError, did_you_mean

# name -> ("module:Class", the pip extra that installs the module, or "" when it is a dependency)
NAMED = {
    "adamw8bit": ("bitsandbytes.optim:AdamW8bit", ""),
    "paged_adamw8bit": ("bitsandbytes.optim:PagedAdamW8bit", ""),
    "lion": ("bitsandbytes.optim:Lion", ""),
    "lion8bit": ("bitsandbytes.optim:Lion8bit", ""),
    "paged_lion8bit": ("bitsandbytes.optim:PagedLion8bit", ""),
    "prodigy": ("prodigyopt:Prodigy", "prodigy"),
    "adamw_schedulefree": ("schedulefree:AdamWScheduleFree", "schedulefree"),
    "came": ("pytorch_optimizer:CAME", "came"),
    "automagic": ("tuner.optimizers.automagic:Automagic", ""),
    "adamw8bitkahan": ("tuner.optimizers.kahan:AdamW8bitKahan", ""),
    "genericoptim": ("tuner.optimizers.generic:GenericOptim", ""),
}
BUILTIN_OPTIMIZERS = ("adamw", "adafactor", *NAMED)
SCHEDULERS = ("constant", "linear", "cosine", "cosine_with_restarts")
# Torch optimizers that cannot run in a plain `loss.backward(); optimizer.step()` loop.
_TORCH_EXCLUDED = ("Optimizer", "LBFGS")


# -- optimizers --------------------------------------------------------------------------------


def torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    """Optimizer classes in `torch.optim` usable by name, keyed by class name."""
    found = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and name not in _TORCH_EXCLUDED:
            found[name] = obj
    return found


def optimizer_choices() -> list[str]:
    """Every short name `build_optimizer` accepts (dotted paths come on top)."""
    torch_names = [n for n in torch_optimizers() if n.lower() not in BUILTIN_OPTIMIZERS]
    return [*BUILTIN_OPTIMIZERS, *sorted(torch_names)]


def _import_class(path: str) -> type:
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"optimizer '{path}': cannot import module '{module_name}' ({e}).") from e
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ConfigError(f"optimizer '{path}': module '{module_name}' has no class '{attr}'.")
    return cls


def resolve_optimizer(name: str) -> type:
    """The optimizer class for a short name or a dotted `package.module.Class` path."""
    key = name.lower()
    if key == "adamw":
        return torch.optim.AdamW
    if key in NAMED:  # imported only when asked for: bitsandbytes is slow to import and noisy on CPU
        path, extra = NAMED[key]
        module_name, attr = path.split(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except ImportError as e:
            raise ConfigError(
                f"optimizer '{name}' needs the package '{module_name}' ({e}); install it with "
                f"pip install 'tuner[{extra}]'."
            ) from e
    if key == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor
    by_lower = {n.lower(): cls for n, cls in torch_optimizers().items()}
    if key in by_lower:
        return by_lower[key]
    if "." in name:
        return _import_class(name)
    choices = optimizer_choices()
    raise ConfigError(
        f"optimizer '{name}' is not known; choose one of {', '.join(choices)}, or give a dotted "
        f"'package.module.Class' path." + did_you_mean(name.lower(), [c.lower() for c in choices])
    )


def schedule_free(optimizer: Any) -> torch.optim.Optimizer | None:
    """The schedule-free optimizer (one with train/eval modes) that `optimizer` is or that an Accelerate
    wrapper holds, or None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return (
        inner if callable(getattr(inner, "eval", None)) and callable(getattr(inner, "train", None)) else None
    )


@contextlib.contextmanager
def averaged_weights(optimizer: Any) -> Iterator[None]:
    """Schedule-free optimizers take gradients at one point and keep the model to use at another, an
    average of the iterates: inside this block the weights are that average (`eval()` mode), and leaving
    it returns to `train()` mode, where steps are taken, with the training weights exactly as they were.
    Sampling, validation and adapter export run inside it; the saved training state stays in train mode,
    so a resumed run continues bit for bit.
    Other optimizers pass through."""
    inner = schedule_free(optimizer)
    if inner is None:
        yield
        return
    # train() after eval() gives the training point back only up to rounding; keep it exactly, so a run
    # that samples or saves here takes the same steps as one that does not
    params = [p for group in inner.param_groups for p in group["params"]]
    kept = [p.detach().clone() for p in params]
    inner.eval()
    try:
        yield
    finally:
        inner.train()
        with torch.no_grad():
            for p, value in zip(params, kept):
                p.copy_(value)


def _normalize_groups(param_groups: Iterable) -> list[dict[str, Any]]:
    """Turn tensors or group dicts into a list of group dicts with `params` as lists (not generators)."""
    items = list(param_groups)
    if items and all(isinstance(p, torch.Tensor) for p in items):
        return [{"params": items}]
    return [{**group, "params": list(group["params"])} for group in items]


def _check_kwargs(cls: type, name: str, kwargs: dict[str, Any]) -> None:
    """Name the first kwarg the optimizer does not take, before construction hides it in a TypeError."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) and name.lower() not in NAMED:
        return  # the class forwards **kwargs; let its own check speak (ours swallow them: CAME's ignores them)
    accepted = [n for n, p in params.items() if n not in ("self", "params") and p.kind is not p.VAR_KEYWORD]
    for key in kwargs:
        if key not in accepted:
            raise ConfigError(
                f"optimizer '{name}' does not take the argument '{key}'; it takes {', '.join(accepted)}."
                + did_you_mean(key, accepted)
            )


def build_optimizer(
    name: str,
    param_groups: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    lr: float | None,
    kwargs: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """Build optimizer `name` over `param_groups` (tensors, or dicts with `params` and per-group
    settings) with learning rate `lr` (None: the optimizer's own default) and extra `kwargs`."""
    cls = resolve_optimizer(name)
    groups = _normalize_groups(param_groups)
    kwargs = dict(kwargs or {})
    if "lr" in kwargs:
        raise ConfigError(
            f"optimizer '{name}': give the learning rate once, as lr, not in the optimizer kwargs."
        )
    _check_kwargs(cls, name, kwargs)

    key = name.lower()
    if key == "adamw" and "fused" not in kwargs and "foreach" not in kwargs:
        params = [p for g in groups for p in g["params"]]
        on_cuda = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
        kwargs["fused" if on_cuda else "foreach"] = True
    if key == "adafactor" and lr is not None:
        # Adafactor refuses an explicit lr unless its own step-size schedule is turned off.
        kwargs = {"relative_step": False, "scale_parameter": False, "warmup_init": False, **kwargs}
    if lr is not None:
        kwargs["lr"] = lr

    try:
        return cls(groups, **kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"optimizer '{name}' rejected its settings {kwargs}: {e}") from e


# -- learning-rate schedules -------------------------------------------------------------------


def lr_factor(
    step: int,
    name: str,
    warmup_steps: int,
    total_steps: int,
    num_cycles: int = 1,
    min_lr_ratio: float = 0.0,
) -> float:
    """The multiplier of the base lr at optimizer step `step` (see the module docstring)."""
    if step < warmup_steps:
        return step / warmup_steps
    if name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if name == "linear":
        decay = 1.0 - progress
    elif name == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif name == "cosine_with_restarts":
        # Each cycle is a full 1 → 0 half cosine; at the very end progress is 1 and we stay at the floor.
        decay = 0.0 if progress >= 1.0 else 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0)))
    else:
        raise ValueError(f"unknown schedule {name!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def build_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    num_cycles: int = 1,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` applying `lr_factor`; call `.step()` once after each optimizer step."""
    if name not in SCHEDULERS:
        raise ConfigError(
            f"lr scheduler '{name}' is not known; choose one of {', '.join(SCHEDULERS)}."
            + did_you_mean(name, SCHEDULERS)
        )
    if warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be 0 or more, got {warmup_steps}.")
    if total_steps < 1:
        raise ConfigError(f"total_steps must be at least 1, got {total_steps}.")
    if name != "constant" and warmup_steps > total_steps:
        raise ConfigError(f"warmup_steps ({warmup_steps}) must not exceed total_steps ({total_steps}).")
    if num_cycles < 1:
        raise ConfigError(f"num_cycles must be at least 1, got {num_cycles}.")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}.")
    # LambdaLR's state_dict keeps the step count and base lrs, not these settings: a resume rebuilds the
    # scheduler with the same arguments, then loads the state.
    factor = functools.partial(
        lr_factor,
        name=name,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        num_cycles=num_cycles,
        min_lr_ratio=min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
