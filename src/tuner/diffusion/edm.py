"""The EDM objective (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative
Models"), as Cosmos 1.0 is trained and sampled, written over tuner's flow time t.

An EDM model denoises `x_σ = x0 + σ·ε` at noise level σ through a preconditioned network F:

    D(x_σ) = c_skip · x_σ + c_out · F(c_in · x_σ, c_noise),
    c_skip = σ_d² / (σ² + σ_d²),   c_out = σ·σ_d / √(σ² + σ_d²),   c_in = 1 / √(σ² + σ_d²),
    c_noise = ¼ ln σ,

with σ_d the data's scale (`sigma_data`: 0.5 for Cosmos 1.0, diffusers' `EDMEulerScheduler` config of its
pipelines), and trains it on λ(σ)·‖D − x0‖², λ(σ) = (σ² + σ_d²) / (σ·σ_d)², σ = exp(n), n ~ N(P_mean, P_std)
(NVIDIA's cosmos-predict1 training configs: `EDMSDE(p_mean=0, p_std=1, sigma_min=0.0002, sigma_max=80)`).

**The same thing in flow time.** x_σ / (1 + σ) is tuner's `x_t = (1 − t)·x0 + t·ε` at t = σ / (1 + σ), so
the loop's noising (`add_noise`) is kept, and the timestep sampler's `logit_normal` (mean P_mean, std P_std)
*is* EDM's log-normal σ. With r = √(t² + σ_d²(1 − t)²) the network is called on `x_t / r` (= c_in·x_σ) at
`c_noise = ¼ logit t`, and the velocity of its denoised estimate (x̂0 = x_t − t·v) is

    v = x_t · (t − σ_d²(1 − t)) / r² − σ_d · F / r        (`velocity`; finite at t = 0),

which is what a family's `predict` returns, so generation's guidance and the rest of tuner see a velocity.
Since x̂0 − x0 = −t·(v − v*), EDM's loss is the velocity MSE weighted by λ(σ)·t² = r² / σ_d² (`loss`): the
same number, not an approximation. The release's learned uncertainty weighting (`logvar`, a small network
in its checkpoint that diffusers and ComfyUI drop) is not trained here; its weights are not loaded.

**Sampling** (`edm_sample`) is the pipelines' loop: Karras σ from σ_max = 80 to σ_min = 0.002 (ρ = 7, the
last level repeated: `final_sigmas_type = "sigma_min"`), starting from noise × σ_max, Euler steps in σ on x̂0
(guidance, where the caller's `combine` puts it, on the velocity: x̂0 is linear in it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tuner.diffusion.timesteps import add_noise, flow_target, weighted_mse

SAMPLE_SIGMA_MIN, SAMPLE_SIGMA_MAX, RHO = 0.002, 80.0, 7.0  # the Cosmos 1.0 pipelines' EDMEulerScheduler
TRAIN_SIGMA_MIN = 0.0002  # cosmos-predict1's EDMSDE: training σ is drawn in [0.0002, 80]


@dataclass(frozen=True)
class EDMObjective:
    """EDM training over flow time (see the module docstring): noising as flow matching, the loss EDM's."""

    sigma_data: float = 0.5
    """σ_d of the preconditioning and loss weight."""

    def discretize(self, t: torch.Tensor) -> torch.Tensor:
        """t clamped to the release's training range of σ ([0.0002, 80])."""
        low, high = (s / (1 + s) for s in (TRAIN_SIGMA_MIN, SAMPLE_SIGMA_MAX))
        return t.clamp(low, high)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return add_noise(x0, noise, t)  # x_t = x_σ / (1 + σ)

    def loss(
        self, pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """λ(σ)·‖D − x0‖² of the velocity `pred` (the velocity MSE weighted by r² / σ_d²)."""
        weights = self._r2(t.float()) / self.sigma_data**2
        return weighted_mse(pred.float(), flow_target(x0, noise).float(), weights, mask)

    # ---- the network's preconditioning ----------------------------------------------------------------
    def _r2(self, t: torch.Tensor) -> torch.Tensor:
        return t.square() + self.sigma_data**2 * (1 - t).square()

    def model_inputs(self, x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_in·x_σ, c_noise) at `x_t` [B, ...] and t [B]: what the network is called on."""
        t = t.float()
        scale = self._r2(t).rsqrt().view(-1, *([1] * (x_t.ndim - 1)))
        return (x_t.float() * scale).to(x_t.dtype), 0.25 * torch.logit(t)

    def inputs_at_sigma(self, x_sigma: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """c_in(σ)·x_σ for σ [B] (a latent the network is shown at its own noise level: Video2World's given
        frames at their augmentation σ)."""
        scale = (sigma.float().square() + self.sigma_data**2).rsqrt().view(-1, *([1] * (x_sigma.ndim - 1)))
        return (x_sigma.float() * scale).to(x_sigma.dtype)

    def velocity(self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The velocity of the network's denoised estimate, from its output F at (x_t, t)."""
        t = t.float().view(-1, *([1] * (x_t.ndim - 1)))
        r2, d = self._r2(t), self.sigma_data
        v = x_t.float() * (t - d**2 * (1 - t)) / r2 - d * out.float() * r2.rsqrt()
        return v.to(out.dtype)


def sample_sigmas(steps: int) -> torch.Tensor:
    """The pipelines' `steps` Karras levels from σ_max to σ_min, then σ_min again (float64)."""
    ramp = torch.linspace(0, 1, steps, dtype=torch.float64)
    low, high = SAMPLE_SIGMA_MIN ** (1 / RHO), SAMPLE_SIGMA_MAX ** (1 / RHO)
    sigmas = (high + ramp * (low - high)) ** RHO
    return torch.cat([sigmas, sigmas[-1:]])


@torch.no_grad()
def edm_sample(
    model_fn: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor],
    noise: torch.Tensor,
    steps: int,
    cond: Any,
    uncond: Any,
    guidance_scale: float,
    progress: bool = False,
    combine: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Denoise `noise` (unit variance) in `steps` Euler steps in σ; `model_fn(x_t, t·1000, cond)` is the
    velocity (as for flow models). Returns the last x_σ (σ = σ_min), as the pipelines decode it."""
    from tqdm.auto import tqdm

    from tuner.diffusion.sampling import guided

    sigmas = sample_sigmas(steps).tolist()
    x = noise.double() * sigmas[0]
    for i in tqdm(range(steps), disable=not progress, desc="sampling"):
        sigma = sigmas[i]
        t = sigma / (1 + sigma)
        x_t = (x / (1 + sigma)).to(noise.dtype)
        level = torch.full((noise.shape[0],), t * 1000.0, device=x.device, dtype=torch.float32)
        v = guided(model_fn, x_t, level, cond, uncond, guidance_scale, combine).double()
        x0 = x_t.double() - t * v
        x = x + (sigmas[i + 1] - sigma) * (x - x0) / sigma
    return x.to(noise.dtype)
