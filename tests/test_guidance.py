"""Adaptive projected guidance (`tuner.diffusion.guidance`) steps as diffusers' `AdaptiveProjectedMixGuidance`
does, step after step (its momentum sum carried), at HunyuanImage 2.1's settings and others."""

import pytest
import torch
from diffusers import AdaptiveProjectedMixGuidance

from tuner.diffusion.guidance import AdaptiveProjectedGuidance, ProjectedGuidance
from tuner.registry import architecture


@pytest.mark.parametrize(
    "settings",
    [
        ProjectedGuidance(**dict(architecture("hunyuan_image").sample_guidance)),
        ProjectedGuidance(scale=6.0, momentum=0.0, norm_threshold=0.0, eta=0.5, start_step=1),
    ],
    ids=["hunyuan_image", "plain"],
)
def test_each_step_equals_diffusers_mix_guider(settings):
    theirs = AdaptiveProjectedMixGuidance(
        guidance_scale=3.5, adaptive_projected_guidance_scale=settings.scale,
        adaptive_projected_guidance_momentum=settings.momentum,
        adaptive_projected_guidance_rescale=settings.norm_threshold, eta=settings.eta,
        adaptive_projected_guidance_start_step=settings.start_step,
    )  # fmt: skip
    ours = AdaptiveProjectedGuidance(settings)
    generator = torch.Generator().manual_seed(0)
    steps = settings.start_step + 4
    for step in range(steps):
        cond, uncond = (4 * torch.randn(2, 8, 3, 5, generator=generator) for _ in range(2))
        theirs.set_state(step=step, num_inference_steps=steps, timestep=torch.tensor(1.0))
        theirs.prepare_inputs({"x": (cond, uncond)})  # starts its momentum sum at step 0
        want = theirs.forward(cond, uncond).pred  # norms and projections per sample, as ours
        torch.testing.assert_close(ours(cond, uncond, 3.5), want, rtol=1e-5, atol=1e-5)
