"""Euler sampling and classifier-free guidance for flow-matching models (tuner.diffusion.sampling)."""

import pytest
import torch

from tuner.diffusion.sampling import euler_sample, flow_sigmas
from tuner.diffusion.timesteps import add_noise
from tuner.errors import ConfigError


def latents(shape=(2, 4, 3, 8, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_flow_sigmas_run_from_one_to_zero_and_shift_towards_noise():
    plain = flow_sigmas(4)
    torch.testing.assert_close(plain, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    shifted = flow_sigmas(4, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0 and len(shifted) == 5
    assert shifted[2].item() == pytest.approx(0.75)  # 3 * 0.5 / (1 + 2 * 0.5)
    assert (shifted[1:] < shifted[:-1]).all() and (shifted >= plain).all()
    with pytest.raises(ConfigError, match="steps"):
        flow_sigmas(0)
    with pytest.raises(ConfigError, match="shift"):
        flow_sigmas(4, shift=0.0)


def test_flow_sigmas_stretched_to_a_terminal_equal_diffusers_scheduler():
    """`terminal` (Qwen-Image's `shift_terminal` 0.02): the times diffusers' scheduler steps through when
    given the same evenly spaced times and shift; the last before 0 is the terminal."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, shift_terminal=0.02)
    for steps in (2, 9):
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps))
        ours = flow_sigmas(steps, 3.0, terminal=0.02)
        torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=1e-6, atol=1e-6)
        assert ours[-2].item() == pytest.approx(0.02) and ours[-1] == 0


@pytest.mark.parametrize("steps, shift", [(1, 1.0), (7, 3.0)])
def test_exact_velocity_model_recovers_x0(steps, shift):
    x0, noise = latents()
    calls = []

    def model_fn(x, t, cond):
        calls.append(t)
        # The exact field of the straight path to this x0: x_t - x0 = t * (noise - x0).
        return (x - cond) / (t / 1000).view(-1, 1, 1, 1, 1)

    out = euler_sample(model_fn, noise, flow_sigmas(steps, shift), cond=x0)
    torch.testing.assert_close(out, x0, atol=1e-5, rtol=1e-5)
    assert len(calls) == steps and calls[0].shape == (2,) and calls[0][0].item() == 1000.0


def test_starting_part_way_follows_the_same_path():
    x0, noise = latents(shape=(1, 4, 8, 8))
    sigmas = flow_sigmas(10)[4:]  # start at t = 0.6 from the noised latent
    start = add_noise(x0, noise, torch.tensor([0.6]))
    out = euler_sample(lambda x, t, c: noise - x0, start, sigmas, cond=None)
    torch.testing.assert_close(out, x0)


def test_sampling_is_deterministic_and_keeps_dtype():
    _, noise = latents(shape=(1, 4, 8, 8))
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))

    def model_fn(x, t, cond):  # a nonlinear stand-in for a network
        return torch.tanh(torch.einsum("bchw,cd->bdhw", x.float(), w)).to(x.dtype) * (t / 1000).view(
            -1, 1, 1, 1
        )

    sigmas = flow_sigmas(6, 2.0)
    a = euler_sample(model_fn, noise, sigmas, cond=None)
    b = euler_sample(model_fn, noise.clone(), sigmas, cond=None)
    assert torch.equal(a, b)
    assert euler_sample(model_fn, noise.bfloat16(), sigmas, cond=None).dtype == torch.bfloat16


# -- classifier-free guidance ------------------------------------------------------------------


class Recorder:
    """v = cond["shift"] per sample, plus a little of x so the path depends on the steps taken."""

    def __init__(self):
        self.batch_sizes = []
        self.conds = []

    def __call__(self, x, t, cond):
        self.batch_sizes.append(x.shape[0])
        self.conds.append(cond)
        return 0.1 * x + cond["shift"].view(-1, 1, 1, 1)


def cond_pair(uncond_len=5):
    cond = {"shift": torch.tensor([1.0, 2.0]), "text": torch.ones(2, 5, 8), "ids": torch.arange(3)}
    uncond = {
        "shift": torch.tensor([-1.0, 0.0]),
        "text": torch.zeros(2, uncond_len, 8),
        "ids": torch.arange(3),
    }
    return cond, uncond


def test_guidance_one_equals_conditional_and_skips_uncond():
    _, noise = latents(shape=(2, 4, 8, 8))
    cond, uncond = cond_pair()
    sigmas = flow_sigmas(5)
    plain, guided = Recorder(), Recorder()
    a = euler_sample(plain, noise, sigmas, cond)
    b = euler_sample(guided, noise, sigmas, cond, uncond=uncond, guidance_scale=1.0)
    assert torch.equal(a, b)
    assert guided.batch_sizes == [2] * 5 and all(c is cond for c in guided.conds)


def test_guidance_extrapolates_from_uncond_to_cond():
    _, noise = latents(shape=(2, 4, 8, 8))
    cond, uncond = cond_pair()
    g, sigmas = 4.0, flow_sigmas(1)  # one step from t = 1 to 0: x = noise - v(noise)
    out = euler_sample(Recorder(), noise, sigmas, cond, uncond=uncond, guidance_scale=g)
    v_cond, v_uncond = Recorder()(noise, None, cond), Recorder()(noise, None, uncond)
    torch.testing.assert_close(out, noise - (v_uncond + g * (v_cond - v_uncond)))


def test_cfg_batches_when_shapes_allow_and_matches_two_calls():
    _, noise = latents(shape=(2, 4, 8, 8))
    cond, uncond = cond_pair()
    batched, separate = Recorder(), Recorder()
    sigmas = flow_sigmas(4, 3.0)
    a = euler_sample(batched, noise, sigmas, cond, uncond=uncond, guidance_scale=5.0)
    b = euler_sample(separate, noise, sigmas, cond, uncond=uncond, guidance_scale=5.0, batch_cfg=False)
    torch.testing.assert_close(a, b)
    assert batched.batch_sizes == [4] * 4 and separate.batch_sizes == [2] * 8
    stacked = batched.conds[0]
    assert stacked["text"].shape == (4, 5, 8) and torch.equal(stacked["ids"], torch.arange(3))


def test_cfg_falls_back_to_two_calls_when_shapes_differ():
    _, noise = latents(shape=(2, 4, 8, 8))
    cond, uncond = cond_pair(uncond_len=3)  # different text lengths cannot share a batch
    recorder = Recorder()
    euler_sample(recorder, noise, flow_sigmas(3), cond, uncond=uncond, guidance_scale=3.0)
    assert recorder.batch_sizes == [2] * 6
    assert recorder.conds[0] is cond and recorder.conds[1] is uncond


def test_cfg_without_uncond_is_an_error():
    _, noise = latents(shape=(1, 4, 8, 8))
    with pytest.raises(ValueError, match="uncond"):
        euler_sample(Recorder(), noise, flow_sigmas(2), {"shift": torch.ones(1)}, guidance_scale=3.0)
