"""Shared helpers for end-to-end tests: a tiny Wan project (fixture, dataset, TOMLs) in a folder."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from tuner.cli import main as tuner
from tuner.config import load_config
from tuner.demo import prepare


def make_project(
    root: Path, model: Path, steps: int = 4, architecture: str = "wan", **train_overrides
) -> Path:
    """Write the demo project under `root` using the fixture at `model`; return the config path."""
    config = prepare(root, steps=steps, model=model, architecture=architecture)
    text = config.read_text()
    for key, value in train_overrides.items():
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    config.write_text(text)
    return config


def make_cached_project(root: Path, model: Path, **kwargs) -> Path:
    """`make_project`, then its latents and text cached through the CLI."""
    config = make_project(root, model, **kwargs)
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    assert tuner(["cache", "text", "--config", str(config)]) == 0
    return config


def run(capsys, *argv: str) -> tuple[int, str]:
    """Run the tuner CLI; return (exit code, stdout + stderr)."""
    capsys.readouterr()
    code = tuner([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def summary(output: str) -> tuple[int, int, int]:
    m = re.search(r"encoded (\d+), reused (\d+), pruned (\d+)", output)
    assert m, output
    return tuple(int(g) for g in m.groups())


def cfg(config: Path, *overrides: str):
    return load_config(config, list(overrides))


def train_wan(config: Path, out: Path, *overrides: str, resume: str | None = None):
    """Train the Wan project `config` into `out` with `overrides`, quietly; return the trainer."""
    from tuner.trainers import trainer_class

    WanTrainer = trainer_class("wan")

    trainer = WanTrainer(cfg(config, f"save.output_dir='{out}'", "log.tensorboard=false", *overrides))
    trainer.train(resume=resume, log=lambda s: None)
    return trainer


def wan_inputs(seed: int = 1, batch: int = 1, dtype=None) -> dict:
    """Fixed keyword inputs for a tiny-fixture-shaped WanTransformer3DModel (for output comparisons)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    return {
        "hidden_states": torch.randn(batch, 16, 2, 8, 8, generator=g).to(dtype),
        "timestep": torch.tensor([500.0] * batch),
        "encoder_hidden_states": torch.randn(batch, 8, 64, generator=g).to(dtype),
        "return_dict": False,
    }


def output(model):
    """The model's output on `wan_inputs()`, without gradients."""
    import torch

    with torch.no_grad():
        return model(**wan_inputs())[0]


_BASE_MODELS: dict[tuple[str, str], object] = {}


def base_transformer(trainer):
    """A copy of the transformer `trainer.load_transformer(torch.float32)` gives, in eval mode and frozen:
    loaded once per process and architecture's `[model]` section (all that loading reads), then deep-copied
    (the copy holds the same bits, in memory of its own, as block swap and fp8 copy it). For the
    contract suite's fixtures, which no test writes; a test of loading itself loads."""
    import copy

    import torch

    key = (trainer.architecture, repr(trainer.cfg.model))
    if key not in _BASE_MODELS:
        _BASE_MODELS[key] = trainer.load_transformer(torch.float32).eval().requires_grad_(False)
    return copy.deepcopy(_BASE_MODELS[key])


def contract_inputs(trainer, seed: int = 0):
    """(noisy latents, t, cond) for `trainer.predict`: the first cached training batch of the project
    the trainer's config describes, noised halfway with fixed noise."""
    import torch

    from tuner.cache.plan import open_training_data

    batch = next(iter(open_training_data(trainer, trainer.cfg, log=lambda s: None).epoch(0)))
    cond = {**trainer.collate_text(batch["text"]), **batch["extra"]}
    x0 = batch["latents"]
    noisy = 0.5 * x0 + 0.5 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    return noisy, torch.full((x0.shape[0],), 0.5), cond


