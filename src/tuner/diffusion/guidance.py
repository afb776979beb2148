"""Adaptive projected guidance (APG): classifier-free guidance that does not oversaturate at high scales.

Plain CFG moves the prediction by g · Δ, Δ = v_cond − v_uncond. At high g that step also scales the
conditional prediction itself (the part of Δ parallel to v_cond), which is what burns colours. APG
(Sadat et al., "Eliminating Oversaturation and Artifacts of High Guidance Scales in Diffusion Models",
arXiv:2410.02416) changes three things:

* momentum: Δ is replaced by a running sum a ← Δ + β·a over the steps (β < 0 damps what the
  previous steps already pushed);
* a norm threshold: a is scaled down to at most norm r (per sample, over all its elements);
* projection: of a, only the part orthogonal to v_cond is kept, plus η times the parallel part.

The prediction is v_uncond + s · (a⊥ + η·a∥). HunyuanImage 2.1's release mixes the two: its first
`start_step` + 1 steps are plain CFG at the user's scale (the momentum sum still accumulates), the rest APG
at its own scale (Tencent's HunyuanImage-2.1 pipeline, `cfg_mode = "MIX_mode_0"`; diffusers'
`AdaptiveProjectedMixGuidance`, whose defaults are these settings). A record declares its settings as
`sample_guidance` (`tuner.archs.record.Architecture`); generation then guides with them unless told
`cfg` (`--guidance-method`, `sample.guidance_method`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProjectedGuidance:
    """A release's APG settings (the names a record's `sample_guidance` pairs use)."""

    scale: float
    """s: the guidance scale of the APG steps (the user's scale is the CFG steps')."""
    momentum: float
    """β of the running sum a ← Δ + β·a (0: no momentum)."""
    norm_threshold: float
    """r: a is scaled down to norm r where it is longer (0: no threshold)."""
    eta: float
    """η: the share of a's part parallel to the conditional prediction that is kept."""
    start_step: int
    """Steps 0 .. start_step are plain CFG; APG from the next one."""


class AdaptiveProjectedGuidance:
    """The `combine(v_cond, v_uncond, scale)` of one sampling run (`tuner.diffusion.sampling.guided`):
    called once per step, in order, so it counts the steps and keeps the momentum sum. Make one per run."""

    def __init__(self, settings: ProjectedGuidance):
        self.settings = settings
        self.step = 0
        self.average: torch.Tensor | float = 0.0

    def __call__(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
        s = self.settings
        diff = v_cond - v_uncond
        self.average = diff + s.momentum * self.average
        step, self.step = self.step, self.step + 1
        if step <= s.start_step:
            return v_uncond + scale * diff
        return v_uncond + s.scale * _projected(self.average, v_cond, s.norm_threshold, s.eta)


def _projected(update: torch.Tensor, v_cond: torch.Tensor, norm_threshold: float, eta: float) -> torch.Tensor:
    """`update` limited to norm `norm_threshold` and split against `v_cond`, per sample (float64 for the
    projection): its orthogonal part plus `eta` times its parallel part."""
    dims = tuple(range(1, update.ndim))
    if norm_threshold > 0:
        norm = update.norm(p=2, dim=dims, keepdim=True)
        update = update * torch.clamp(norm_threshold / norm, max=1.0)
    a, unit = (
        update.double(),
        torch.nn.functional.normalize(v_cond.double().flatten(1), dim=1).view_as(v_cond),
    )
    parallel = (a * unit).sum(dim=dims, keepdim=True) * unit
    return ((a - parallel) + eta * parallel).to(update.dtype)
