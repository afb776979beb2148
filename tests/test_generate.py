"""Pieces of `tuner generate` that need no model: sampling shift defaults, output files, argument checks."""

import math
from types import SimpleNamespace

import av
import pytest
import torch
from PIL import Image

from project import make_project, run
from tuner.generate import write_media
from tuner.trainers import trainer_class


@pytest.mark.parametrize(
    "arch, size, expected",
    [
        ("wan", (832, 480, 81), 3.0),
        ("flux", (1024, 1024, 1), math.exp(1.15)),  # 4096 image tokens: FLUX's max_shift
        ("flux", (512, 512, 1), math.exp(0.5 + (1024 - 256) * (1.15 - 0.5) / (4096 - 256))),
        ("qwen_image", (1024, 1024, 1), math.exp(0.5 + (4096 - 256) * (0.9 - 0.5) / (8192 - 256))),
    ],
)
def test_default_sample_shift_follows_the_model(arch, size, expected):
    trainer = trainer_class(arch)(cfg=SimpleNamespace(model=SimpleNamespace(transformer="model.safetensors")))
    assert trainer.default_sample_shift(trainer.latent_shape(*size)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("tokens, steps", [(4096, 50), (256, 2), (1024, 28), (8100, 50)])
def test_flux2_sample_shift_is_its_pipelines_empirical_mu(tokens, steps):
    """FLUX.2's shift e^μ with μ from the token count and the step count, as Flux2Pipeline computes it."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    trainer = trainer_class("flux2")(
        cfg=SimpleNamespace(model=SimpleNamespace(transformer="model.safetensors"))
    )
    side = round(math.sqrt(tokens)) * 16
    got = trainer.default_sample_shift(trainer.latent_shape(side, side, 1), steps)
    assert got == pytest.approx(math.exp(compute_empirical_mu(tokens, steps)), rel=1e-6)


def test_write_media_png_and_mp4(tmp_path):
    video = torch.rand(3, 5, 32, 48) * 2 - 1
    out = write_media(video, tmp_path / "v.mp4", fps=16)
    with av.open(str(out)) as c:
        frames = list(c.decode(video=0))
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == (48, 32)
    png = write_media(video[:, :1], tmp_path / "i.mp4", fps=16)  # one frame becomes a PNG
    assert png.suffix == ".png" and Image.open(png).size == (48, 32)


def test_control_count_is_checked_before_loading(tmp_path, wan_model, capsys):
    config = make_project(tmp_path, wan_model)
    image = tmp_path / "data" / "images" / "image_000.png"
    code, out = run(capsys, "generate", "--config", config, "--prompt", "x", "--control", image, "--size", "64x48",
                    "--frames", "1", "--out", tmp_path / "o.png")  # fmt: skip
    assert code == 2 and "control" in out


def test_qwen_true_cfg_keeps_each_token_at_the_conditional_norm():
    from tuner.archs.qwen_image.loaders import pack_latents

    trainer = trainer_class("qwen_image")(cfg=None)
    gen = torch.Generator().manual_seed(0)
    v_cond, v_uncond = (torch.randn(1, 16, 1, 8, 6, generator=gen) for _ in range(2))
    out = trainer.combine_guidance(v_cond, v_uncond, 4.0)
    assert out.shape == v_cond.shape
    torch.testing.assert_close(pack_latents(out).norm(dim=-1), pack_latents(v_cond).norm(dim=-1))
    plain = v_uncond + 4.0 * (v_cond - v_uncond)  # same direction as plain guidance, per token
    cos = torch.nn.functional.cosine_similarity(pack_latents(out), pack_latents(plain), dim=-1)
    torch.testing.assert_close(cos, torch.ones_like(cos))
    torch.testing.assert_close(trainer_class("wan")(cfg=None).combine_guidance(v_cond, v_uncond, 4.0), plain)


@pytest.mark.slow
def test_several_loras_add_up_with_their_strengths(tmp_path, wan_model, capsys):
    """Two copies of a LoRA at 1.0 each act as one at 2.0; strength 0 is the base model."""
    import numpy as np
    from safetensors.torch import load_file, save_file

    config = make_project(tmp_path, wan_model)
    lora = tmp_path / "lora.safetensors"
    tensors = load_file(str(wan_model / "single" / "wan2.1_t2v_tiny.safetensors"))
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for key, w in tensors.items():
        if key.startswith("blocks.") and ".self_attn.q.weight" in key:
            stem = "diffusion_model." + key.removesuffix(".weight")
            weights[f"{stem}.lora_A.weight"] = torch.randn(4, w.shape[1], generator=gen) * 0.3
            weights[f"{stem}.lora_B.weight"] = torch.randn(w.shape[0], 4, generator=gen) * 0.3
            weights[f"{stem}.alpha"] = torch.tensor(4.0)
    save_file(weights, str(lora))

    def draw(name: str, *loras: str) -> np.ndarray:
        args = [a for spec in loras for a in ("--lora", spec)]
        code, out = run(capsys, "generate", "--config", config, "--prompt", "a red circle", "--size", "64x48",
                        "--frames", "1", "--steps", "3", "--guidance", "1", "--device", "cpu",
                        "--out", tmp_path / name, *args)  # fmt: skip
        assert code == 0, out
        return np.asarray(Image.open(tmp_path / name), dtype=np.int16)

    base = draw("base.png")
    assert np.abs(draw("zero.png", f"{lora}:0") - base).max() == 0
    double = draw("double.png", f"{lora}:2")
    assert np.abs(double - base).max() > 0
    assert np.abs(draw("two.png", f"{lora}:1", f"{lora}:1") - double).max() <= 1


def test_generate_takes_the_memory_switches(tmp_path, wan_model, capsys):
    config = make_project(tmp_path, wan_model)
    out = tmp_path / "fp8.png"
    code, log = run(capsys, "generate", "--config", config, "--prompt", "x", "--size", "64x48", "--frames", "1",
                    "--steps", "2", "--guidance", "1", "--device", "cpu", "--set", "memory.fp8_base=true",
                    "--set", "memory.attention=sdpa_math", "--out", out)  # fmt: skip
    assert code == 0, log
    assert Image.open(out).size == (64, 48)


def test_collections_while_generating_skip_what_was_alive_before(tmp_path, wan_model, capsys, monkeypatch):
    """Dropping each model collects garbage; torch, diffusers and the caller's objects are frozen then (a
    collection would walk them all again, about 1 s in a test process), and given back at the end."""
    import gc

    import tuner.generate

    frozen, release = [], tuner.generate._release_memory
    monkeypatch.setattr(
        tuner.generate, "_release_memory", lambda: frozen.append(gc.get_freeze_count()) or release()
    )
    config = make_project(tmp_path, wan_model)
    code, log = run(capsys, "generate", "--config", config, "--prompt", "x", "--size", "64x48", "--frames", "1",
                    "--steps", "1", "--guidance", "1", "--device", "cpu", "--out", tmp_path / "x.png")  # fmt: skip
    assert code == 0, log
    assert frozen and min(frozen) > 10_000  # torch alone is far more objects than that
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--guidance", "inf", "--guidance inf: must be a finite number"),
     ("--shift", "nan", "--shift nan: must be a finite number"), ("--steps", "0", "--steps 0: must be at least 1")],
)  # fmt: skip
def test_non_finite_or_empty_sampling_numbers_are_refused(tmp_path, wan_model, capsys, flag, value, message):
    config = make_project(tmp_path / "p", wan_model)
    code, out = run(capsys, "generate", "--config", config, "--prompt", "x", "--size", "64x48", "--frames", "9",
                    flag, value, "--out", tmp_path / "x.mp4")  # fmt: skip
    assert code == 2 and message in out, out
    assert not (tmp_path / "x.mp4").exists()


def test_check_says_which_layout_adapters_are_saved_in(tmp_path, wan_model, capsys):
    config = make_project(tmp_path / "p", wan_model)
    code, out = run(capsys, "check", "--config", config)
    assert code == 0 and "adapters saved in the comfy layout" in out, out
