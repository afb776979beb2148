"""`train.first_frame_conditioning_p`: image-to-video models trained on a share of samples with their first
frame and on the rest without it, from plain videos.

On each tiny fixture, through cache and train: p = 1 feeds what every run fed before the key existed (the
generation path, which takes no draw), p = 0 feeds the model's own "without" (checked against the input
built by hand: the T2V path, zero condition channels, no given frame; LTX-Video trained text-to-video
only before, so its unset p is 0), a mixed batch treats each sample
as if it were alone, p = 0 and p = 1 train to other losses, and a run at p = 0.5 resumes bit for bit. The
keys that are refused, and a dataset's loss mask multiplying TI2V-5B's first-frame mask.
"""

from __future__ import annotations

import re

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from project import NoAccelerator, cfg, killed_at_first_save, make_project
from tuner.archs.hunyuan_video15.trainer import HunyuanVideo15Model
from tuner.archs.wan.trainer import WanModel
from tuner.cache.plan import open_training_data
from tuner.cli import main as tuner
from tuner.errors import ConfigError
from tuner.fixtures import write_fixture
from tuner.registry import ARCHITECTURES
from tuner.trainers import trainer_class

ARCHS = ("wan22_i2v", "wan22_ti2v", "hunyuan_video15_i2v", "cosmos_predict2_v2w", "ltx_video")
QUIET = ("log.tensorboard=false",)


def _cached_project(root, arch: str, dataset_extra: str = ""):
    """The demo project of `arch` with two videos per batch (the draw is per sample), cached."""
    write_fixture(arch, root / "model")
    config = make_project(root / "project", root / "model", architecture=arch)
    path = config.parent / "dataset.toml"
    text = path.read_text().replace("batch_size = 1\n", "batch_size = 2\n")
    path.write_text(re.sub(r'(video_directory = "data/videos"\n)', rf"\1{dataset_extra}", text))
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    assert tuner(["cache", "text", "--config", str(config)]) == 0
    return config


@pytest.fixture(scope="module", params=ARCHS)
def project(request, tmp_path_factory):
    arch = request.param
    return arch, _cached_project(tmp_path_factory.mktemp(arch), arch)


def _trainer(config, *overrides):
    c = cfg(config, *QUIET, *overrides)
    return trainer_class(c.model.architecture)(c)


def _video_batch(trainer):
    """(x0, noisy, t, cond) of the first cached batch of two videos, noised halfway with fixed noise."""
    data = open_training_data(trainer, trainer.cfg, log=lambda s: None)
    batch = next(b for b in data.epoch(0) if b["latents"].shape[2] > 1 and b["latents"].shape[0] == 2)
    x0, cond = trainer._inputs(batch, torch.device("cpu"))
    noisy = 0.5 * x0 + 0.5 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    return x0, noisy, torch.full((2,), 0.5), cond


def _draw(trainer, x0, cond, seed: int) -> dict:
    return trainer.draw_conditions(x0, cond, torch.Generator().manual_seed(seed))


def _plain_wan(trainer, model, x, t, cond) -> torch.Tensor:
    """Plain Wan's call (the text-to-video model's inputs, not the subclass's)."""
    return model(**WanModel.model_inputs(trainer, x, t, cond), return_dict=False)[0]


def _without(arch: str, trainer, model, noisy, t, cond) -> torch.Tensor:
    """The model's prediction without the first frame, built by hand from what its pipeline feeds."""
    if arch == "wan22_ti2v":  # the text-to-video path: plain Wan, one timestep per sample
        return _plain_wan(trainer, model, noisy, t, cond)
    if arch == "ltx_video":  # the text-to-video call (LTXPipeline's, pinned in test_ltx_video_models.py)
        return trainer.predict(model, noisy, t, cond)
    if arch == "wan22_i2v":  # zero mask (4) and condition latents (16): ComfyUI's input without an image
        return _plain_wan(trainer, model, torch.cat([noisy, torch.zeros_like(noisy[:, :4]),
                                                     torch.zeros_like(noisy)], dim=1), t, cond)  # fmt: skip
    if (
        arch == "hunyuan_video15_i2v"
    ):  # the text-to-video trainer's call: zeros for the frame and image tokens
        text = {k: v for k, v in cond.items() if k not in ("image_latents", "image_embeds")}
        return HunyuanVideo15Model.predict(trainer, model, noisy, t, text)
    given = torch.zeros(noisy.shape[0], dtype=torch.long)  # cosmos: no frame given, zero condition mask
    return trainer.predict(model, noisy, t, {**cond, "given_frames": given})


