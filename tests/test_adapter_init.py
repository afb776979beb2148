"""Adapters draw their initial values from their own generator, seeded from the run's seed and the
module's name (`tuner.networks.base.init_generator`): not from the global RNG."""

import pytest
import torch
from torch import nn

from tuner.networks.base import init_generator
from tuner.networks.loha import LoHaNetwork
from tuner.networks.lokr import LoKrNetwork
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec

NETWORKS = {
    "lora": (LoRANetwork, {}),
    "dora": (LoRANetwork, {"dora": True}),
    "loha": (LoHaNetwork, {}),
    "lokr": (LoKrNetwork, {"factor": 4}),
}


def model() -> nn.Module:
    torch.manual_seed(123)  # the base weights: the same in every build
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def initial(kind: str, seed: int, targets=("0", "2")) -> dict[str, torch.Tensor]:
    cls, options = NETWORKS[kind]
    network = cls.apply_to(model(), TargetSpec(targets), rank=4, alpha=4, seed=seed, **options)
    return {f"{a.name}.{n}": p.detach().clone() for a in network for n, p in a.named_parameters()}


@pytest.mark.parametrize("kind", list(NETWORKS))
def test_initial_values_depend_on_the_seed_and_not_on_the_global_rng(kind):
    first = initial(kind, seed=42)
    torch.manual_seed(7)
    torch.randn(1000)  # something built before the network draws from the global RNG
    again = initial(kind, seed=42)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    other = initial(kind, seed=43)
    assert any(not torch.equal(first[k], other[k]) for k in first)


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr"])
def test_a_modules_initial_values_do_not_depend_on_the_other_targets(kind):
    both, alone = initial(kind, seed=5), initial(kind, seed=5, targets=("2",))
    shared = [k for k in alone if k in both]
    assert shared and all(torch.equal(both[k], alone[k]) for k in shared)


def test_lora_down_is_kaiming_uniform_from_the_module_generator():
    network = LoRANetwork.apply_to(model(), TargetSpec(("0",)), rank=4, seed=9)
    (adapter,) = list(network)
    expected = torch.empty(4, 16)
    nn.init.kaiming_uniform_(expected, a=5**0.5, generator=init_generator(9, adapter.name))
    assert torch.equal(adapter.down.detach(), expected) and not adapter.up.any()
