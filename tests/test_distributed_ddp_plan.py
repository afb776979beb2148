"""The per-process memory plan `tuner train` prints (`tuner.distributed.accounting`): parameters and
gradients from the real tensors, optimizer state from a probe step, equal to what a real step holds."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tuner.distributed.accounting import memory_plan, optimizer_state_bytes, size
from tuner.networks.full import StochasticRounding
from tuner.optimizers.build import build_optimizer


def _model(dtype=torch.float32) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16)).to(dtype)
    model[0].requires_grad_(False)
    return model, model[1]


def _step(optimizer, params) -> None:
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()


@pytest.mark.parametrize("name", ["adamw", "lion", "adafactor", "sgd", "adamw8bit", "prodigy"])
def test_the_planned_optimizer_state_is_what_the_first_step_creates(name):
    model, trained = _model()
    params = list(trained.parameters())
    optimizer = build_optimizer(name, params, 1e-3)
    plan = memory_plan(model, trained, optimizer, torch.device("cpu"))
    assert plan.frozen == (64 * 32 + 32) * 4 and plan.trained == plan.gradients == (32 * 16 + 16) * 4
    _step(optimizer, params)
    real = optimizer_state_bytes(optimizer, params)  # counted from the state the step made
    assert plan.optimizer_state == real
    assert {"adamw": 2 * plan.trained, "lion": plan.trained, "sgd": 0}.get(name, real) == pytest.approx(
        real, rel=0.01
    )


def test_a_factored_optimizers_state_of_a_matrix_wider_than_the_probe_is_bounded():
    """Adafactor keeps a row and a column of a matrix: per element, less the wider it is; a 4096 × 64
    matrix is probed as 1024 × 64."""
    model = nn.Linear(64, 4096, bias=False)
    optimizer = build_optimizer("adafactor", list(model.parameters()), 1e-3)
    plan = memory_plan(model, model, optimizer, torch.device("cpu"))
    _step(optimizer, list(model.parameters()))
    real = optimizer_state_bytes(optimizer, list(model.parameters()))
    assert real < plan.optimizer_state < 4 * real


def test_stochastic_rounding_keeps_bf16_weights_state_in_fp32():
    model, trained = _model(torch.bfloat16)
    params = list(trained.parameters())
    optimizer = StochasticRounding(build_optimizer("adamw", params, 1e-3))
    plan = memory_plan(model, trained, optimizer, torch.device("cpu"))
    assert plan.optimizer_state == pytest.approx(2 * 2 * plan.trained, rel=0.01)  # two fp32 moments
    _step(optimizer, params)
    assert optimizer_state_bytes(optimizer, params) == pytest.approx(plan.optimizer_state, rel=0.01)


def test_an_optimizer_that_cannot_be_probed_is_said_to_be_unknown():
    class Picky(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("needs a device this machine lacks")

    model, trained = _model()
    plan = memory_plan(model, trained, Picky(trained.parameters(), lr=0.1), torch.device("cpu"))
    assert plan.optimizer_state is None and plan.total is None
    assert "optimizer state unknown before step 1" in plan.describe()


def test_sizes_read_in_binary_units():
    assert [size(n) for n in (512, 2048, 3 * 2**20, 5 * 2**30)] == [
        "512 B",
        "2.00 KiB",
        "3.00 MiB",
        "5.00 GiB",
    ]


@pytest.mark.slow
def test_the_expected_figures_in_the_docs_are_the_scripts(monkeypatch):
    """docs/distributed.md's table of Wan 14B / FLUX.2 dev figures is what benchmarks/distributed_memory.py
    computes from the shipped configs, and the parameter counts it quotes are theirs."""
    root = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import distributed_memory

    doc = (root / "docs" / "distributed.md").read_text()
    for row in distributed_memory.table(list(distributed_memory.MODELS)).splitlines():
        if row.startswith("<!--"):  # the counts, quoted in the text
            base, adapter = re.findall(r"[\d,]{9,}", row)
            assert f"P = {base}" in doc and f"A = {adapter}" in doc, row
        else:
            assert row in doc, row