def test_p1_is_the_released_input_p0_the_models_own_without_and_a_mix_is_per_sample(project):
    arch, config = project
    trainer = _trainer(config)
    model = trainer.load_transformer(torch.float32).eval()
    x0, noisy, t, cond = _video_batch(trainer)
    always, never = (
        _trainer(config, "train.first_frame_conditioning_p=1"),
        _trainer(config, "train.first_frame_conditioning_p=0"),
    )
    with torch.no_grad():
        given, without = _draw(always, x0, cond, 0), _draw(never, x0, cond, 0)
        if arch == "cosmos_predict2_v2w":  # today's draw of 1 or 2 given frames, unchanged at p = 1
            today = torch.randint(1, 3, (2,), generator=torch.Generator().manual_seed(0))
            assert torch.equal(given["given_frames"], today.clamp(max=x0.shape[2] - 1))
            assert not without["given_frames"].any() and not never.loss_mask(x0, without).eq(0).any()
        elif arch in ("wan22_ti2v", "ltx_video"):  # one model, both tasks
            assert given["clean_first"].all() and not without["clean_first"].any()
            assert never.loss_mask(x0, without) is None  # the frame is predicted, so it counts
        else:  # p = 1 is the generation path (no draw), which is what training fed before the key
            torch.testing.assert_close(
                trainer.predict(model, noisy, t, given), trainer.predict(model, noisy, t, cond)
            )
        with_frame = trainer.predict(model, noisy, t, given)
        plain = trainer.predict(model, noisy, t, without)
        torch.testing.assert_close(plain, _without(arch, trainer, model, noisy, t, cond))
        assert not torch.allclose(plain, with_frame, atol=1e-4)

        # a mixed batch: each sample gets what it would alone
        half = _trainer(config, "train.first_frame_conditioning_p=0.5")
        seed = next(s for s in range(100) if _mixed(_draw(half, x0, cond, s)))
        mixed = _draw(half, x0, cond, seed)
        both = half.predict(model, noisy, t, mixed)
        for i in range(2):
            alone = {k: v[i : i + 1] for k, v in mixed.items()}
            torch.testing.assert_close(both[i : i + 1], half.predict(model, noisy[i : i + 1], t[i : i + 1], alone),
                                       rtol=1e-4, atol=1e-5)  # fmt: skip
        assert torch.equal(_flags(mixed), _flags(_draw(half, x0, cond, seed)))  # seeded: the same again


def _flags(drawn: dict) -> torch.Tensor:
    """Which samples a draw gives their frame, whatever the architecture calls it."""
    for key in ("first_given", "clean_first"):
        if key in drawn:
            return drawn[key]
    return drawn["given_frames"] > 0


def _mixed(drawn: dict) -> bool:
    flags = _flags(drawn)
    return bool(flags.any() and not flags.all())


@pytest.mark.slow
def test_p0_and_p1_train_to_other_losses_and_p1_is_the_default(project, tmp_path):
    arch, config = project
    runs = {}
    for name, extra in (("p1", ("train.first_frame_conditioning_p=1",)), ("p0", ("train.first_frame_conditioning_p=0",)),
                        ("unset", ())):  # fmt: skip
        trainer = _trainer(config, f"save.output_dir='{tmp_path / name}'", "train.max_steps=2", *extra)
        trainer.train(log=lambda s: None)
        runs[name] = trainer.history
    assert runs["p0"] != pytest.approx(runs["p1"], rel=1e-4)
    default = ARCHITECTURES[arch].first_frame  # 1: the releases train with their frame; TI2V-5B 0.5, LTX 0
    if default in (0, 1):
        assert runs["unset"] == runs[f"p{default:.0f}"]


@pytest.mark.slow
def test_a_mixed_run_resumes_exactly(tmp_path, monkeypatch):
    config = _cached_project(tmp_path, "wan22_i2v")
    common = ("train.first_frame_conditioning_p=0.5", "train.max_steps=4", "save.every_n_steps=2",
              "save.every_n_epochs=0", "train.lr_warmup_steps=0")  # fmt: skip
    from tuner.archs.model import ArchitectureModel

    drawn, original = [], ArchitectureModel.first_frame_given

    def recorded(self, x0, generator):
        flags = original(self, x0, generator)
        drawn.append(flags.tolist())
        return flags

    monkeypatch.setattr(ArchitectureModel, "first_frame_given", recorded)
    _trainer(config, f"save.output_dir='{tmp_path / 'straight'}'", *common).train(log=lambda s: None)
    assert {flag for step in drawn for flag in step} == {True, False}  # the run mixes both
    killed_at_first_save(monkeypatch, lambda: _trainer(config, f"save.output_dir='{tmp_path / 'resumed'}'", *common).train(log=lambda s: None))  # fmt: skip
    _trainer(config, f"save.output_dir='{tmp_path / 'resumed'}'", *common).train(
        resume="latest", log=lambda s: None
    )
    straight = load_file(tmp_path / "straight" / "demo_lora.safetensors")
    resumed = load_file(tmp_path / "resumed" / "demo_lora.safetensors")
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


