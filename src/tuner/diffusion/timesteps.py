"""Flow matching: which timesteps to train on, how to noise a latent, and the loss.

Flow matching (rectified flow) joins a clean latent x0 and Gaussian noise ε with a straight line

    x_t = (1 − t) · x0 + t · ε,        t ∈ [0, 1],  t = 0 is clean, t = 1 is pure noise,

and trains the model to predict the velocity of that line, dx_t/dt = ε − x0 (`flow_target`). The
same velocity is the target at every t; what changes between recipes is *which* t the model sees
during training. Uniform t spends as many steps on nearly clean latents (easy, little signal) as on
the middle of the path, where the model decides layout and colour. So trainers draw t from a
distribution that puts more mass in the middle or, for large images and videos, towards noise:

- `uniform`: t ~ U(0, 1).
- `sigmoid`: t = sigmoid(sigmoid_scale · n), n ~ N(0, 1). A bump around 0.5; a larger scale flattens it.
- `logit_normal`: t = sigmoid(n), n ~ N(logit_mean, logit_std) (SD3's default; its median is
  sigmoid(logit_mean)).
- `shift`: draw t from `uniform` or `sigmoid` (`shift_from`), then apply the discrete flow shift
  t' = s·t / (1 + (s − 1)·t) with s = `discrete_flow_shift`. s > 1 moves mass towards noise, which
  large latents need: more pixels carry more redundant signal, so a given t destroys less of the
  image and the model must see noisier inputs to learn composition (Wan uses s = 3..12).
- `flux_shift` / `qwen_shift` / `krea2_shift`: the same shift, with s = exp(μ) chosen from the image-token count:
  μ is linear in the number of tokens, through (base_seq_len, base_shift) and (max_seq_len,
  max_shift) (see `RESOLUTION_SHIFTS`), applied to sigmoid-normal t. Written as in FLUX's reference
  code this is t' = e^μ / (e^μ + (1/t − 1)), which is algebraically the shift above.
- `ideogram4_shift`: `logit_normal` with mean 0.5·ln(pixels / 512²) and std 1.5 (musubi-tuner's mode for
  Ideogram 4, the mean its pipeline's sampling schedule takes): a 1024² image centres t at sigmoid(ln 2).

Every mode is a monotone function of one uniform draw u (`TimestepSampler.quantile`). That makes
`min_timestep` / `max_timestep` exact and cheap: u is drawn between the CDF values of the two bounds,
so the distribution is *truncated* to [min, max] keeping its shape inside, with no rejection loop.

Units: tuner works with t in [0, 1] everywhere, including `min_timestep` / `max_timestep`. Models
in diffusers take t · 1000; the trainer multiplies at the call site.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from statistics import NormalDist
from typing import Any

import torch

from tuner.errors import ConfigError, did_you_mean
from tuner.io import atomic_path

MODES = (
    "uniform",
    "sigmoid",
    "logit_normal",
    "shift",
    "flux_shift",
    "qwen_shift",
    "krea2_shift",
    "ideogram4_shift",
)
SHIFT_FROM = ("uniform", "sigmoid")
LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")


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
# base 256 → 0.5, max 6400 → 1.15, musubi-tuner's `krea2_shift`).
RESOLUTION_SHIFTS = {
    "flux_shift": ResolutionShift(base_seq_len=256, base_shift=0.5, max_seq_len=4096, max_shift=1.15),
    "qwen_shift": ResolutionShift(base_seq_len=256, base_shift=0.5, max_seq_len=8192, max_shift=0.9),
    "krea2_shift": ResolutionShift(base_seq_len=256, base_shift=0.5, max_seq_len=6400, max_shift=1.15),
}


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Discrete flow shift t' = s·t / (1 + (s − 1)·t). Keeps 0 → 0 and 1 → 1; s > 1 pushes t towards 1."""
    return shift * t / (1 + (shift - 1) * t)


def _sigmoid_scalar(x: float) -> float:
    if x == math.inf:
        return 1.0
    if x == -math.inf:
        return 0.0
    return 1.0 / (1.0 + math.exp(-x))


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


