"""The DDPM objective (Stable Diffusion 1.x / 2.x / SDXL): noise schedule, targets, loss weights, sampler.

Where flow matching walks a straight line from data to noise (`tuner.diffusion.timesteps`), a DDPM model sees
a latent at one of N = 1000 discrete noise levels k:

    x_k = √ᾱ_k · x0 + √(1 − ᾱ_k) · ε,      ᾱ_k = Π_{j ≤ k} (1 − β_j),

with SD's "scaled linear" betas, β_k = (√0.00085 + k/(N−1) · (√0.012 − √0.00085))². The signal-to-noise
ratio of level k is SNR_k = ᾱ_k / (1 − ᾱ_k). The model predicts either the noise itself
(`epsilon`, SDXL base and most fine-tunes) or the velocity v = √ᾱ_k · ε − √(1 − ᾱ_k) · x0 (`v`,
v-prediction fine-tunes such as NoobAI-XL V-Pred); the loss is the mean squared error to that target.

tuner draws t ∈ [0, 1] for every architecture (`TimestepSampler`, with its `min_timestep` /
`max_timestep` range limits); here t picks level k = ⌊t · N⌋ (k = N − 1 for t = 1), and the model is
told k. The options users of this family expect:

- `zero_terminal_snr` (Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed"):
  the schedule is rescaled so that ᾱ_{N−1} = 0, i.e. the last level is pure noise as at sampling time.
  v-prediction models trained this way need it (with epsilon the last level has nothing to predict);
- `min_snr_gamma` γ (Hang et al. 2023): weight each sample by min(SNR, γ) / SNR (epsilon) or
  min(SNR, γ) / (SNR + 1) (v), so that nearly clean levels, whose loss is tiny but whose gradients
  dominate, count less. 5 is the paper's value; 0 turns it off;
- `debiased_estimation`: the "debiased estimation loss" of kohya's sd-scripts (`apply_debiased_estimation`
  in `library/custom_train_functions.py`; diffusion-pipe the same): weight by 1 / √SNR (epsilon) or
  1 / (SNR + 1) (v: 0.72 against 1.62 at k = 500), SNR capped at 1000 (and, for epsilon, floored at 1e-3
  so that a zero-terminal-SNR schedule's pure-noise level stays finite). Note that 1 / (SNR + 1) is not
  the epsilon weight carried over to v (a v error is an epsilon error times √((SNR + 1) / SNR), which
  would give √SNR / (SNR + 1)); it is the community's form, kept so that recipes carry over;
- `noise_offset` (drawn in the training step, see `offset_noise`): ε gets a per-channel constant added,
  so the model learns to change an image's mean brightness.

Generation uses diffusers' schedulers (Euler, or DPM++ 2M) configured with the same schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from tuner.errors import ConfigError

TRAIN_STEPS = 1000
BETA_START, BETA_END = 0.00085, 0.012  # SD's scaled-linear schedule
PREDICTIONS = ("epsilon", "v")
SAMPLERS = ("euler", "dpm++2m")
_SNR_RANGE = (1e-3, 1000.0)  # debiased estimation: keeps 1 / √SNR finite at both ends


@dataclass(frozen=True)
class DDPMObjective:
    """What a DDPM model is trained on: the schedule, the prediction type and the loss weights."""

    prediction: str = "epsilon"
    zero_terminal_snr: bool = False
    min_snr_gamma: float = 0.0
    debiased_estimation: bool = False

    def __post_init__(self) -> None:
        if self.prediction not in PREDICTIONS:
            raise ConfigError(f"prediction must be one of {', '.join(PREDICTIONS)}, got {self.prediction!r}.")

    @cached_property
    def alphas_cumprod(self) -> torch.Tensor:
        """ᾱ_k for k = 0 .. N − 1 (float64)."""
        betas = torch.linspace(BETA_START**0.5, BETA_END**0.5, TRAIN_STEPS, dtype=torch.float64) ** 2
        alphas_cumprod = torch.cumprod(1 - betas, dim=0)
        if self.zero_terminal_snr:  # shift and scale √ᾱ so that it ends at 0 and starts where it did
            root = alphas_cumprod.sqrt()
            first, last = root[0].item(), root[-1].item()
            alphas_cumprod = ((root - last) * first / (first - last)) ** 2
        return alphas_cumprod

    # ---- t ∈ [0, 1] <-> level k ---------------------------------------------------------------------
    def discretize(self, t: torch.Tensor) -> torch.Tensor:
        """t with each value moved to the level it picks, k / N (so `predict` tells the model k)."""
        return self.level(t).to(t) / TRAIN_STEPS

    def level(self, t: torch.Tensor) -> torch.Tensor:
        """k = ⌊t · N⌋ clamped to N − 1, as int64. Rounded first so that k / N maps back to k."""
        return (t.double() * TRAIN_STEPS + 1e-6).floor().clamp(0, TRAIN_STEPS - 1).long()

    def _coefficients(self, t: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(√ᾱ_k, √(1 − ᾱ_k)) of each sample, shaped to broadcast over `like`, in float64."""
        ac = self.alphas_cumprod[self.level(t).cpu()].to(like.device)
        shape = (-1, *([1] * (like.ndim - 1)))
        return ac.sqrt().reshape(shape), (1 - ac).sqrt().reshape(shape)

    def snr(self, t: torch.Tensor) -> torch.Tensor:
        ac = self.alphas_cumprod[self.level(t).cpu()]
        return (ac / (1 - ac)).float()

    # ---- noising, target, loss --------------------------------------------------------------------
    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x_k = √ᾱ_k · x0 + √(1 − ᾱ_k) · ε, computed in float64 and returned in x0's dtype."""
        a, s = self._coefficients(t, x0)
        return (a * x0.double() + s * noise.double()).to(x0.dtype)

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """ε, or v = √ᾱ_k · ε − √(1 − ᾱ_k) · x0; float32."""
        if self.prediction == "epsilon":
            return noise.float()
        a, s = self._coefficients(t, x0)
        return (a * noise.double() - s * x0.double()).float()

    def weights(self, t: torch.Tensor) -> torch.Tensor:
        """Per-sample loss weights: 1, times min(SNR, γ) / SNR (epsilon) or min(SNR, γ) / (SNR + 1) (v)
        with min-SNR-γ, times 1 / √SNR (epsilon) or 1 / (SNR + 1) (v) with debiased estimation (which
        caps SNR at 1000, and floors it at 1e-3 for epsilon)."""
        snr = self.snr(t)
        if self.debiased_estimation:  # sd-scripts caps SNR at 1000; the floor keeps epsilon's 1 / √SNR finite
            snr = snr.clamp(_SNR_RANGE[0] if self.prediction == "epsilon" else 0.0, _SNR_RANGE[1])
        weight = torch.ones_like(snr)
        if self.min_snr_gamma > 0:
            clipped = snr.clamp_max(self.min_snr_gamma)
            if self.prediction == "v":
                weight = clipped / (snr + 1)
            else:  # the pure-noise level of a zero-terminal-SNR schedule: min(0, γ) / 0 is taken as 1
                weight = torch.where(snr > 0, clipped / snr.clamp_min(1e-12), weight)
        if self.debiased_estimation:
            weight = weight / (snr + 1 if self.prediction == "v" else snr.sqrt())
        return weight

    def loss(
        self, pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Weighted MSE to the target (see `tuner.diffusion.timesteps.weighted_mse`)."""
        from tuner.diffusion.timesteps import weighted_mse

        return weighted_mse(pred, self.target(x0, noise, t), self.weights(t), mask)


def objective_from_config(kind: str, section: Any, architecture: str):
    """The training objective of an architecture whose `objective` is `kind` ("flow", "ddpm" or "edm") from
    the `[timesteps]` section; a `ConfigError` names options set for another kind of model."""
    from tuner.diffusion.edm import EDMObjective
    from tuner.diffusion.timesteps import FlowObjective

    ddpm_only = {"prediction": section.prediction != "auto", "zero_terminal_snr": section.zero_terminal_snr,
                 "min_snr_gamma": section.min_snr_gamma > 0, "debiased_estimation": section.debiased_estimation}  # fmt: skip
    if kind in ("flow", "edm"):
        if set_keys := [f"timesteps.{k}" for k, on in ddpm_only.items() if on]:
            raise ConfigError(
                f"{', '.join(set_keys)}: options of DDPM models (sdxl); {architecture} is trained with "
                f"{'flow matching' if kind == 'flow' else 'the EDM objective'}. Remove them."
            )
    if kind == "edm":  # EDM's own loss weight λ(σ) (`tuner.diffusion.edm`)
        if section.loss_weighting != "none":
            raise ConfigError(
                f"timesteps.loss_weighting = {section.loss_weighting!r}: {architecture} is trained with the EDM "
                "objective, whose loss weight is its own. Remove it."
            )
        return EDMObjective()
    if kind == "flow":
        return FlowObjective(
            section.loss_weighting, section.logit_mean, section.logit_std, section.mode_scale
        )
    if section.loss_weighting != "none":
        raise ConfigError(
            f"timesteps.loss_weighting = {section.loss_weighting!r} weights flow-matching models; {architecture} "
            "is a DDPM model: use timesteps.min_snr_gamma or timesteps.debiased_estimation."
        )
    prediction = "epsilon" if section.prediction == "auto" else section.prediction
    return DDPMObjective(
        prediction, section.zero_terminal_snr, section.min_snr_gamma, section.debiased_estimation
    )


def offset_noise(noise: torch.Tensor, offset: float, generator: torch.Generator) -> torch.Tensor:
    """ε + offset · n with n ~ N(0, 1) drawn once per sample and channel (constant over the pixels)."""
    n = torch.randn((*noise.shape[:2], *([1] * (noise.ndim - 2))), generator=generator)
    return noise + offset * n.to(noise)


# ---------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------


def scheduler(objective: DDPMObjective, sampler: str):
    """A diffusers scheduler for the objective's schedule: Euler, or DPM++ 2M (multistep DPM-Solver++
    of order 2), with SDXL's "leading" spacing (trailing for zero-terminal-SNR models, which must start
    sampling at the pure-noise level)."""
    from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler

    if sampler not in SAMPLERS:
        raise ConfigError(f"sampler {sampler!r} is not known; choose one of {', '.join(SAMPLERS)}.")
    common = dict(
        num_train_timesteps=TRAIN_STEPS, beta_start=BETA_START, beta_end=BETA_END,
        beta_schedule="scaled_linear", prediction_type="epsilon" if objective.prediction == "epsilon"
        else "v_prediction", rescale_betas_zero_snr=objective.zero_terminal_snr, steps_offset=1,
        timestep_spacing="trailing" if objective.zero_terminal_snr else "leading",
    )  # fmt: skip
    if sampler == "euler":
        return EulerDiscreteScheduler(**common)
    return DPMSolverMultistepScheduler(**common, algorithm_type="dpmsolver++", solver_order=2)


@torch.no_grad()
def ddpm_sample(
    model_fn: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor],
    noise: torch.Tensor,
    objective: DDPMObjective,
    steps: int,
    cond: Any,
    uncond: Any,
    guidance_scale: float,
    sampler: str = "euler",
    progress: bool = False,
    combine: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Denoise `noise` (unit variance) in `steps` steps; `model_fn(x, k, cond)` gets k in 0..N as float32
    [B]. Classifier-free guidance as in `tuner.diffusion.sampling.guided`."""
    from tqdm.auto import tqdm

    from tuner.diffusion.sampling import guided

    sched = scheduler(objective, sampler)
    sched.set_timesteps(steps, device=noise.device)
    x = noise.float() * sched.init_noise_sigma
    for k in tqdm(sched.timesteps, disable=not progress, desc="sampling"):
        x_in = sched.scale_model_input(x, k).to(noise.dtype)
        level = torch.full((noise.shape[0],), float(k), device=x.device, dtype=torch.float32)
        pred = guided(model_fn, x_in, level, cond, uncond, guidance_scale, combine)
        x = sched.step(pred.float(), k, x).prev_sample
    return x.to(noise.dtype)
