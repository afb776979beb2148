"""The timestep modes and loss weightings brought over from musubi-tuner / SD3 (tuner.diffusion.timesteps).

Each is checked against an independent computation: the formula as musubi-tuner / diffusers write it
(drawn here from its own uniform or normal numbers), or a closed-form CDF written out differently from
the module's, compared with 200k draws of the sampler.
"""

import math
from statistics import NormalDist

import pytest
import torch

from tuner.diffusion.timesteps import MODES, TimestepSampler, loss_weight
from tuner.errors import ConfigError

N = 200_000
QS = (0.05, 0.25, 0.5, 0.75, 0.95)
PHI = NormalDist()


def draw(sampler: TimestepSampler, seq_len=1024, n=N) -> torch.Tensor:
    return sampler.sample(n, torch.Generator().manual_seed(0), seq_len=seq_len)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def assert_cdf(t: torch.Tensor, cdf, points=(0.05, 0.2, 0.4, 0.6, 0.8, 0.95), tol=0.004):
    for x in points:
        assert (t <= x).double().mean().item() == pytest.approx(cdf(x), abs=tol), f"P(t <= {x})"


def musubi_mode(u: torch.Tensor, s: float) -> torch.Tensor:
    """diffusers' / musubi-tuner's mode sampling, in their own (decreasing in u) form."""
    return 1 - u - s * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)


# -- each new mode against its formula ---------------------------------------------------------


@pytest.mark.parametrize("mean,std", [(0.0, 1.0), (-1.5, 2.0)])
def test_logsnr_is_sigmoid_of_minus_half_a_normal_log_snr(mean, std):
    t = draw(TimestepSampler("logsnr", logit_mean=mean, logit_std=std))
    # t = sigmoid(-λ/2) <= x  <=>  λ >= -2 logit(x), λ ~ N(mean, std)
    assert_cdf(t, lambda x: 1 - PHI.cdf((-2 * logit(x) - mean) / std))


@pytest.mark.parametrize("scale", [1.29, 0.0, -0.8])
def test_mode_matches_the_sd3_formula(scale):
    ours = draw(TimestepSampler("mode", mode_scale=scale)).double()
    theirs = musubi_mode(
        torch.rand(N, generator=torch.Generator().manual_seed(1), dtype=torch.float64), scale
    )
    for q in QS:
        assert torch.quantile(ours[:100_000], q).item() == pytest.approx(
            torch.quantile(theirs[:100_000], q).item(), abs=0.006
        )
    if scale == 0.0:
        assert_cdf(ours, lambda x: x)


def test_mode_scale_outside_the_monotone_range_is_refused():
    with pytest.raises(ConfigError, match="mode_scale must be in"):
        TimestepSampler("mode", mode_scale=1.8)
    with pytest.raises(ConfigError, match="mode_scale"):
        TimestepSampler("mode", mode_scale=-1.2)


def test_flux2_shift_is_flux1s_line_on_the_models_own_tokens():
    for seq_len in (256, 1024, 4096):
        a = draw(TimestepSampler("flux2_shift"), seq_len=seq_len, n=1000)
        b = draw(TimestepSampler("flux_shift"), seq_len=seq_len, n=1000)
        assert torch.equal(a, b)
    # musubi-tuner's flux2_shift on a 64×64 packed FLUX.2 latent: μ from h·w = 4096 tokens, μ = 1.15
    t = draw(TimestepSampler("flux2_shift"), seq_len=64 * 64)
    assert t.median().item() == pytest.approx(math.exp(1.15) / (math.exp(1.15) + 1), abs=0.005)