def killed_at_first_save(monkeypatch, train) -> None:
    """Run `train()` and kill it (an exception) right after its first checkpoint is written."""
    import pytest

    from tuner.trainers.checkpoints import Checkpoints

    class Killed(Exception):
        pass

    save = Checkpoints.save

    def save_then_die(self, *args, **kwargs):
        save(self, *args, **kwargs)
        raise Killed

    monkeypatch.setattr(Checkpoints, "save", save_then_die)
    with pytest.raises(Killed):
        train()
    monkeypatch.setattr(Checkpoints, "save", save)


class DiffusersWarnings(logging.Handler):
    """What diffusers' loggers say while loading (they do not propagate): add to `logging.getLogger("diffusers")`."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_comfy_stems_and_diffusers_load(pipe, network, predict, release: set, layout, tmp_path: Path):
    """`network`'s comfy file names `diffusion_model.` + modules of the `release` file's keys, and its
    diffusers file, loaded by `pipe.load_lora_weights`, gives `predict()` what the network itself gave."""
    import torch
    from safetensors.torch import load_file

    with torch.no_grad():
        want = predict()
    network.save(tmp_path / "comfy.safetensors", layout)
    network.save(tmp_path / "diffusers.safetensors", layout, format="diffusers")
    network.remove()
    stems = {
        k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0]
        for k in load_file(tmp_path / "comfy.safetensors")
    }
    assert stems and all(
        s.startswith("diffusion_model.") and f"{s.removeprefix('diffusion_model.')}.weight" in release
        for s in stems
    )
    pipe.load_lora_weights(str(tmp_path / "diffusers.safetensors"))
    try:
        with torch.no_grad():
            got = predict()
    finally:
        pipe.unload_lora_weights()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def random_lora(model, targets, name_map, rank: int = 4, alpha: float = 2, seed: int = 0, exclude=()):
    """A rank-`rank` LoRA on `model`'s `targets` (regexes) that looks trained: its up weights drawn from
    `seed` (they start at zero), so it changes the output."""
    import torch

    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec

    network = LoRANetwork.apply_to(
        model, TargetSpec(targets, exclude=exclude), rank=rank, alpha=alpha, name_map=name_map
    )
    gen = torch.Generator().manual_seed(seed)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    return network


def assert_equal_weights(a, b) -> None:
    """The two models hold the same tensors (dtype and values, bit for bit) under the same names."""
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


class NoAccelerator:
    """What `ArchitectureModel.loss` asks of an accelerator, for calling it outside a trainer: autocast
    that does nothing."""

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()


def check_reference_images_cli(capsys, tmp_path: Path, model: Path, architecture: str) -> None:
    """Two reference images per item of an edit model's demo project: cached as control latents
    (`control_0`, `control_1` in the model's inputs), trained on, and given to `generate --control` twice."""
    from tuner.fixtures.dataset import write_controls
    from tuner.registry import architecture as record

    project = make_project(tmp_path, model, steps=2, architecture=architecture)
    data = project.parent / "data"
    write_controls(data / "controls", sorted((data / "images").glob("*.png")), 2)
    dataset = project.parent / "dataset.toml"
    dataset.write_text(dataset.read_text() + 'control_directory = "data/controls"\n')
    for step in ("latents", "text"):
        assert run(capsys, "cache", step, "--config", project)[0] == 0
    _, _, cond = contract_inputs(record(architecture).family_class()(cfg(project)))
    assert sorted(k for k in cond if k.startswith("control_")) == ["control_0", "control_1"]
    code, out = run(capsys, "train", "--config", project)
    assert code == 0, out
    lora = project.parent / "output" / "demo_lora.safetensors"
    control = data / "controls" / "image_000_0.png"
    code, out = run(capsys, "generate", "--config", project, "--prompt", "a cat", "--lora", f"{lora}:1.0",
                    "--size", "64x48", "--steps", "2", "--device", "cpu", "--control", control,
                    "--control", control, "--out", tmp_path / "out.png")  # fmt: skip
    assert code == 0, out
    assert (tmp_path / "out.png").is_file()
