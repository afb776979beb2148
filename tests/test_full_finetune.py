"""Full fine-tuning: the model trains, saves in the original single-file layout, and bf16 weights can be
updated with stochastic rounding under any optimizer; plus the network factory's choices and checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from safetensors import safe_open
from torch import nn

from project import wan_inputs
from tuner.archs.wan import loaders as wan
from tuner.errors import ConfigError
from tuner.models.loading import read_tensor_shapes
from tuner.networks import (
    FullNetwork,
    LoHaNetwork,
    LoKrNetwork,
    LoRANetwork,
    StochasticRounding,
    build_network,
)
from tuner.networks.full import stochastic_round_
from tuner.optimizers.build import build_optimizer
from tuner.registry import ARCHITECTURES

WAN_TARGETS = ARCHITECTURES["wan"].default_targets


def network_config(**changes) -> SimpleNamespace:
    """A `[network]` section as the factory reads it (the proposed schema's defaults)."""
    defaults = {
        "type": "lora", "rank": 4, "alpha": 4.0, "dropout": 0.0, "rank_dropout": 0.0, "module_dropout": 0.0,
        "include": (), "exclude": (), "loraplus_lr_ratio": None, "network_weights": "", "dora": False,
        "factor": -1, "decompose_both": False, "full_matrix": False, "stochastic_rounding": False,
    }  # fmt: skip
    return SimpleNamespace(**{**defaults, **changes})


# --- the full network -----------------------------------------------------------------------------


def test_full_fine_tune_saves_the_original_single_file(wan_model, tmp_path):
    model = WanTransformer3DModel.from_pretrained(wan_model / "diffusers" / "transformer").requires_grad_(
        False
    )
    network = build_network(model, WAN_TARGETS, network_config(type="full"), wan.original_module_name)
    assert isinstance(network, FullNetwork) and len(network) == len(list(model.parameters()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(network.param_groups(1e-3), weight_decay=0.0)
    for _ in range(2):
        loss = model(**wan_inputs())[0].pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert not torch.equal(
        model.state_dict()["blocks.0.attn1.to_q.weight"], before["blocks.0.attn1.to_q.weight"]
    )
    model.requires_grad_(False)  # frozen, as the reloaded model is: matmul kernels may differ otherwise
    with torch.no_grad():
        expected = model(**wan_inputs())[0]

    path = tmp_path / "full.safetensors"
    network.save(path, wan.original_module_name, metadata={"tuner.steps": "2"})
    fixture_file = wan_model / "single" / "wan2.1_t2v_tiny.safetensors"
    assert read_tensor_shapes(path) == read_tensor_shapes(fixture_file)
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["tuner.network_type"] == "full"
    reloaded = wan.load_transformer(path, torch.float32)  # the same loader as for official files
    trained = model.state_dict()
    assert all(torch.equal(value, trained[key]) for key, value in reloaded.state_dict().items())
    with torch.no_grad():  # equal weights; the single-file path differs from the folder one by ~1 ulp
        torch.testing.assert_close(reloaded(**wan_inputs())[0], expected, atol=1e-5, rtol=1e-5)

    network.save(tmp_path / "diffusers.safetensors", format="diffusers", dtype=torch.bfloat16)
    assert set(read_tensor_shapes(tmp_path / "diffusers.safetensors")) == set(model.state_dict())

    fresh = WanTransformer3DModel.from_pretrained(wan_model / "diffusers" / "transformer")
    FullNetwork(fresh).load_weights(path, wan.diffusers_module_name)  # continue training from the file
    with torch.no_grad():
        assert torch.equal(fresh(**wan_inputs())[0], expected)


# --- stochastic rounding --------------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    gap = 2.0**-7  # bf16 spacing in [1, 2)
    exact = torch.tensor([1.0, 1.0 + gap / 4, 1.0 + gap / 2, -(1.0 + 3 * gap / 4)])
    draws = torch.stack([torch.empty(4, dtype=torch.bfloat16) for _ in range(4000)])
    generator = torch.Generator().manual_seed(0)
    for row in draws:
        stochastic_round_(row, exact, generator)
    values = draws.float()
    low, high = exact.abs().floor_divide(gap) * gap, exact.abs().floor_divide(gap) * gap + gap
    assert ((values.abs() == low) | (values.abs() == high)).all()  # always one of the two neighbours
    assert torch.equal(values[:, 0], torch.ones(4000))  # representable values stay put
    torch.testing.assert_close(values.mean(0), exact, atol=4e-4, rtol=0)  # ~4 sigma for 4000 draws


def test_small_updates_add_up_only_with_stochastic_rounding():
    """SGD steps of 1e-3 on weights of 1.0: below half a bf16 gap (0.004), so plain bf16 never moves."""
    results = {}
    for rounding in (False, True):
        weight = nn.Parameter(torch.ones(2000, dtype=torch.bfloat16))
        optimizer = torch.optim.SGD([weight], lr=1e-3)
        if rounding:
            optimizer = StochasticRounding(optimizer, seed=0)
        for _ in range(50):
            weight.grad = torch.ones_like(weight)
            optimizer.step()
        results[rounding] = weight.float().mean().item()
    assert results[False] == 1.0
    assert results[True] == pytest.approx(0.95, abs=2e-3)


@pytest.mark.parametrize("name", ["adamw", "adafactor", "adamw8bit"])
def test_stochastic_rounding_wraps_the_memory_saving_optimizers(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 64)).to(torch.bfloat16)
    model[1].float()  # mixed: fp32 parameters step as usual, in the same optimizer
    network = FullNetwork(model, stochastic_rounding=True, seed=3)
    optimizer = network.prepare_optimizer(build_optimizer(name, network.param_groups(1e-2), 1e-2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    for _ in range(3):
        loss = F.mse_loss(model(x).float(), torch.zeros(8, 64))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    for key, value in model.state_dict().items():
        assert value.dtype == before[key].dtype and torch.isfinite(value.float()).all()
        assert not torch.equal(value, before[key]), key

    state = optimizer.state_dict()
    assert state["stochastic_rounding_steps"] == 3
    again = FullNetwork(model, stochastic_rounding=True).prepare_optimizer(
        build_optimizer(name, network.param_groups(1e-2), 1e-2)
    )
    again.load_state_dict(state)
    assert again.steps == 3 and len(again.state) == len(optimizer.state)


# --- the factory ----------------------------------------------------------------------------------


def test_factory_builds_each_type():
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    targets = (r"\d+",)
    for changes, cls in (
        ({}, LoRANetwork),
        ({"type": "loha"}, LoHaNetwork),
        ({"type": "lokr", "factor": 4, "decompose_both": True}, LoKrNetwork),
        ({"dora": True}, LoRANetwork),
    ):
        network = build_network(mlp, targets, network_config(**changes), None)
        assert type(network) is cls and len(network) == 2
        for method in ("param_groups", "load_weights", "save", "to", "parameters", "prepare_optimizer"):
            assert callable(getattr(network, method))
        network.remove()
    assert type(build_network(mlp, targets, network_config(type="full"), None)) is FullNetwork


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"type": "full", "dora": True}, "adapters only"),
        ({"type": "full", "exclude": ("x",)}, "adapters only"),
        ({"stochastic_rounding": True}, "stochastic_rounding"),
        ({"factor": 4}, "apply to network.type = 'lokr'"),
        ({"type": "lokr", "decompose_both": True, "full_matrix": True}, "exclude each other"),
        ({"type": "lokr", "factor": 0}, "positive size"),
        ({"type": "oft"}, "must be one of"),
    ],
)
def test_factory_refuses_combinations_that_cannot_work(changes, message):
    with pytest.raises(ConfigError, match=message):
        build_network(nn.Linear(4, 4), (r".*",), network_config(**changes), None)


# --- through the CLI (needs the trainer wired to build_network) -----------------------------------


@pytest.mark.slow
def test_cli_full_fine_tune_with_stochastic_rounding(tmp_path, wan_model):
    from project import make_project
    from tuner.cli import main

    config = make_project(tmp_path, wan_model, steps=3)
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    sets = [
        "log.tensorboard=false", "network.type='full'", "network.stochastic_rounding=true", "model.dtype='bf16'",
        "train.optimizer='adafactor'", "train.learning_rate=1e-4", "save.precision='bf16'", "save.save_state=false",
    ]  # fmt: skip
    assert main(["train", "--config", str(config), *(a for s in sets for a in ("--set", s))]) == 0
    saved = tmp_path / "output" / "demo_lora.safetensors"
    fixture_file = wan_model / "single" / "wan2.1_t2v_tiny.safetensors"
    assert read_tensor_shapes(saved) == read_tensor_shapes(fixture_file)
    model = wan.load_transformer(saved, torch.bfloat16)
    original = wan.load_transformer(fixture_file, torch.bfloat16)
    assert not torch.equal(model.blocks[0].attn1.to_q.weight, original.blocks[0].attn1.to_q.weight)