@pytest.mark.parametrize("mode,line", [("qinglong_flux", (4096, 1.15)), ("qinglong_qwen", (8192, 0.9))])
def test_qinglong_is_the_80_7_5_12_5_mixture(mode, line):
    seq_len, mu = line  # at max_seq_len μ is the line's max_shift
    shift = math.exp(mu)
    mean, std = 0.7, 1.3
    t = draw(TimestepSampler(mode, logit_mean=mean, logit_std=std, sigmoid_scale=1.2), seq_len=seq_len)

    def cdf(x: float) -> float:
        unshifted = x / (shift - (shift - 1) * x)
        shifted_part = PHI.cdf(logit(unshifted) / 1.2)
        logsnr_part = 1 - PHI.cdf((-2 * logit(x) - mean) / std)
        detail_part = 1 - PHI.cdf(-2 * logit(x) - 5.36)
        return 0.8 * shifted_part + 0.075 * logsnr_part + 0.125 * detail_part

    assert_cdf(t, cdf, points=(0.02, 0.05, 0.1, 0.3, 0.5, 0.7, 0.9))
    # the detail part: 12.5 % of draws near t = sigmoid(-2.68) ≈ 0.064
    assert (t < 0.15).double().mean().item() > 0.125


# -- min / max with every mode -----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_min_max_truncate_every_mode_keeping_its_shape(mode):
    full = TimestepSampler(mode, discrete_flow_shift=3.0)
    cut = TimestepSampler(mode, discrete_flow_shift=3.0, min_timestep=0.3, max_timestep=0.8)
    t_full, t = draw(full, n=100_000), draw(cut, n=100_000)
    assert t.min() >= 0.3 and t.max() <= 0.8
    inside = t_full[(t_full >= 0.3) & (t_full <= 0.8)]
    for x in (0.4, 0.55, 0.7):
        expected = (inside <= x).double().mean().item()
        assert (t <= x).double().mean().item() == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize("mode", ["sigmoid", "logsnr", "qinglong_flux"])
def test_range_mode_scale_squeezes_the_whole_distribution(mode):
    full = draw(TimestepSampler(mode), n=100_000)
    squeezed = draw(TimestepSampler(mode, min_timestep=0.2, max_timestep=0.6, range_mode="scale"), n=100_000)
    torch.testing.assert_close(squeezed, (0.2 + 0.4 * full).clamp(0.2, 0.6))  # musubi-tuner's default
    with pytest.raises(ConfigError, match="range_mode 'clip'.*truncate, scale"):
        TimestepSampler(mode, range_mode="clip")


# -- loss weightings ---------------------------------------------------------------------------


def histogram_density(t: torch.Tensor, bins: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    density = torch.histc(t.float(), bins=bins, min=0.0, max=1.0) * bins / len(t)
    centres = (torch.arange(bins, dtype=torch.float32) + 0.5) / bins
    return centres, density


def test_logit_normal_weight_is_the_density_of_the_logit_normal_mode():
    mean, std = 0.5, 0.8
    centres, density = histogram_density(
        draw(TimestepSampler("logit_normal", logit_mean=mean, logit_std=std))
    )
    weight = loss_weight(centres, "logit_normal", logit_mean=mean, logit_std=std)
    torch.testing.assert_close(weight, density, atol=0.05, rtol=0.03)


@pytest.mark.parametrize("scale", [1.29, -0.5])
def test_mode_weight_is_the_density_of_sd3_mode_sampling(scale):
    u = torch.rand(N, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    centres, density = histogram_density(musubi_mode(u, scale))
    inner = slice(1, -1)  # the end bins average a density that is steep there
    weight = loss_weight(centres, "mode", mode_scale=scale)
    torch.testing.assert_close(weight[inner], density[inner], atol=0.05, rtol=0.03)
    assert loss_weight(torch.tensor([0.3, 0.7]), "mode", mode_scale=0.0).tolist() == pytest.approx([1.0, 1.0])


def test_new_weightings_reach_the_flow_objective_from_config():
    from tuner.config.schema import TimestepConfig
    from tuner.diffusion.ddpm import objective_from_config

    section = TimestepConfig(loss_weighting="logit_normal", logit_mean=1.0, logit_std=0.5)
    objective = objective_from_config("flow", section, "flux")
    x0, noise = torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2)
    t = torch.tensor([0.3, 0.7])
    pred = torch.zeros_like(x0)  # error 1 everywhere: the loss is the mean weight
    expected = loss_weight(t, "logit_normal", logit_mean=1.0, logit_std=0.5).mean()
    assert objective.loss(pred, x0, noise, t).item() == pytest.approx(expected.item())
    assert expected.item() != pytest.approx(loss_weight(t, "logit_normal").mean().item())
