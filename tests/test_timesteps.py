"""Timestep sampling, noising and loss for flow matching (tuner.diffusion.timesteps).

Expected quantiles are written out from each mode's formula here, independently of the module's
own `quantile`, and compared with 200k draws (a quantile's sampling error is then about 0.003).
"""

import math
from statistics import NormalDist

import pytest
import torch
from PIL import Image

from tuner.diffusion.histogram import plot_histogram
from tuner.diffusion.timesteps import (
    RESOLUTION_SHIFTS,
    TimestepSampler,
    add_noise,
    flow_loss,
    flow_target,
    loss_weight,
    sampler_from_config,
)
from tuner.errors import ConfigError

N = 200_000
QS = (0.1, 0.25, 0.5, 0.75, 0.9)


def draw(sampler: TimestepSampler, seq_len=None, n=N) -> torch.Tensor:
    return sampler.sample(n, torch.Generator().manual_seed(0), seq_len=seq_len)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def shifted(t: float, s: float) -> float:
    return s * t / (1 + (s - 1) * t)


def assert_quantiles(t: torch.Tensor, expected_at, tol=0.005):
    for q in QS:
        got = torch.quantile(t[:100_000], q).item()  # torch.quantile caps its input size
        assert got == pytest.approx(expected_at(q), abs=tol), f"quantile {q}"


def z(q: float) -> float:
    return NormalDist().inv_cdf(q)


# -- each mode follows its formula -------------------------------------------------------------


def test_uniform():
    t = draw(TimestepSampler("uniform"))
    assert t.mean().item() == pytest.approx(0.5, abs=0.005)
    assert_quantiles(t, lambda q: q)


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_sigmoid(scale):
    t = draw(TimestepSampler("sigmoid", sigmoid_scale=scale))
    assert t.mean().item() == pytest.approx(0.5, abs=0.005)  # symmetric around 0.5
    assert_quantiles(t, lambda q: sigmoid(scale * z(q)))


def test_logit_normal_median_is_sigmoid_of_mean():
    t = draw(TimestepSampler("logit_normal", logit_mean=0.8, logit_std=0.5))
    assert t.median().item() == pytest.approx(sigmoid(0.8), abs=0.005)
    assert_quantiles(t, lambda q: sigmoid(0.8 + 0.5 * z(q)))


@pytest.mark.parametrize("shift_from", ["uniform", "sigmoid"])
def test_shift_follows_formula_and_moves_mass_towards_noise(shift_from):
    base = draw(TimestepSampler("shift", discrete_flow_shift=1.0, shift_from=shift_from))
    t = draw(TimestepSampler("shift", discrete_flow_shift=3.0, shift_from=shift_from))
    base_q = (lambda q: q) if shift_from == "uniform" else (lambda q: sigmoid(z(q)))
    assert_quantiles(t, lambda q: shifted(base_q(q), 3.0))
    assert t.mean() > base.mean() + 0.1
    assert draw(TimestepSampler("shift", discrete_flow_shift=0.5)).mean() < 0.45  # s < 1: towards clean


def test_flux_shift_matches_reference_formula_and_grows_with_resolution():
    sampler = TimestepSampler("flux_shift")
    t = draw(sampler, seq_len=1024)
    mu = 0.5 + (1.15 - 0.5) * (1024 - 256) / (4096 - 256)
    # FLUX's own way of writing the shift: e^mu / (e^mu + (1/t - 1)).
    assert_quantiles(t, lambda q: math.exp(mu) / (math.exp(mu) + (1 / sigmoid(z(q)) - 1)))
    medians = [draw(sampler, seq_len=s, n=50_000).median().item() for s in (256, 1024, 4096, 8192)]
    assert medians == sorted(medians) and medians[-1] - medians[0] > 0.1
    assert medians[0] == pytest.approx(sigmoid(0.5), abs=0.01)  # mu = 0.5 at 256 tokens: shift e^0.5


def test_qwen_shift_uses_qwen_image_scheduler_values():
    assert RESOLUTION_SHIFTS["qwen_shift"].mu(256) == pytest.approx(0.5)
    assert RESOLUTION_SHIFTS["qwen_shift"].mu(8192) == pytest.approx(0.9)
    t = draw(TimestepSampler("qwen_shift"), seq_len=8192)
    assert t.median().item() == pytest.approx(shifted(0.5, math.exp(0.9)), abs=0.005)


def test_resolution_shift_needs_seq_len():
    with pytest.raises(ValueError, match="seq_len"):
        TimestepSampler("qwen_shift").sample(4)


# -- range, determinism, devices ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["uniform", "sigmoid", "logit_normal", "shift", "flux_shift"])
def test_min_max_truncate_keeping_the_shape(mode):
    full = TimestepSampler(mode, discrete_flow_shift=3.0)
    cut = TimestepSampler(mode, discrete_flow_shift=3.0, min_timestep=0.3, max_timestep=0.8)
    t_full, t = draw(full, seq_len=1024), draw(cut, seq_len=1024)
    assert t.min() >= 0.3 and t.max() <= 0.8
    assert t.min() < 0.31 and t.max() > 0.79
    # Inside the window the distribution is the untruncated one, renormalised.
    inside = t_full[(t_full >= 0.3) & (t_full <= 0.8)]
    expected = ((inside <= 0.55).float().mean()).item()
    assert (t <= 0.55).float().mean().item() == pytest.approx(expected, abs=0.01)