@dataclass(frozen=True)
class TimestepSampler:
    """Draws training timesteps t ∈ [min_timestep, max_timestep] ⊆ [0, 1]; see the module docstring."""

    mode: str
    """One of `MODES`."""
    sigmoid_scale: float = 1.0
    """k in sigmoid(k · N(0, 1)); used by `sigmoid`, `shift` from sigmoid and the resolution shifts."""
    logit_mean: float = 0.0
    """Mean of the normal inside `logit_normal`; the median of t is sigmoid(logit_mean)."""
    logit_std: float = 1.0
    """Standard deviation of the normal inside `logit_normal`."""
    discrete_flow_shift: float = 1.0
    """s in t' = s·t / (1 + (s − 1)·t) for mode `shift`; 1 leaves t unchanged."""
    shift_from: str = "sigmoid"
    """Distribution that mode `shift` draws before shifting: `uniform` or `sigmoid`."""
    min_timestep: float = 0.0
    """Lower bound of t, in [0, 1] (not 0..1000). The distribution is truncated, not squeezed."""
    max_timestep: float = 1.0
    """Upper bound of t, in [0, 1] (not 0..1000)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(
                f"timestep mode '{self.mode}' is not known; choose one of {', '.join(MODES)}."
                + did_you_mean(self.mode, MODES)
            )
        if self.shift_from not in SHIFT_FROM:
            raise ConfigError(
                f"shift_from must be one of {', '.join(SHIFT_FROM)}, got '{self.shift_from}'."
                + did_you_mean(self.shift_from, SHIFT_FROM)
            )
        for name in ("sigmoid_scale", "logit_std", "discrete_flow_shift"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number, got {value}.")
        if not math.isfinite(self.logit_mean):
            raise ConfigError(f"logit_mean must be a finite number, got {self.logit_mean}.")
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
        """The shift s applied after the base draw (1.0 for modes without a shift)."""
        if self.mode == "shift":
            return self.discrete_flow_shift
        if self.mode in RESOLUTION_SHIFTS:
            if seq_len is None:
                raise ValueError(f"timestep mode '{self.mode}' needs seq_len (the image-token count).")
            return math.exp(RESOLUTION_SHIFTS[self.mode].mu(seq_len))
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
        return 0.0, self.sigmoid_scale

    def quantile(self, u: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """Map u ∈ [0, 1] to t with P(t ≤ quantile(u)) = u, ignoring min/max. Monotone in u."""
        if self._base_is_uniform():
            t = u
        else:
            mean, std = self._normal_params(seq_len)
            t = torch.sigmoid(mean + std * torch.special.ndtri(u))
        shift = self.shift_for(seq_len)
        return t if shift == 1.0 else shift_timesteps(t, shift)

    def cdf(self, t: float, seq_len: int | None = None) -> float:
        """P(t' ≤ t) before truncation to [min, max]: the inverse of `quantile`."""
        shift = self.shift_for(seq_len)
        base_t = t if shift == 1.0 else t / (shift - (shift - 1) * t)  # inverse shift = shift by 1/s
        if self._base_is_uniform():
            return base_t
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
        lo, hi = self.cdf(self.min_timestep, seq_len), self.cdf(self.max_timestep, seq_len)
        t = self.quantile(lo + (hi - lo) * u, seq_len)
        # Rounding in float32 can land a hair outside the bounds.
        return t.clamp(self.min_timestep, self.max_timestep).to(device)

    def describe(self, seq_len: int | None = None) -> str:
        """One line naming the mode and the parameters that affect it (for logs and plot titles)."""
        params: list[str] = []
        if self.mode == "logit_normal":
            params += [f"logit_mean={self.logit_mean:g}", f"logit_std={self.logit_std:g}"]
        if self.mode == "shift":
            params += [f"discrete_flow_shift={self.discrete_flow_shift:g}", f"shift_from={self.shift_from}"]
        uses_sigmoid = self.mode in ("sigmoid", *RESOLUTION_SHIFTS) or (
            self.mode == "shift" and self.shift_from == "sigmoid"
        )
        if uses_sigmoid:
            params.append(f"sigmoid_scale={self.sigmoid_scale:g}")
        if self.mode in RESOLUTION_SHIFTS and seq_len is not None:
            params += [f"seq_len={seq_len}", f"shift={self.shift_for(seq_len):.3g}"]
        if (self.min_timestep, self.max_timestep) != (0.0, 1.0):
            params.append(f"t in [{self.min_timestep:g}, {self.max_timestep:g}]")
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


def loss_weight(t: torch.Tensor, scheme: str) -> torch.Tensor:
    """Per-sample loss weight for t[B] (the formulas of SD3, Esser et al. 2024, as in diffusers).

    - `none`: 1.
    - `sigma_sqrt`: σ⁻² with σ = t. It explodes as t → 0, so t is floored at 1e-3 (weight ≤ 1e6).
    - `cosmap`: 2 / (π · (1 − 2t + 2t²)), the density that makes t follow a cosine schedule.
    """
    t = t.float()
    if scheme == "none":
        return torch.ones_like(t)
    if scheme == "sigma_sqrt":
        return t.clamp_min(1e-3) ** -2
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * t + 2 * t**2))
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

    def discretize(self, t: torch.Tensor) -> torch.Tensor:
        return t  # continuous time: every t is a level of its own

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return add_noise(x0, noise, t)

    def loss(
        self, pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return flow_loss(pred.float(), flow_target(x0, noise).float(), t, self.weighting, mask=mask)


# -- histogram (Pillow only, so `tuner timesteps` works without matplotlib) --------------------


def plot_histogram(
    sampler: TimestepSampler,
    out_png: str | Path,
    n: int = 100_000,
    bins: int = 50,
    seq_len: int | None = None,
) -> Path:
    """Draw `n` timesteps (seed 0) and write their histogram as a PNG; returns the path written."""
    from PIL import Image, ImageDraw, ImageFont

    t = sampler.sample(n, torch.Generator().manual_seed(0), seq_len=seq_len)
    density = torch.histc(t, bins=bins, min=0.0, max=1.0) * bins / n  # integrates to 1 over [0, 1]
    top = max(float(density.max()), 1e-12)

    width, height = 720, 440
    left, right, upper, lower = 70, 30, 60, 60  # margins around the plot area
    plot_w, plot_h = width - left - right, height - upper - lower
    x_axis_y = upper + plot_h
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=14)

    def text(x: float, y: float, s: str, align: str = "center") -> None:
        x0, y0, x1, y1 = draw.textbbox((0, 0), s, font=font)
        dx = {"center": (x1 - x0) / 2, "right": x1 - x0, "left": 0}[align]
        draw.text((x - dx, y - (y1 - y0) / 2), s, fill="black", font=font)

    for i, value in enumerate(density.tolist()):
        bar_h = value / top * plot_h
        x0, x1 = left + i * plot_w / bins, left + (i + 1) * plot_w / bins
        if bar_h > 0:
            draw.rectangle([x0, x_axis_y - bar_h, max(x0, x1 - 1), x_axis_y], fill=(70, 120, 190))

    draw.line([(left, upper), (left, x_axis_y), (left + plot_w, x_axis_y)], fill="black", width=2)
    for frac, label in ((0.0, "0"), (0.5, "0.5"), (1.0, "1")):
        x = left + frac * plot_w
        draw.line([(x, x_axis_y), (x, x_axis_y + 6)], fill="black", width=2)
        text(x, x_axis_y + 16, label)
    for frac in (0.0, 1.0):
        y = x_axis_y - frac * plot_h
        draw.line([(left - 6, y), (left, y)], fill="black", width=2)
        text(left - 10, y, f"{frac * top:.2f}", align="right")
    text(left + plot_w / 2, height - 20, "t  (0 = clean, 1 = noise; the model sees t * 1000)")
    text(left - 10, upper - 16, "density", align="left")
    text(width / 2, 20, f"timesteps: {sampler.describe(seq_len)}  [n={n}]")

    out = Path(out_png)
    with atomic_path(out) as tmp:
        image.save(tmp, format="PNG")
    return out
