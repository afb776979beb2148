"""Each architecture's sampling defaults (`tuner.archs.record.SamplingDefaults`): they resolve, the CLI and
`[sample]` override them, and guidance in the release's convention reaches the sampler as plain CFG."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from project import make_project, run
from tuner.archs.record import CFG_FORMS
from tuner.cli import build_parser
from tuner.config.schema import OneFrameConfig
from tuner.diffusion.timesteps import RESOLUTION_SHIFTS, STEP_SHIFTS
from tuner.generate import GenerateOptions, check_options, resolve_options, sample_latents, sampling_summary
from tuner.registry import ARCHITECTURES
from tuner.trainers import trainer_class

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _family(arch: str, transformer: str = "model.safetensors"):
    model = SimpleNamespace(transformer=transformer, guidance=1.0)
    return trainer_class(arch)(SimpleNamespace(model=model, one_frame=OneFrameConfig()))


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_architectures_defaults_resolve(name):
    """Each record's defaults (and each file-name variant's) are valid numbers with a source, and fill every
    unset option of `tuner generate`."""
    record = ARCHITECTURES[name]
    for pattern, defaults in (("", record.sampling), *record.sampling.by_name):
        re.compile(pattern)
        assert defaults.steps >= 1 and defaults.guidance >= 0 and defaults.cfg_form in CFG_FORMS
        assert defaults.source and not (pattern and defaults.by_name)
        assert (defaults.shift is None) == (record.objective != "flow")
        assert (
            defaults.shift is None
            or defaults.shift in {**RESOLUTION_SHIFTS, **STEP_SHIFTS}
            or float(defaults.shift) > 0
        )
        assert defaults.embedded_guidance is None or defaults.embedded_guidance > 0
        assert not defaults.zero_empty_negative or record.objective == "ddpm"
    family = _family(name)
    frames = 1 if record.supports_images else record.frame_multiple + record.frame_remainder
    opts = resolve_options(
        family, GenerateOptions(prompt="x", out="o.png", width=64, height=64, frames=frames)
    )
    assert (opts.steps, opts.guidance_scale) == (record.sampling.steps, record.sampling.guidance)
    assert opts.negative_prompt == record.sampling.negative_prompt
    assert opts.embedded_guidance == record.sampling.embedded_guidance
    assert (opts.shift is None) == (record.objective != "flow")
    assert name in sampling_summary(family, opts)


@pytest.mark.parametrize(
    "arch, transformer, steps, guidance, shift",
    [
        ("kandinsky5", "kandinsky5lite_t2v_distilled16steps_5s.safetensors", 16, 1.0, 10.0),
        ("kandinsky5", "kandinsky5lite_t2v_nocfg_5s.safetensors", 50, 1.0, 10.0),
        ("kandinsky5", "kandinsky5lite_t2v_sft_5s.safetensors", 50, 5.0, 10.0),
        ("hidream", "hidream_i1_dev_bf16.safetensors", 28, 1.0, 6.0),
        ("z_image", "z_image_turbo_bf16.safetensors", 8, 0.0, 3.0),
        ("krea2", "Krea-2-Turbo", 8, 0.0, 3.158193),
    ],
)
def test_the_transformers_name_picks_its_release_defaults(arch, transformer, steps, guidance, shift):
    opts = resolve_options(_family(arch, transformer), GenerateOptions(prompt="x", out="o.png", width=64,
                                                                       height=64, frames=1))  # fmt: skip
    assert (opts.steps, opts.guidance_scale) == (steps, guidance)
    assert opts.shift == pytest.approx(shift, rel=1e-6)


def test_given_options_beat_the_defaults():
    family = _family("flux")
    given = GenerateOptions(prompt="x", out="o.png", width=64, height=64, frames=1, steps=7, guidance_scale=2.0,
                            embedded_guidance=5.0, shift=1.5, negative_prompt="blur")  # fmt: skip
    assert resolve_options(family, given) == given
    args = build_parser().parse_args(["generate", "--config", "c.toml", "--prompt", "x", "--out", "o.png"])
    assert (args.steps, args.guidance, args.embedded_guidance, args.shift, args.negative_prompt) == (
        None,
    ) * 5
    args = build_parser().parse_args(["generate", "--config", "c.toml", "--prompt", "x", "--out", "o.png",
                                      "--steps", "7", "--guidance", "2"])  # fmt: skip
    assert (args.steps, args.guidance) == (7, 2.0)


def test_embedded_guidance_is_refused_where_there_is_no_embedding():
    from tuner.errors import ConfigError

    opts = GenerateOptions(prompt="x", out="o.png", width=64, height=64, frames=1, embedded_guidance=3.5)
    check_options(_family("flux"), opts)
    with pytest.raises(ConfigError, match="--embedded-guidance 3.5: wan takes no guidance-embedding value"):
        check_options(_family("wan"), replace_frames(opts))


def replace_frames(opts):
    from dataclasses import replace

    return replace(opts, frames=1)


def test_cfg_forms_turn_the_releases_number_into_plain_cfg():
    """Cosmos', Z-Image's and Krea 2's cond + g·(cond − uncond) is plain CFG at g + 1: their documented 7 / 5 / 4.5 are
    typed as such; the others' number is the plain scale."""
    cond, uncond = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    for arch, g in (("cosmos_predict2", 7.0), ("z_image", 5.0), ("krea2", 4.5)):
        plain = ARCHITECTURES[arch].sampling.plain_guidance(g)
        torch.testing.assert_close(uncond + plain * (cond - uncond), cond + g * (cond - uncond))
    assert ARCHITECTURES["aura_flow"].sampling.plain_guidance(3.5) == 3.5


def test_generate_logs_the_settings_it_ran_with(tmp_path, wan_model, capsys):
    config = make_project(tmp_path, wan_model)
    code, out = run(capsys, "generate", "--config", config, "--prompt", "x", "--size", "64x48", "--frames", "1",
                    "--steps", "2", "--device", "cpu", "--out", tmp_path / "o.png")  # fmt: skip
    assert code == 0, out
    assert "wan sampling: 2 steps, guidance 5, shift 3 (defaults: diffusers WanPipeline's" in out


def test_help_lists_each_architectures_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = capsys.readouterr().out
    for name, record in ARCHITECTURES.items():
        assert f"  {name} " in out and record.sampling.summary() in out


def test_sampling_feeds_the_embedded_guidance_then_restores_the_trained_one():
    """A guidance-distilled model's embedding reads `model.guidance`: 1.0 while training, the release's 3.5
    (or `--embedded-guidance`) while sampling."""
    from tuner.config import load_config

    family = trainer_class("flux")(load_config(EXAMPLES / "flux_dev_lora.toml", check_paths=False))
    seen = []

    def predict(model, x, t, cond):
        seen.append(family.cfg.model.guidance)
        return torch.zeros_like(x)

    family.predict = predict
    for given, fed in ((None, 3.5), (5.0, 5.0)):
        opts = GenerateOptions(
            prompt="x", out="", width=32, height=32, frames=1, steps=1, embedded_guidance=given
        )
        sample_latents(family, None, opts, {}, {}, "cpu", torch.float32, progress=False)
        assert seen.pop() == fed and family.cfg.model.guidance == 1.0