def test_same_generator_same_timesteps_and_shape():
    sampler = TimestepSampler("logit_normal")
    a = sampler.sample(8, torch.Generator().manual_seed(3))
    b = sampler.sample(8, torch.Generator().manual_seed(3))
    assert a.shape == (8,) and a.dtype == torch.float32 and torch.equal(a, b)
    assert sampler.sample(2).shape == (2,)  # no generator: torch's global one


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"sigmoid_scale": 0.0}, "sigmoid_scale"),
        ({"logit_std": -1.0}, "logit_std"),
        ({"discrete_flow_shift": 0.0}, "discrete_flow_shift"),
        ({"logit_mean": math.nan}, "logit_mean"),
        ({"min_timestep": -0.1}, "min_timestep"),
        ({"max_timestep": 1000.0}, "max_timestep"),
        ({"min_timestep": 0.6, "max_timestep": 0.4}, "min_timestep"),
        ({"shift_from": "normal"}, "shift_from"),
    ],
)
def test_out_of_range_parameter_is_named(kwargs, param):
    with pytest.raises(ConfigError, match=param):
        TimestepSampler("shift", **kwargs)


def test_unknown_mode_suggests_the_closest():
    with pytest.raises(ConfigError, match="Did you mean 'logit_normal'"):
        TimestepSampler("logit_norm")


def test_sampler_from_config_section():
    from types import SimpleNamespace

    from tuner.config.schema import TimestepConfig

    section = SimpleNamespace(mode="logit_normal", logit_mean=0.3, loss_weighting="cosmap")
    assert sampler_from_config(section) == TimestepSampler("logit_normal", logit_mean=0.3)
    default = TimestepConfig(mode="shift")  # every field the trainer's config carries is understood
    assert sampler_from_config(default).discrete_flow_shift == default.discrete_flow_shift


# -- noising, target, loss ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 4, 8, 8), (2, 4, 3, 8, 8)])
def test_add_noise_endpoints_and_midpoint(shape):
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    assert torch.equal(add_noise(x0, noise, torch.zeros(2)), x0)
    assert torch.equal(add_noise(x0, noise, torch.ones(2)), noise)
    mixed = add_noise(x0, noise, torch.tensor([0.0, 0.25]))
    assert torch.equal(mixed[0], x0[0])
    torch.testing.assert_close(mixed[1], 0.75 * x0[1] + 0.25 * noise[1])
    # The target is the derivative of x_t in t.
    torch.testing.assert_close(flow_target(x0, noise), add_noise(x0, noise, torch.ones(2)) - x0)


def test_add_noise_keeps_latent_dtype():
    x0 = torch.zeros(1, 4, 2, 2, dtype=torch.bfloat16)
    assert add_noise(x0, torch.ones_like(x0), torch.tensor([0.5])).dtype == torch.bfloat16


def test_loss_weights_follow_their_formulas():
    t = torch.tensor([0.25, 0.5])
    torch.testing.assert_close(loss_weight(t, "none"), torch.ones(2))
    torch.testing.assert_close(loss_weight(t, "sigma_sqrt"), torch.tensor([16.0, 4.0]))
    torch.testing.assert_close(loss_weight(t, "cosmap"), 2 / (math.pi * (1 - 2 * t + 2 * t**2)))
    assert torch.isfinite(loss_weight(torch.zeros(1), "sigma_sqrt")).all()
    with pytest.raises(ConfigError, match="cosmap"):
        loss_weight(t, "cosmapp")


def test_flow_loss_is_zero_for_an_exact_prediction_and_weights_per_sample():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 4, 3, 4, 4, generator=g), torch.randn(2, 4, 3, 4, 4, generator=g)
    t = torch.tensor([0.25, 0.5])
    target = flow_target(x0, noise)
    assert flow_loss(target.clone(), target, t, "cosmap").item() == 0.0
    # Sample 0 off by 1 everywhere, sample 1 by 2: per-sample MSEs 1 and 4, weights 16 and 4.
    pred = target + torch.tensor([1.0, 2.0]).view(2, 1, 1, 1, 1)
    assert flow_loss(pred, target, t).item() == pytest.approx((1 + 4) / 2)
    assert flow_loss(pred, target, t, "sigma_sqrt").item() == pytest.approx((16 * 1 + 4 * 4) / 2)
    assert flow_loss(pred.bfloat16(), target, t).dtype == torch.float32


# -- histogram ---------------------------------------------------------------------------------


def test_plot_histogram_writes_a_png(tmp_path):
    out = plot_histogram(
        TimestepSampler("flux_shift", min_timestep=0.1), tmp_path / "hist.png", n=20_000, seq_len=4096
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 2_000 < out.stat().st_size < 200_000
    with Image.open(out) as image:
        assert image.format == "PNG" and image.width >= 400 and image.height >= 300
        colors = image.convert("RGB").getcolors(maxcolors=100_000)
    assert len(colors) > 3  # background, axes, bars, text
    assert [p.name for p in tmp_path.iterdir()] == ["hist.png"]  # no temporary left behind


def test_auto_mode_is_the_architectures_usual_sampler():
    from tuner.config.schema import TimestepConfig
    from tuner.trainers import trainer_class

    class Cfg:
        timesteps = TimestepConfig()

    assert TimestepConfig().mode == "auto"
    modes = {arch: trainer_class(arch)(Cfg).timestep_sampler().mode for arch in ("wan", "flux", "qwen_image")}
    assert modes == {"wan": "shift", "flux": "flux_shift", "qwen_image": "qwen_shift"}
