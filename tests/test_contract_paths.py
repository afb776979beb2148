"""The contract's user paths, for every registered architecture: what a user runs from the command line.

cache → train → generate (two LoRAs); a killed and resumed run equals a straight one; `tuner lora info`,
`convert` to every layout and back, `merge` and `extract`; every adapter type trains and saves (and
loads back), or is refused by `tuner check` and before training with the same reason. The session
fixture `contract` (conftest.py) has the fixture written and its cache filled.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from project import base_transformer, cfg, contract_inputs, killed_at_first_save, run
from tuner.demo import control_path, data_kinds, demo_frames, demo_size, frame_image_args
from tuner.errors import ConfigError
from tuner.networks.factory import apply_adapter_file
from tuner.registry import SAVE_LAYOUTS
from tuner.trainers import trainer_class

QUIET = ("log.tensorboard=false",)


def _train(config: Path, out: Path, *overrides: str, resume: str | None = None):
    trainer = trainer_class(cfg(config).model.architecture)(
        cfg(config, f"save.output_dir='{out}'", *QUIET, *overrides)
    )
    trainer.train(resume=resume, log=lambda s: None)
    return trainer


def _output(trainer, model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return trainer.predict(model, *inputs)


def _fresh(trainer, transformer: Path | None = None):
    """The fixture's transformer (a copy of the one loaded once), or the one in `transformer`, loaded."""
    if transformer is None:
        return base_transformer(trainer)
    trainer = type(trainer)(cfg(trainer.cfg.path, f"model.transformer='{transformer}'"))
    return trainer.load_transformer(torch.float32).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def trained(contract, tmp_path_factory):
    """A LoRA trained for 3 steps with a scale that is a power of two (alpha/rank = 1/2), so layout
    round trips are bit-exact. Trained once per architecture (like `contract`); the tests only read it."""
    arch, config, paths = contract
    out = tmp_path_factory.mktemp(f"trained_{arch}")
    trainer = _train(config, out, "train.max_steps=3", "network.rank=4", "network.alpha=2")
    return trainer, out / "demo_lora.safetensors", paths


@pytest.mark.slow
def test_cli_cache_train_generate_with_two_loras(contract, tmp_path, capsys):
    arch, config, _ = contract
    out = tmp_path / "out"
    code, log = run(capsys, "train", "--config", config, "--set", f"save.output_dir='{out}'",
                    "--set", "train.max_steps=2")  # fmt: skip
    assert code == 0, log
    lora = out / "demo_lora.safetensors"
    video, controls = data_kinds(arch)
    sample = tmp_path / ("sample.mp4" if video else "sample.png")
    extra = ["--control", str(control_path(arch, config.parent / "data"))] * controls
    extra += frame_image_args(arch, config.parent / "data")
    code, log = run(capsys, "generate", "--config", config, "--prompt", "a red circle", "--lora", f"{lora}:0.5",
                    "--lora", f"{lora}:0.5", "--size", "{}x{}".format(*demo_size(arch)), "--frames", str(demo_frames(arch)) if video else "1", "--steps", "2",
                    "--device", "cpu", "--out", sample, *extra)  # fmt: skip
    assert code == 0, log
    assert log.count(f"lora {lora} × 0.5") == 2, log
    assert sample.is_file() and sample.stat().st_size > 0


def test_killed_and_resumed_run_equals_a_straight_one(contract, tmp_path, monkeypatch):
    """N steps, killed right after the save, then resumed for N more: the same adapter as 2N straight,
    bit for bit (with dropout and gradient accumulation on)."""
    _, config, _ = contract
    common = ("train.max_steps=4", "train.gradient_accumulation_steps=2", "network.dropout=0.1",
              "save.every_n_steps=2", "save.every_n_epochs=0")  # fmt: skip
    _train(config, tmp_path / "straight", *common)
    killed_at_first_save(monkeypatch, lambda: _train(config, tmp_path / "resumed", *common))
    resumed = _train(config, tmp_path / "resumed", *common, resume="latest")
    assert len(resumed.history) == 2  # steps 3 and 4 only
    straight = load_file(tmp_path / "straight" / "demo_lora.safetensors")
    again = load_file(tmp_path / "resumed" / "demo_lora.safetensors")
    assert straight.keys() == again.keys()
    for key in straight:
        assert torch.equal(straight[key], again[key]), key


