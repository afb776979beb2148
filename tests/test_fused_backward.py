"""train.fused_backward: each parameter steps inside backward and its gradient is freed at once."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from project import cfg, make_cached_project, train_wan
from tuner.errors import ConfigError
from tuner.optimizers.build import build_optimizer
from tuner.optimizers.fused_backward import FusedBackward


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])


def _held_gradient_bytes(model: torch.nn.Module) -> list[int]:
    """Hooks that record, each time a gradient completes, the bytes of every gradient held then."""
    held: list[int] = []
    params = list(model.parameters())

    def record(_):
        held.append(sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None))

    for p in params:
        p.register_post_accumulate_grad_hook(record)
    return held


@pytest.mark.parametrize("name", ["adamw", "automagic", "adamw8bitkahan", "genericoptim"])
def test_fused_steps_give_the_unfused_weights_and_hold_one_gradient_at_a_time(name):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    plain, fused = _model(), _model()
    plain_opt = build_optimizer(name, plain.parameters(), 1e-3, {})
    fused_opt = build_optimizer(name, fused.parameters(), 1e-3, {})
    plain_held = _held_gradient_bytes(plain)
    fused_held = _held_gradient_bytes(fused)  # registered first: sees each gradient before it is stepped
    hooks = FusedBackward(fused_opt, fused.parameters())
    for _ in range(3):
        plain(x).pow(2).mean().backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        fused(x).pow(2).mean().backward()
        assert all(p.grad is None for p in fused.parameters())
    for a, b in zip(plain.parameters(), fused.parameters()):
        assert torch.equal(a, b)
    total = sum(p.numel() * 4 for p in plain.parameters())
    largest = max(p.numel() * 4 for p in plain.parameters())
    assert max(plain_held) == total  # every gradient at once before the step
    assert max(fused_held) == largest  # only the one about to step
    hooks.remove()
    assert fused_opt.state_dict()["state"].keys() == plain_opt.state_dict()["state"].keys()


@pytest.fixture(scope="module")
def project(tmp_path_factory, wan_model):
    return make_cached_project(tmp_path_factory.mktemp("fused"), wan_model)


def test_a_fused_full_fine_tune_equals_the_unfused_one_and_resumes(project, tmp_path):
    common = ("network.type='full'", "train.max_grad_norm=0", "train.optimizer='adamw8bitkahan'",
              "train.learning_rate=1e-4", "save.every_n_epochs=0")  # fmt: skip
    plain = train_wan(project, tmp_path / "a", "train.max_steps=4", *common)
    fused = train_wan(project, tmp_path / "b", "train.max_steps=4", "train.fused_backward=true", *common)
    assert fused.history == plain.history
    a, b = (
        load_file(str(tmp_path / "a" / "demo_lora.safetensors")),
        load_file(str(tmp_path / "b" / "demo_lora.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    train_wan(project, tmp_path / "c", "train.max_steps=2", "train.fused_backward=true", *common)
    train_wan(
        project, tmp_path / "c", "train.max_steps=4", "train.fused_backward=true", *common, resume="latest"
    )
    c = load_file(str(tmp_path / "c" / "demo_lora.safetensors"))
    assert all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ((), "train.max_grad_norm = 0"),
        (("train.max_grad_norm=0", "train.gradient_accumulation_steps=2"), "gradient_accumulation_steps = 1"),
        (("train.max_grad_norm=0", "train.mixed_precision='fp16'"), "mixed_precision = 'bf16'"),
        (("train.max_grad_norm=0", "train.optimizer='prodigy'"), "another optimizer than prodigy"),
    ],
)
def test_what_needs_every_gradient_is_refused_by_name(project, overrides, named):
    with pytest.raises(ConfigError, match=f"train.fused_backward.*{named}"):
        cfg(project, "train.fused_backward=true", *overrides)


def test_copying_a_model_keeps_hooks_off_the_copy():
    model = _model()
    FusedBackward(build_optimizer("adamw", model.parameters(), 1e-3, {}), model.parameters())
    other = copy.deepcopy(model)
    other[0](torch.randn(2, 64)).sum().backward()
    assert other[0].weight.grad is not None  # the hooks belong to the original parameters only
