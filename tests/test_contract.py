"""The contract every architecture meets, run over all of them on their tiny fixtures (CPU).

To add an architecture: register its trainer and fixture, add its name to ARCHITECTURES, run
`pytest tests/test_contract.py -k <name>` once and pin the losses it prints in GOLDEN.
"""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from project import cfg, make_project, run
from tuner.cache.plan import open_training_data
from tuner.demo import data_kinds
from tuner.fixtures import write_fixture
from tuner.models.loading import read_tensor_shapes
from tuner.networks.factory import apply_adapter_file
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec
from tuner.trainers import trainer_class

ARCHITECTURES = ["wan", "flux", "flux_kontext", "qwen_image", "qwen_image_edit"]

# Losses of the first three steps (seed 42, fixture seed 0); a change means the loss, the noise or
# timestep draws, the data order or the model inputs changed. Update only on purpose.
GOLDEN = {
    "wan": [2.632645, 2.480175, 2.591850],
    "flux": [2.200921, 2.212996, 2.052138],
    "flux_kontext": [2.174530, 2.207012, 2.044304],
    "qwen_image": [2.206476, 2.134087, 2.251362],
    "qwen_image_edit": [2.214304, 2.194253, 2.251573],
}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def case(request, tmp_path_factory):
    """(architecture, config, fixture paths) with latents and text cached."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"contract_{arch}")
    paths = write_fixture(arch, root / "model")
    config = make_project(root / "project", root / "model", architecture=arch)
    from tuner.cli import main

    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    return arch, config, paths


def _setup(case):
    arch, config, _ = case
    trainer = trainer_class(arch)(cfg(config))
    model = trainer.load_transformer(torch.float32).eval()
    model.requires_grad_(False)
    batch = next(iter(open_training_data(trainer, trainer.cfg, log=lambda s: None).epoch(0)))
    cond = {**trainer.collate_text(batch["text"]), **batch["extra"]}
    x0 = batch["latents"]
    t = torch.full((x0.shape[0],), 0.5)
    noisy = 0.5 * x0 + 0.5 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    return trainer, model, noisy, t, cond


def _lora(trainer, model, seed=0) -> LoRANetwork:
    network = LoRANetwork.apply_to(model, TargetSpec(trainer.default_targets), rank=4, alpha=2,
                                   name_map=trainer.keys)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for adapter in network:  # a trained-looking adapter: up is zero at init
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    return network


def test_forward_shape(case):
    trainer, model, noisy, t, cond = _setup(case)
    with torch.no_grad():
        pred = trainer.predict(model, noisy, t, cond)
    assert pred.shape == noisy.shape and torch.isfinite(pred).all()


def test_adapter_injection_and_merge(case):
    trainer, model, noisy, t, cond = _setup(case)
    with torch.no_grad():
        base = trainer.predict(model, noisy, t, cond)
        network = _lora(trainer, model)
        assert len(network) > 0
        adapted = trainer.predict(model, noisy, t, cond)
        assert not torch.allclose(adapted, base)
        network.merge_into_base()
        merged = trainer.predict(model, noisy, t, cond)
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-4)


def test_save_load_round_trip(case, tmp_path):
    trainer, model, noisy, t, cond = _setup(case)
    network = _lora(trainer, model)
    path = tmp_path / "lora.safetensors"
    network.save(path, trainer.keys)
    with torch.no_grad():
        expected = trainer.predict(model, noisy, t, cond)
    network.remove()
    fresh = trainer.load_transformer(torch.float32).eval()
    apply_adapter_file(fresh, path, 1.0, name_map=trainer.keys)
    with torch.no_grad():
        got = trainer.predict(fresh, noisy, t, cond)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_exported_keys_match_original_layout(case, tmp_path):
    trainer, model, *_ = _setup(case)
    _, _, paths = case
    original = {k.removeprefix("model.diffusion_model."): v for k, v in
                read_tensor_shapes(paths["transformer_file"]).items()}  # fmt: skip
    path = tmp_path / "lora.safetensors"
    _lora(trainer, model).save(path, trainer.keys)
    with safe_open(str(path), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    stems = {k.removesuffix(".lora_A.weight") for k in shapes if k.endswith(".lora_A.weight")}
    assert stems
    for stem in stems:
        weight = stem.removeprefix("diffusion_model.") + ".weight"
        assert weight in original, f"{stem} names no weight of the original layout"
        out_f, in_f = original[weight]
        rank = shapes[f"{stem}.lora_A.weight"][0]
        assert shapes[f"{stem}.lora_A.weight"] == (rank, in_f), stem
        assert shapes[f"{stem}.lora_B.weight"] == (out_f, rank), stem


def test_golden_loss(case, tmp_path):
    arch, config, _ = case
    trainer = trainer_class(arch)(cfg(config, f"save.output_dir='{tmp_path}'", "log.tensorboard=false",
                                      "train.max_steps=3"))  # fmt: skip
    trainer.train(log=lambda s: None)
    assert trainer.history == pytest.approx(GOLDEN[arch], rel=1e-4), trainer.history


@pytest.mark.slow
def test_cli_cache_train_generate(case, tmp_path, capsys):
    arch, config, _ = case
    out = tmp_path / "out"
    code, log = run(capsys, "train", "--config", config, "--set", f"save.output_dir='{out}'",
                    "--set", "train.max_steps=2")  # fmt: skip
    assert code == 0, log
    lora = out / "demo_lora.safetensors"
    video, controls = data_kinds(arch)
    sample = tmp_path / ("sample.mp4" if video else "sample.png")
    extra = ["--control", str(config.parent / "data" / "controls" / "image_000.png")] * controls
    code, log = run(capsys, "generate", "--config", config, "--prompt", "a red circle", "--lora", f"{lora}:0.8",
                    "--size", "64x48", "--frames", "9" if video else "1", "--steps", "2", "--device", "cpu",
                    "--out", sample, *extra)  # fmt: skip
    assert code == 0, log
    assert Path(sample).is_file() and Path(sample).stat().st_size > 0