def test_lora_info_and_convert_to_every_layout_and_back(trained, tmp_path, capsys):
    trainer, lora, _ = trained
    code, log = run(capsys, "lora", "info", lora)
    assert code == 0 and trainer.architecture in log, log
    original = load_file(lora)
    inputs = contract_inputs(trainer)
    model = _fresh(trainer)
    apply_adapter_file(model, lora, 1.0, name_map=trainer.layout)
    want = _output(trainer, model, inputs)
    saved_as = (
        trainer.cfg.save.format if trainer.cfg.save.format in SAVE_LAYOUTS else trainer.record.save_format
    )
    for layout in SAVE_LAYOUTS:
        there, back = tmp_path / f"{layout}.safetensors", tmp_path / f"{layout}-back.safetensors"
        code, log = run(capsys, "lora", "convert", lora, there, "--to", layout)
        assert code == 0, log
        code, log = run(capsys, "lora", "convert", there, back, "--to", saved_as)
        assert code == 0, log
        returned = load_file(back)
        assert returned.keys() == original.keys(), layout
        for key in original:
            assert torch.equal(returned[key], original[key]), (layout, key)
        model = _fresh(trainer)
        apply_adapter_file(model, there, 1.0, name_map=trainer.layout)
        torch.testing.assert_close(_output(trainer, model, inputs), want, rtol=1e-5, atol=1e-5)


def test_lora_merge_and_extract(trained, tmp_path, capsys):
    """merge writes the release's single file with the adapter folded in, in each layout the fixture
    writes it in (FramePack's release keeps diffusers' names, its HunyuanVideo-named copy the original
    ones); extract recovers an adapter from the difference that acts like it."""
    trainer, lora, paths = trained
    single = paths["transformer_file"]
    merged, extracted = tmp_path / "merged.safetensors", tmp_path / "extracted.safetensors"
    inputs = contract_inputs(trainer)
    model = _fresh(trainer)
    apply_adapter_file(model, lora, 1.0, name_map=trainer.layout)
    want = _output(trainer, model, inputs)

    for base in dict.fromkeys((paths.get("release_file", single), single)):
        code, log = run(capsys, "lora", "merge", "--model", base, "--lora", lora, "--out", merged)
        assert code == 0, log
        torch.testing.assert_close(
            _output(trainer, _fresh(trainer, merged), inputs), want, rtol=1e-4, atol=1e-4
        )

    code, log = run(capsys, "lora", "extract", "--base", single, "--tuned", merged, "--rank", "16",
                    "--out", extracted)  # fmt: skip
    assert code == 0, log
    model = _fresh(trainer)
    apply_adapter_file(model, extracted, 1.0, name_map=trainer.layout)
    torch.testing.assert_close(_output(trainer, model, inputs), want, rtol=1e-3, atol=1e-3)


NETWORKS = {
    "lora": (),
    "dora": ("network.dora=true",),
    "loha": ("network.type='loha'",),
    "lokr": ("network.type='lokr'", "network.factor=4"),
    "full": ("network.type='full'", "train.learning_rate=1e-4"),
}


@pytest.mark.parametrize("network", list(NETWORKS))
def test_every_adapter_type_trains_and_saves_or_is_refused_up_front(
    contract, network, tmp_path, capsys, request
):
    """Trains one step and saves a file that loads back, or is refused by `tuner check` and by training
    with the same reason, before any step."""
    _, config, _ = contract
    overrides = NETWORKS[network]
    sets = [arg for o in overrides for arg in ("--set", o)]
    code, log = run(capsys, "check", "--config", config, *sets)
    try:
        trainer = _train(config, tmp_path, "train.max_steps=1", "train.lr_warmup_steps=0", *overrides)
    except ConfigError as e:
        assert code == 2 and str(e) in log, (log, e)
        assert not any(tmp_path.iterdir()), "refused after writing something"
        return
    assert code == 0, log
    saved = tmp_path / "demo_lora.safetensors"
    assert saved.is_file() and (tmp_path / "state").is_dir()
    inputs = contract_inputs(trainer)
    if network == "full":
        model = _fresh(trainer, saved)  # the whole model, in the layout users load
        changed = not torch.equal(_output(trainer, model, inputs), _output(trainer, _fresh(trainer), inputs))
    else:
        model = _fresh(trainer)
        base = _output(trainer, model, inputs)
        adapter = apply_adapter_file(model, saved, 1.0, name_map=trainer.layout)
        assert len(adapter) > 0
        changed = not torch.equal(_output(trainer, model, inputs), base)
    assert changed, "one step of training left the model as it was"
