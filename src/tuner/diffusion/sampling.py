"""Generating latents from a flow-matching model with Euler steps and classifier-free guidance.

A flow-matching model predicts the velocity v(x_t, t) = d x_t / d t of the straight path
x_t = (1 − t)·x0 + t·ε (see `tuner.diffusion.timesteps`). Sampling integrates that ODE backwards, from pure
noise at t = 1 to a clean latent at t = 0, on a decreasing grid of times σ_0 = 1 > σ_1 > ... > σ_N = 0:

    x_{i+1} = x_i + (σ_{i+1} − σ_i) · v(x_i, σ_i)

If the model were exact the path would be a straight line and a single step would land on x0; real
models bend it, so more steps help. `flow_sigmas` spaces the grid evenly and then applies the same
shift s·σ / (1 + (s − 1)·σ) used in training, which spends more steps at high noise, where the image
layout is decided (the model's recommended sampling shift usually matches its training shift).

Classifier-free guidance extrapolates from an unconditional prediction towards the conditional one,
v = v_uncond + g · (v_cond − v_uncond). With g = 1 this is just v_cond, so the unconditional pass
is skipped; otherwise both passes run as one doubled batch when the two conditionings can be stacked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from tuner.diffusion.timesteps import shift_timesteps
from tuner.errors import ConfigError

ModelFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
"""model_fn(x, t, cond) -> velocity, with t a float32 tensor [B] in 0..1000 (t · 1000)."""


def flow_sigmas(steps: int, shift: float = 1.0, terminal: float | None = None) -> torch.Tensor:
    """`steps + 1` times from 1 down to 0, evenly spaced and then shifted by s·σ / (1 + (s − 1)·σ); with
    `terminal`, the times before 0 stretched so the last is `terminal`: 1 − (1 − σ)·(1 − terminal) / (1 − σ_last)
    (diffusers' `FlowMatchEulerDiscreteScheduler.stretch_shift_to_terminal`, its `shift_terminal`)."""
    if steps < 1:
        raise ConfigError(f"sample steps must be at least 1, got {steps}.")
    if not shift > 0:
        raise ConfigError(f"sample shift must be positive, got {shift}.")
    sigmas = shift_timesteps(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift)
    if terminal is not None:
        sigmas[:-1] = 1 - (1 - sigmas[:-1]) * (1 - terminal) / (1 - sigmas[-2])
    return sigmas.float()


class _Unstackable(Exception):
    """Raised inside `_stack` when cond and uncond differ in a way one batch cannot hold."""


def _stack(cond: Any, uncond: Any, batch_size: int) -> Any:
    """Concatenate two conditionings along the batch dimension, or raise `_Unstackable`.

    Tensors whose first dimension is the batch are concatenated when their other dimensions match
    (text embeddings of different lengths do not). Tensors without a batch dimension (e.g. shared
    position ids) and plain values must be identical in both, and are passed once. Dicts, lists and
    tuples are handled item by item.
    """
    if isinstance(cond, torch.Tensor) and isinstance(uncond, torch.Tensor):
        if cond.ndim > 0 and cond.shape[0] == batch_size:
            if cond.shape == uncond.shape and cond.dtype == uncond.dtype:
                return torch.cat([cond, uncond])
        elif cond is uncond or (
            cond.shape == uncond.shape and cond.dtype == uncond.dtype and torch.equal(cond, uncond)
        ):
            return cond
        raise _Unstackable
    if isinstance(cond, dict) and isinstance(uncond, dict) and cond.keys() == uncond.keys():
        return {k: _stack(cond[k], uncond[k], batch_size) for k in cond}
    if isinstance(cond, (list, tuple)) and type(cond) is type(uncond) and len(cond) == len(uncond):
        return type(cond)(_stack(c, u, batch_size) for c, u in zip(cond, uncond))
    if cond is uncond:
        return cond
    if not isinstance(cond, (torch.Tensor, dict, list, tuple)) and type(cond) is type(uncond):
        try:
            if bool(cond == uncond):
                return cond
        except Exception:  # values whose == is not a plain bool
            pass
    raise _Unstackable


def _try_stack(cond: Any, uncond: Any, batch_size: int) -> tuple[bool, Any]:
    """(True, stacked conditioning) or (False, None) when cond and uncond need separate calls."""
    try:
        return True, _stack(cond, uncond, batch_size)
    except _Unstackable:
        return False, None


def guided(
    model_fn: ModelFn,
    x: torch.Tensor,
    t: torch.Tensor,
    cond: Any,
    uncond: Any,
    guidance_scale: float,
    combine: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
    batch_cfg: bool = True,
) -> torch.Tensor:
    """The model's prediction at (x, t) with classifier-free guidance (float32): the conditional one
    alone when `guidance_scale` is 1, else uncond + g · (cond − uncond) (or `combine`), both passes as one
    doubled batch when the conditionings stack (see `_stack`) and `batch_cfg` allows."""
    if guidance_scale == 1.0:
        return model_fn(x, t, cond).float()
    if uncond is None:
        raise ValueError("guidance_scale != 1 needs an unconditional conditioning (uncond).")
    one_call, stacked = _try_stack(cond, uncond, x.shape[0]) if batch_cfg else (False, None)
    if one_call:
        v_cond, v_uncond = model_fn(torch.cat([x, x]), torch.cat([t, t]), stacked).float().chunk(2)
    else:
        v_cond, v_uncond = model_fn(x, t, cond).float(), model_fn(x, t, uncond).float()
    if combine is not None:
        return combine(v_cond, v_uncond, guidance_scale)
    return v_uncond + guidance_scale * (v_cond - v_uncond)


@torch.no_grad()
def euler_sample(
    model_fn: ModelFn,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    uncond: Any = None,
    guidance_scale: float = 1.0,
    progress: bool = False,
    *,
    batch_cfg: bool = True,
    combine: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
    next_time: bool = False,
) -> torch.Tensor:
    """Integrate from `noise` (the latent at sigmas[0]) to sigmas[-1]; returns latents in noise's dtype.

    `cond` / `uncond` are passed to `model_fn` untouched (a tensor, a dict of tensors, ...). The
    unconditional pass runs only when `guidance_scale != 1`; it shares a call with the conditional
    one unless `batch_cfg` is False or the two cannot be stacked (see `_stack`). No randomness is
    drawn: the same noise gives the same latents. `combine(v_cond, v_uncond, scale)` replaces the plain
    guidance formula for models whose pipelines rescale it (Qwen-Image). `next_time`: dict conditionings
    also hold `t_next` [B], the time σ_{i+1} the step goes to (MeanFlow models are given their interval).
    """
    use_cfg = guidance_scale != 1.0
    if use_cfg and uncond is None:
        raise ValueError("guidance_scale != 1 needs an unconditional conditioning (uncond).")
    if sigmas.ndim != 1 or len(sigmas) < 2:
        raise ValueError(f"sigmas must be a 1-D tensor of at least 2 times, got shape {tuple(sigmas.shape)}.")

    batch = noise.shape[0]
    # Accumulate in float32: many small bf16 updates would round away.
    x = noise.float()
    times = sigmas.double().tolist()
    for i in tqdm(range(len(times) - 1), disable=not progress, desc="sampling"):
        t = torch.full((batch,), times[i] * 1000.0, device=x.device, dtype=torch.float32)
        c, u = _with_next_time(cond, uncond, times[i + 1], t) if next_time else (cond, uncond)
        v = guided(model_fn, x.to(noise.dtype), t, c, u, guidance_scale, combine, batch_cfg).float()
        x = x + (times[i + 1] - times[i]) * v
    return x.to(noise.dtype)


def _with_next_time(
    cond: dict, uncond: dict | None, time: float, t: torch.Tensor
) -> tuple[dict, dict | None]:
    """`cond` and `uncond` with `t_next`: the step's end time in [0, 1], one per sample (like `t`)."""
    t_next = torch.full_like(t, time)
    return {**cond, "t_next": t_next}, (None if uncond is None else {**uncond, "t_next": t_next})
