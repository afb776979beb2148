"""Flow matching: which timesteps to train on, how to noise a latent, and the loss.

Flow matching (rectified flow) joins a clean latent x0 and Gaussian noise ε with a straight line

    x_t = (1 − t) · x0 + t · ε,        t ∈ [0, 1],  t = 0 is clean, t = 1 is pure noise,

and trains the model to predict the velocity of that line, dx_t/dt = ε − x0 (`flow_target`). The
same velocity is the target at every t; what changes between recipes is *which* t the model sees
during training. Uniform t spends as many steps on nearly clean latents (easy, little signal) as on
the middle of the path, where the model decides layout and colour. So trainers draw t from a
distribution that puts more mass in the middle or, for large images and videos, towards noise. The
modes (names and formulas as musubi-tuner's `--timestep_sampling`, `hv_train_network.py`, and
diffusers' `training_utils.compute_density_for_timestep_sampling`; n ~ N(0, 1), u ~ U(0, 1)):

- `uniform`: t = u.
- `sigmoid`: t = sigmoid(sigmoid_scale · n). A bump around 0.5; a larger scale flattens it.
- `logit_normal`: t = sigmoid(logit_mean + logit_std · n) (SD3's default; its median is sigmoid(logit_mean)).
- `mode`: t = 1 − u − s · (cos²(πu/2) − 1 + u), s = `mode_scale` (SD3's "mode sampling with heavy
  tails", Esser et al. 2024 §3.1): s > 0 puts mass in the middle, s < 0 at the ends, s = 0 is uniform.
  Monotone only for −1 ≤ s ≤ 2/(π − 2) ≈ 1.75, so other values are refused.
- `logsnr`: the log signal-to-noise ratio λ ~ N(logit_mean, logit_std) and t = sigmoid(−λ/2) (Kim et
  al. 2024, arXiv:2411.14793): a logit-normal with mean −logit_mean/2 and std logit_std/2.
- `shift`: draw t from `uniform` or `sigmoid` (`shift_from`), then apply the discrete flow shift
  t' = s·t / (1 + (s − 1)·t) with s = `discrete_flow_shift`. s > 1 moves mass towards noise, which
  large latents need: more pixels carry more redundant signal, so a given t destroys less of the
  image and the model must see noisier inputs to learn composition (Wan uses s = 3..12).
- `flux_shift` / `flux2_shift` / `qwen_shift` / `krea2_shift`: the same shift, with s = exp(μ) chosen
  from the image-token count: μ is linear in the number of tokens, through (base_seq_len, base_shift)
  and (max_seq_len, max_shift) (see `RESOLUTION_SHIFTS`), applied to sigmoid-normal t. Written as in
  FLUX's reference code this is t' = e^μ / (e^μ + (1/t − 1)), which is algebraically the shift above.
  `flux2_shift` is FLUX.1's line; musubi-tuner needs the second name because its `flux_shift` counts
  (h/2)·(w/2) tokens of a FLUX.1 latent and FLUX.2's latents are already packed (h·w tokens). tuner
  counts each model's own tokens (`ArchitectureModel.seq_len`), so here the two modes are one
  distribution under two names.
- `qinglong_flux` / `qinglong_qwen` (musubi-tuner's "Qinglong" hybrid): a mixture of 80 %
  `flux_shift` / `qwen_shift`, 7.5 % `logsnr` (logit_mean, logit_std) and 12.5 % `logsnr` with λ ~
  N(5.36, 1) (nearly clean t, for detail).
- `ideogram4_shift`: `logit_normal` with mean 0.5·ln(pixels / 512²) and std 1.5 (musubi-tuner's mode for
  Ideogram 4, the mean its pipeline's sampling schedule takes): a 1024² image centres t at sigmoid(ln 2).

Every mode is a monotone function of one uniform draw u (`TimestepSampler.quantile`; for the mixtures
the inverse of their CDF, the weighted sum of the parts', found by bisection). That makes
`min_timestep` / `max_timestep` exact and cheap: u is drawn between the CDF values of the two bounds,
so the distribution is *truncated* to [min, max] keeping its shape inside, with no rejection loop (as
musubi-tuner's `--preserve_distribution_shape`, which rejects draws outside). `range_mode = "scale"`
instead squeezes the whole distribution into [min, max], t' = min + (max − min) · t (musubi-tuner's
default without that flag).

Units: tuner works with t in [0, 1] everywhere, including `min_timestep` / `max_timestep`. Models
in diffusers take t · 1000; the trainer multiplies at the call site.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from statistics import NormalDist
from typing import Any

import torch

from tuner.errors import ConfigError, did_you_mean

MODES = ("uniform", "sigmoid", "logit_normal", "mode", "logsnr", "shift", "flux_shift", "flux2_shift", "qwen_shift", "krea2_shift", "qinglong_flux", "qinglong_qwen", "ideogram4_shift")  # fmt: skip
SHIFT_FROM = ("uniform", "sigmoid")
RANGE_MODES = ("truncate", "scale")
LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap", "logit_normal", "mode")
MODE_SCALE_MAX = 2 / (math.pi - 2)  # the largest mode_scale for which `mode` is monotone


@dataclass(frozen=True)
class ResolutionShift:
    """μ linear in image-token count through (base_seq_len, base_shift) and (max_seq_len, max_shift).

    Outside that range μ is extrapolated, as diffusers' pipelines do.
    """

    base_seq_len: int
    base_shift: float
    max_seq_len: int
    max_shift: float

    def mu(self, seq_len: int) -> float:
        slope = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len)
        return self.base_shift + slope * (seq_len - self.base_seq_len)


# Values from the models' published diffusers scheduler configs (FLUX.1-dev; Qwen/Qwen-Image, whose
# `scheduler_config.json` has base 256 → 0.5 and max 8192 → 0.9; Krea 2's, per Krea2Pipeline's docstring:
# base 256 → 0.5, max 6400 → 1.15, musubi-tuner's `krea2_shift`). FLUX.2's is FLUX.1's line (musubi-tuner's
# `flux2_shift`).
_FLUX_LINE = ResolutionShift(base_seq_len=256, base_shift=0.5, max_seq_len=4096, max_shift=1.15)
_QWEN_LINE = ResolutionShift(base_seq_len=256, base_shift=0.5, max_seq_len=8192, max_shift=0.9)
RESOLUTION_SHIFTS = {
    "flux_shift": _FLUX_LINE,
    "flux2_shift": _FLUX_LINE,
    "qwen_shift": _QWEN_LINE,
    "krea2_shift": ResolutionShift(base_seq_len=256, base_shift=0.5, max_seq_len=6400, max_shift=1.15),
    # LTX-Video's diffusers scheduler config (Lightricks' LTX-Video `ltx_video/utils/diffusers_config_mapping.py`,
    # `DIFFUSERS_SCHEDULER_CONFIG`: base 1024 → 0.95, max 4096 → 2.05, `shift_terminal` 0.1): sampling only
    "ltx_shift": ResolutionShift(base_seq_len=1024, base_shift=0.95, max_seq_len=4096, max_shift=2.05),
}


def flux2_empirical_mu(tokens: int, steps: int) -> float:
    """FLUX.2's sampling μ, fitted to the token count and the step count (diffusers
    `pipelines/flux2/pipeline_flux2.py`, `compute_empirical_mu`): from 4300 tokens up the line fitted at 200
    steps; below, a line in the step count through the 10-step and 200-step fits at this token count."""
    at_200 = 0.00016927 * tokens + 0.45666666
    if tokens > 4300:
        return at_200
    at_10 = 8.73809524e-05 * tokens + 1.89833333
    return at_200 + (at_200 - at_10) / 190.0 * (steps - 200)


STEP_SHIFTS = {"flux2_empirical": flux2_empirical_mu}
"""Sampling shifts e^μ whose μ depends on the step count too: name → μ(tokens, steps)."""
# The Qinglong mixtures: the resolution-shifted part and its weight, then two logsnr parts
# (weight, mean, std); None takes the configured logit_mean / logit_std (musubi-tuner's values).
QINGLONG = {"qinglong_flux": "flux_shift", "qinglong_qwen": "qwen_shift"}
_QINGLONG_PARTS = ((0.80, "shifted"), (0.075, None), (0.125, (5.36, 1.0)))


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Discrete flow shift t' = s·t / (1 + (s − 1)·t). Keeps 0 → 0 and 1 → 1; s > 1 pushes t towards 1."""
    return shift * t / (1 + (shift - 1) * t)