# --- what is refused ----------------------------------------------------------------------------------


def test_the_key_is_refused_where_there_is_no_frame_or_no_without(tmp_path, wan_model):
    plain = make_project(tmp_path / "wan", wan_model)
    with pytest.raises(
        ConfigError, match=r"wan is not given a first frame.*\(.*wan22_i2v.*hunyuan_video15_i2v"
    ):
        cfg(plain, "train.first_frame_conditioning_p=0.5")
    for arch in ("wan_i2v", "framepack"):
        config = make_project(tmp_path / arch, tmp_path / "no-model", architecture=arch)
        cfg(config, "train.first_frame_conditioning_p=1")  # always given: what the release trains
        with pytest.raises(ConfigError, match=f"{arch} cannot train without its first frame .*; set 1"):
            cfg(config, "train.first_frame_conditioning_p=0.9")


# --- a dataset's loss mask and TI2V-5B's first-frame mask ---------------------------------------------


def test_a_loss_mask_multiplies_the_first_frame_mask(tmp_path):
    masks = tmp_path / "project" / "data" / "masks"
    masks.mkdir(parents=True)
    for i in range(2):  # the left half counts, the right half at weight 0.25
        mask = Image.new("L", (64, 48), 64)
        mask.paste(255, (0, 0, 32, 48))
        mask.save(masks / f"video_{i:03d}.png")
    config = _cached_project(tmp_path, "wan22_ti2v", 'mask_directory = "data/masks"\n')
    trainer = _trainer(config, "train.first_frame_conditioning_p=1")
    model = trainer.load_transformer(torch.float32).eval()
    x0, _, t, cond = _video_batch(trainer)
    weights = cond["loss_mask"]
    assert weights.min() < 0.5 < weights.max()  # the cached mask is there, and not all ones
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    drawn = _draw(trainer, x0, cond, 0)
    objective = trainer.training_objective()
    with torch.no_grad():
        loss = trainer.loss(model, x0, noise, t, drawn, NoAccelerator())
        plain = {k: v for k, v in drawn.items() if k != "loss_mask"}
        pred = trainer.predict(model, objective.add_noise(x0, noise, t), t, plain).float()
        first = trainer.loss_mask(x0, plain)
        assert first is not None and not first[:, :, 0].any()
        expected = objective.loss(pred, x0, noise, t, mask=first * weights)
        one_only = [objective.loss(pred, x0, noise, t, mask=m) for m in (first, weights)]
    torch.testing.assert_close(loss, expected)
    assert all(not torch.allclose(loss, other) for other in one_only)


# --- LTX-Video generates from a first frame -----------------------------------------------------------


def sample_from_first_frame(trainer, model, image, size: tuple[int, int], frames: int) -> torch.Tensor:
    """Generation's latents from first-frame image `image` (through check_options, encode_conditions and
    sample_latents, as `tuner generate --image`), checked to end exactly on the given frame's latent."""
    from tuner.generate import GenerateOptions, check_options, encode_conditions, sample_latents

    opts = GenerateOptions(prompt="a red square", out="", images=(str(image),), width=size[0], height=size[1],
                           frames=frames, steps=3, guidance_scale=3.0)  # fmt: skip
    check_options(trainer, opts)
    cond, uncond = encode_conditions(trainer, trainer.cfg, opts, torch.device("cpu"))
    with torch.no_grad():
        latents = sample_latents(trainer, model, opts, cond, uncond, torch.device("cpu"), torch.float32,
                                 progress=False)  # fmt: skip
    torch.testing.assert_close(latents[:, :, :1], cond["first_frame"], rtol=1e-5, atol=1e-5)
    return latents


def test_ltx_video_generation_ends_on_the_given_first_frame(tmp_path):
    write_fixture("ltx_video", tmp_path / "model")
    config = make_project(tmp_path / "project", tmp_path / "model", architecture="ltx_video")
    trainer = _trainer(config)
    model = trainer.load_transformer(torch.float32).eval()
    image = tmp_path / "first.png"
    Image.new("RGB", (64, 64), (200, 40, 40)).save(image)
    assert sample_from_first_frame(trainer, model, image, (64, 64), 9).shape == (1, 128, 2, 2, 2)
    out = tmp_path / "x.mp4"
    assert tuner(["generate", "--config", str(config), "--prompt", "x", "--image", str(image), "--size", "64x64",
                  "--frames", "9", "--steps", "2", "--device", "cpu", "--out", str(out)]) == 0  # fmt: skip
    assert out.is_file()
