"""EMA of the trained weights while training (`train.ema_decay`, `tuner.trainers.ema`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from project import cfg, make_cached_project, train_wan
from tuner.errors import CheckpointError, ConfigError
from tuner.trainers.ema import WeightEMA


def test_the_average_follows_its_formula_with_warmup():
    w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    ema = WeightEMA([w, frozen], decay=0.5, warmup=True)
    assert len(ema.shadow) == 1  # frozen weights are not averaged
    expected = torch.tensor([1.0, -1.0], dtype=torch.float64)
    for n, value in enumerate([[3.0, 1.0], [5.0, 5.0], [0.0, 2.0]], 1):
        with torch.no_grad():
            w.copy_(torch.tensor(value))
        ema.update()
        d = min(0.5, (1 + n) / (10 + n))  # 0.18, 0.25, 0.31: warm-up keeps it under 0.5
        expected = d * expected + (1 - d) * torch.tensor(value, dtype=torch.float64)
        assert torch.allclose(ema.shadow[0].double(), expected, atol=1e-6), n
    assert ema.decay_at(1000) == 0.5 and WeightEMA([w], 0.5, warmup=False).decay_at(1) == 0.5


def test_applied_swaps_the_average_in_and_the_training_weights_back_exactly():
    w = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    ema = WeightEMA([w], decay=0.9, on_host=True)
    training = w.detach().clone()
    ema.shadow[0].fill_(0.125)
    with ema.applied():
        assert torch.equal(w.detach(), torch.full((5,), 0.125, dtype=torch.bfloat16))
    assert torch.equal(w.detach(), training)
    assert ema.shadow[0].device.type == "cpu" and ema.shadow[0].dtype == torch.float32


def test_sampling_with_an_ema_that_is_not_kept_is_refused(tmp_path):
    config = tmp_path / "train.toml"
    config.write_text(
        '[model]\narchitecture = "wan"\ntransformer = "t.safetensors"\n[data]\ndataset_config = "d.toml"\n'
        "[sample]\nuse_ema = true\n"
    )
    with pytest.raises(ConfigError, match="sample.use_ema.*train.ema_decay"):
        cfg(config)


@pytest.fixture(scope="module")
def project(tmp_path_factory, wan_model):
    return make_cached_project(tmp_path_factory.mktemp("ema"), wan_model)


EMA = ("train.ema_decay=0.8", "save.every_n_epochs=0")


def test_the_ema_is_saved_beside_each_adapter_and_kept_last_with_it(project, tmp_path):
    out = tmp_path / "out"
    train_wan(project, out, "train.max_steps=8", "save.every_n_steps=2", "save.keep_last=2", *EMA)
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names == [
        "demo_lora-ema.safetensors", "demo_lora-step000004-ema.safetensors", "demo_lora-step000004.safetensors",
        "demo_lora-step000006-ema.safetensors", "demo_lora-step000006.safetensors", "demo_lora.safetensors",
    ]  # fmt: skip
    final, ema = (
        load_file(str(out / "demo_lora.safetensors")),
        load_file(str(out / "demo_lora-ema.safetensors")),
    )
    assert final.keys() == ema.keys()
    assert any(not torch.equal(final[k], ema[k]) for k in final if "lora" in k)


def test_a_resumed_run_continues_the_ema_exactly(project, tmp_path):
    train_wan(project, tmp_path / "a", "train.max_steps=4", *EMA)
    train_wan(project, tmp_path / "b", "train.max_steps=2", *EMA)
    train_wan(project, tmp_path / "b", "train.max_steps=4", *EMA, resume="latest")
    for name in ("demo_lora.safetensors", "demo_lora-ema.safetensors"):
        a, b = load_file(str(tmp_path / "a" / name)), load_file(str(tmp_path / "b" / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_resuming_without_the_ema_it_was_saved_with_is_refused_by_name(project, tmp_path):
    train_wan(project, tmp_path / "a", "train.max_steps=2", *EMA)
    with pytest.raises(CheckpointError, match="train.ema_decay: saved 0.8, now None"):
        train_wan(project, tmp_path / "a", "train.max_steps=4", "save.every_n_epochs=0", resume="latest")