def _logit_scalar(p: float) -> float:
    if p <= 0.0:
        return -math.inf
    if p >= 1.0:
        return math.inf
    return math.log(p / (1.0 - p))


def _normal_cdf(x: float) -> float:
    if math.isinf(x):
        return 0.0 if x < 0 else 1.0
    return NormalDist().cdf(x)


def _bisect(f, y: torch.Tensor, iterations: int = 60) -> torch.Tensor:
    """x ∈ [0, 1] with f(x) = y for a nondecreasing tensor function f (float64; 60 halvings: exact in float)."""
    lo, hi = torch.zeros_like(y, dtype=torch.float64), torch.ones_like(y, dtype=torch.float64)
    y = y.double()
    for _ in range(iterations):
        mid = (lo + hi) / 2
        below = f(mid) < y
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return (lo + hi) / 2


def mode_quantile(u: torch.Tensor, scale: float) -> torch.Tensor:
    """SD3's mode sampling written increasing in u: t = u − s·(sin²(πu/2) − u) (its 1 − u' form with u' = 1 − u)."""
    return u - scale * (torch.sin(math.pi * u / 2) ** 2 - u)


def _logit_normal_cdf(t: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    return torch.special.ndtr((torch.logit(t.double()) - mean) / std)


@dataclass(frozen=True)
class TimestepSampler:
    """Draws training timesteps t ∈ [min_timestep, max_timestep] ⊆ [0, 1]; see the module docstring."""

    mode: str
    """One of `MODES`."""
    sigmoid_scale: float = 1.0
    """k in sigmoid(k · N(0, 1)); used by `sigmoid`, `shift` from sigmoid and the resolution shifts."""
    logit_mean: float = 0.0
    """Mean of the normal inside `logit_normal` (the median of t is sigmoid(logit_mean)) and of λ in `logsnr`."""
    logit_std: float = 1.0
    """Standard deviation of the normal inside `logit_normal` and of λ in `logsnr`."""
    mode_scale: float = 1.29
    """s of mode `mode`, in [−1, 2/(π − 2)] (1.29 is SD3's and diffusers' default)."""
    discrete_flow_shift: float = 1.0
    """s in t' = s·t / (1 + (s − 1)·t) for mode `shift`; 1 leaves t unchanged."""
    shift_from: str = "sigmoid"
    """Distribution that mode `shift` draws before shifting: `uniform` or `sigmoid`."""
    min_timestep: float = 0.0
    """Lower bound of t, in [0, 1] (not 0..1000)."""
    max_timestep: float = 1.0
    """Upper bound of t, in [0, 1] (not 0..1000)."""
    range_mode: str = "truncate"
    """How [min, max] applies: `truncate` (the shape inside is kept) or `scale` (squeezed into the range)."""

    def __post_init__(self) -> None:
        for name, value, choices in (("mode", self.mode, MODES), ("shift_from", self.shift_from, SHIFT_FROM),
                                     ("range_mode", self.range_mode, RANGE_MODES)):  # fmt: skip
            if value not in choices:
                raise ConfigError(
                    f"timestep {name} '{value}' is not known; choose one of {', '.join(choices)}."
                    + did_you_mean(value, choices)
                )
        for name in ("sigmoid_scale", "logit_std", "discrete_flow_shift"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number, got {value}.")
        if not math.isfinite(self.logit_mean):
            raise ConfigError(f"logit_mean must be a finite number, got {self.logit_mean}.")
        if not -1.0 <= self.mode_scale <= MODE_SCALE_MAX:
            raise ConfigError(
                f"mode_scale must be in [-1, {MODE_SCALE_MAX:.4f}] (2/(pi-2); outside it mode sampling is not "
                f"monotone), got {self.mode_scale}."
            )
        for name in ("min_timestep", "max_timestep"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                hint = " (tuner uses t in [0, 1]; divide a 0..1000 value by 1000)" if value > 1 else ""
                raise ConfigError(f"{name} must be in [0, 1], got {value}{hint}.")
        if self.min_timestep >= self.max_timestep:
            raise ConfigError(
                f"min_timestep ({self.min_timestep}) must be smaller than max_timestep ({self.max_timestep})."
            )

    # -- the distribution, as a function of one uniform draw ------------------------------------

    def shift_for(self, seq_len: int | None = None) -> float:
        """The shift s applied after the base draw (1.0 for modes without a shift; for a Qinglong
        mixture, the shift of its resolution-shifted part)."""
        if self.mode == "shift":
            return self.discrete_flow_shift
        line = RESOLUTION_SHIFTS.get(QINGLONG.get(self.mode, self.mode))
        if line is not None:
            if seq_len is None:
                raise ValueError(f"timestep mode '{self.mode}' needs seq_len (the image-token count).")
            return math.exp(line.mu(seq_len))
        return 1.0

    def _base_is_uniform(self) -> bool:
        return self.mode == "uniform" or (self.mode == "shift" and self.shift_from == "uniform")

    def _normal_params(self, seq_len: int | None = None) -> tuple[float, float]:
        """(mean, std) of the normal n in t = sigmoid(n) for the sigmoid-based modes."""
        if self.mode == "logit_normal":
            return self.logit_mean, self.logit_std
        if self.mode == "ideogram4_shift":
            if seq_len is None:
                raise ValueError("timestep mode 'ideogram4_shift' needs seq_len (the image-token count).")
            # one token is 16 x 16 pixels: 0.5·ln(256·tokens / 512²)
            return 0.5 * math.log(seq_len / 1024), 1.5
        if self.mode == "logsnr":
            return -self.logit_mean / 2, self.logit_std / 2
        return 0.0, self.sigmoid_scale

    def _mixture(self, seq_len: int | None) -> list[tuple[float, float, float, float]]:
        """A Qinglong mode's parts as (weight, mean, std, shift) of shifted logit-normals."""
        parts = []
        for weight, params in _QINGLONG_PARTS:
            if params == "shifted":
                parts.append((weight, 0.0, self.sigmoid_scale, self.shift_for(seq_len)))
            else:
                mean, std = params or (self.logit_mean, self.logit_std)
                parts.append((weight, -mean / 2, std / 2, 1.0))  # logsnr: logit-normal (−mean/2, std/2)
        return parts

    def _mixture_cdf(self, t: torch.Tensor, seq_len: int | None) -> torch.Tensor:
        t = t.double()
        total = torch.zeros_like(t)
        for weight, mean, std, shift in self._mixture(seq_len):
            base_t = t / (shift - (shift - 1) * t)  # inverse shift = shift by 1/s
            total = total + weight * _logit_normal_cdf(base_t, mean, std)
        return total

    def quantile(self, u: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """Map u ∈ [0, 1] to t with P(t ≤ quantile(u)) = u, ignoring min/max. Monotone in u."""
        if self.mode in QINGLONG:
            return _bisect(lambda t: self._mixture_cdf(t, seq_len), u).to(u.dtype)
        if self._base_is_uniform():
            t = u
        elif self.mode == "mode":
            t = mode_quantile(u, self.mode_scale)
        else:
            mean, std = self._normal_params(seq_len)
            t = torch.sigmoid(mean + std * torch.special.ndtri(u))
        shift = self.shift_for(seq_len)
        return t if shift == 1.0 else shift_timesteps(t, shift)

    def cdf(self, t: float, seq_len: int | None = None) -> float:
        """P(t' ≤ t) before min/max: the inverse of `quantile`."""
        if self.mode in QINGLONG:
            return self._mixture_cdf(torch.tensor(t), seq_len).item()
        shift = self.shift_for(seq_len)
        base_t = t if shift == 1.0 else t / (shift - (shift - 1) * t)  # inverse shift = shift by 1/s
        if self._base_is_uniform():
            return base_t
        if self.mode == "mode":
            return _bisect(lambda u: mode_quantile(u, self.mode_scale), torch.tensor(base_t)).item()
        mean, std = self._normal_params(seq_len)
        return _normal_cdf((_logit_scalar(base_t) - mean) / std)

    def sample(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        device: torch.device | str = "cpu",
        seq_len: int | None = None,
    ) -> torch.Tensor:
        """Draw `batch_size` timesteps in [min_timestep, max_timestep] as a float32 tensor on `device`.

        The uniform draw happens on the generator's device (so a CPU generator gives the same t on
        any accelerator); `seq_len` is the image-token count, required by the resolution shifts.
        """
        draw_device = generator.device if generator is not None else torch.device(device)
        u = torch.rand(batch_size, generator=generator, device=draw_device, dtype=torch.float32)
        if self.range_mode == "scale":
            t = self.min_timestep + (self.max_timestep - self.min_timestep) * self.quantile(u, seq_len)
        else:
            lo, hi = self.cdf(self.min_timestep, seq_len), self.cdf(self.max_timestep, seq_len)
            t = self.quantile(lo + (hi - lo) * u, seq_len)
        # Rounding in float32 can land a hair outside the bounds.
        return t.clamp(self.min_timestep, self.max_timestep).to(device)

    def describe(self, seq_len: int | None = None) -> str:
        """One line naming the mode and the parameters that affect it (for logs and plot titles)."""
        params: list[str] = []
        if self.mode in ("logit_normal", "logsnr", *QINGLONG):
            params += [f"logit_mean={self.logit_mean:g}", f"logit_std={self.logit_std:g}"]
        if self.mode == "mode":
            params.append(f"mode_scale={self.mode_scale:g}")
        if self.mode == "shift":
            params += [f"discrete_flow_shift={self.discrete_flow_shift:g}", f"shift_from={self.shift_from}"]
        resolution = self.mode in RESOLUTION_SHIFTS or self.mode in QINGLONG
        if self.mode == "sigmoid" or resolution or (self.mode == "shift" and self.shift_from == "sigmoid"):
            params.append(f"sigmoid_scale={self.sigmoid_scale:g}")
        if resolution and seq_len is not None:
            params += [f"seq_len={seq_len}", f"shift={self.shift_for(seq_len):.3g}"]
        if (self.min_timestep, self.max_timestep) != (0.0, 1.0):
            params.append(f"t in [{self.min_timestep:g}, {self.max_timestep:g}] ({self.range_mode})")
        return f"{self.mode} ({', '.join(params)})" if params else self.mode


def sampler_from_config(section: Any) -> TimestepSampler:
    """A sampler from any object whose attributes carry `TimestepSampler`'s field names (the
    `[timesteps]` config section). Missing attributes keep their defaults; others are ignored."""
    names = [f.name for f in fields(TimestepSampler)]
    return TimestepSampler(**{name: getattr(section, name) for name in names if hasattr(section, name)})


# -- noising, target, loss ---------------------------------------------------------------------


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x0 + t·noise, with t[B] ∈ [0, 1] broadcast over [B, C, H, W] or [B, C, F, H, W].

    The mix is computed in at least float32 and returned in x0's dtype: a bf16 t would round 0.7 to
    0.699, so the noise level would not be the t the model is told.
    """
    dtype = torch.promote_types(x0.dtype, torch.float32)
    tb = t.to(device=x0.device, dtype=dtype).reshape(-1, *([1] * (x0.ndim - 1)))
    return ((1 - tb) * x0.to(dtype) + tb * noise.to(dtype)).to(x0.dtype)


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity the model learns to predict: d x_t / d t = noise − x0."""
    return noise - x0


def loss_weight(
    t: torch.Tensor, scheme: str, logit_mean: float = 0.0, logit_std: float = 1.0, mode_scale: float = 1.29
) -> torch.Tensor:
    """Per-sample loss weight for t[B] (SD3's schemes, Esser et al. 2024 §3.1, named as in diffusers'
    `training_utils.compute_loss_weighting_for_sd3` and musubi-tuner's `--weighting_scheme`).

    - `none`: 1.
    - `sigma_sqrt`: σ⁻² with σ = t. It explodes as t → 0, so t is floored at 1e-3 (weight ≤ 1e6).
    - `cosmap`: 2 / (π · (1 − 2t + 2t²)), the density that makes t follow a cosine schedule.
    - `logit_normal` / `mode`: the density π(t) of that timestep mode (with logit_mean / logit_std, or
      mode_scale). SD3 writes a sampling density as a loss weight: drawing t uniformly and weighting by
      π(t) has the expectation of drawing t from π unweighted. diffusers and musubi-tuner use these two
      names only to *draw* t (musubi's `--timestep_sampling sigma`, weight 1): there, set
      `timesteps.mode` to `logit_normal` / `mode` instead. The weights are for a recipe that keeps its own
      sampling and wants SD3's emphasis on top; they are ≈ 0 near t = 0 and 1 for logit_normal.
    """
    t = t.float()
    if scheme == "none":
        return torch.ones_like(t)
    if scheme == "sigma_sqrt":
        return t.clamp_min(1e-3) ** -2
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * t + 2 * t**2))
    if scheme == "logit_normal":
        tc = t.double().clamp(1e-6, 1 - 1e-6)
        z = (torch.logit(tc) - logit_mean) / logit_std
        return (torch.exp(-z * z / 2) / (logit_std * math.sqrt(2 * math.pi) * tc * (1 - tc))).float()
    if scheme == "mode":  # t = g(v) with v uniform: π(t) = 1 / g'(v), v = g⁻¹(t)
        v = _bisect(lambda x: mode_quantile(x, mode_scale), t)
        slope = 1 + mode_scale - mode_scale * math.pi / 2 * torch.sin(math.pi * v)
        return (1 / slope.clamp_min(1e-3)).float()
    raise ConfigError(
        f"loss weighting '{scheme}' is not known; choose one of {', '.join(LOSS_WEIGHTINGS)}."
        + did_you_mean(scheme, LOSS_WEIGHTINGS)
    )


def flow_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    t: torch.Tensor,
    weighting: str = "none",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted MSE (`weighted_mse`) with the per-sample weight of `weighting` at t."""
    return weighted_mse(pred, target, loss_weight(t, weighting), mask)


def weighted_mse(
    pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean squared error of each sample (in float32), times its weight, averaged.

    `mask` (0/1, broadcastable to `pred`) leaves elements out: each sample's error is then the mean over
    its kept elements (a given first frame that the model never predicts does not dilute the rest).
    """
    error = (pred.float() - target.float()).square()
    if mask is None:
        per_sample = error.flatten(1).mean(dim=1)
    else:
        mask = mask.to(error).expand_as(error).flatten(1)
        per_sample = (error.flatten(1) * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)
    return (per_sample * weights.to(per_sample.device)).mean()


@dataclass(frozen=True)
class FlowObjective:
    """Flow matching as a training objective (the default); `tuner.diffusion.ddpm.DDPMObjective` is the other.
    Both answer `discretize`, `add_noise` and `loss`, which is all the training loop asks."""

    weighting: str = "none"
    """One of `LOSS_WEIGHTINGS`."""
    logit_mean: float = 0.0
    """Of the `logit_normal` weighting's density."""
    logit_std: float = 1.0
    """Of the `logit_normal` weighting's density."""
    mode_scale: float = 1.29
    """Of the `mode` weighting's density."""

    def discretize(self, t: torch.Tensor) -> torch.Tensor:
        return t  # continuous time: every t is a level of its own

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return add_noise(x0, noise, t)

    def loss(
        self, pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        weights = loss_weight(t, self.weighting, self.logit_mean, self.logit_std, self.mode_scale)
        return weighted_mse(pred.float(), flow_target(x0, noise).float(), weights, mask)

    def initial_noise(self, noise: torch.Tensor) -> torch.Tensor:
        """Generation's starting point x_1 from standard normal `noise`."""
        return noise

    def velocity(self, x: torch.Tensor, t: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """The velocity generation steps along, from the network's output `pred` at x_t, t[B] ∈ [0, 1]."""
        return pred


@dataclass(frozen=True)
class X0FlowObjective(FlowObjective):
    """Flow matching for a network that predicts the clean sample x0 (a record's `flow_prediction = "x0"`;
    HiDream-O1), on noise of a larger scale.

    x_t = (1 − t)·x0 + t·s·ε (ε first clipped to ± `noise_clip_std` of its standard deviation, when set) and
    the loss is the squared error of x̂0 to x0: for pixels, a target of the picture's own scale whatever t.
    Sampling starts from s·ε and steps along the velocity (x_t − x̂0)/t, with t floored at 1e-3 (as HiDream-O1's
    own sampler does), which is the same ODE a velocity-predicting network would be trained to follow."""

    noise_scale: float = 1.0
    noise_clip_std: float = 0.0
    t_floor: float = 1e-3

    def scaled_noise(self, noise: torch.Tensor) -> torch.Tensor:
        if self.noise_clip_std > 0:
            bound = self.noise_clip_std * noise.float().std()
            noise = noise.clamp(-bound, bound)
        return noise * self.noise_scale

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return add_noise(x0, self.scaled_noise(noise), t)

    def loss(
        self, pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        weights = loss_weight(t, self.weighting, self.logit_mean, self.logit_std, self.mode_scale)
        return weighted_mse(pred.float(), x0.float(), weights, mask)

    def initial_noise(self, noise: torch.Tensor) -> torch.Tensor:
        return self.scaled_noise(noise)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        tb = t.float().clamp_min(self.t_floor).reshape(-1, *([1] * (x.ndim - 1)))
        return (x.float() - pred.float()) / tb
