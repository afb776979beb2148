"""Optimizer and learning-rate schedule builders (tuner.optimizers.build)."""

import io
import math

import pytest
import torch

from tuner.errors import ConfigError
from tuner.optimizers.build import build_optimizer, build_scheduler, lr_factor


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 5) -> list[float]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# -- optimizers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, lr, kwargs",
    [
        ("adamw", 1e-2, {"weight_decay": 0.0}),
        ("AdamW8bit", 1e-2, {"min_8bit_size": 0}),  # 8-bit state even for tiny tensors
        ("adafactor", 1e-2, {}),
        ("SGD", 1e-2, {"momentum": 0.9}),
        ("radam", 1e-2, {}),
        ("torch.optim.Adam", 1e-2, {"betas": (0.8, 0.99)}),
    ],
)
def test_optimizer_builds_and_lowers_the_loss(name, lr, kwargs):
    model = tiny_model()
    optimizer = build_optimizer(name, model.parameters(), lr, kwargs)
    assert optimizer.param_groups[0]["lr"] == lr
    losses = train_steps(model, optimizer)
    assert losses[-1] < losses[0]


def test_adamw_uses_foreach_on_cpu_and_keeps_user_choice():
    params = list(tiny_model().parameters())
    opt = build_optimizer("adamw", params, 1e-3, {})
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    opt = build_optimizer("adamw", params, 1e-3, {"foreach": False})
    assert opt.defaults["foreach"] is False


def test_param_groups_keep_their_own_settings():
    model = tiny_model()
    groups = [
        {"params": model[0].parameters(), "lr": 1e-4},  # a generator: must not be exhausted early
        {"params": model[2].parameters()},
    ]
    opt = build_optimizer("adamw", groups, 1e-3, {})
    assert [g["lr"] for g in opt.param_groups] == [1e-4, 1e-3]
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]


def test_adafactor_defaults_depend_on_lr():
    params = list(tiny_model().parameters())
    manual = build_optimizer("adafactor", params, 1e-3, {})
    assert manual.defaults["relative_step"] is False
    assert manual.defaults["scale_parameter"] is False and manual.defaults["warmup_init"] is False
    own_step = build_optimizer("adafactor", params, None, {})
    assert own_step.defaults["relative_step"] is True and own_step.defaults["lr"] is None


def test_unknown_optimizer_suggests_the_closest():
    with pytest.raises(ConfigError, match="Did you mean 'adamw8bit'") as e:
        build_optimizer("adamw8bt", tiny_model().parameters(), 1e-3, {})
    assert "RAdam" in str(e.value)  # lists the choices


def test_bad_dotted_path_is_a_config_error():
    with pytest.raises(ConfigError, match="no_such_pkg"):
        build_optimizer("no_such_pkg.Opt", tiny_model().parameters(), 1e-3, {})
    with pytest.raises(ConfigError, match="no class 'Nope'"):
        build_optimizer("torch.optim.Nope", tiny_model().parameters(), 1e-3, {})


def test_bad_kwarg_is_named():
    with pytest.raises(ConfigError, match="'betas2'.*Did you mean 'betas'"):
        build_optimizer("adamw", tiny_model().parameters(), 1e-3, {"betas2": (0.9, 0.99)})
    with pytest.raises(ConfigError, match="lr"):
        build_optimizer("sgd", tiny_model().parameters(), 1e-3, {"lr": 1.0})
    with pytest.raises(ConfigError, match="beta"):  # a value the optimizer itself rejects
        build_optimizer("adamw", tiny_model().parameters(), 1e-3, {"betas": (1.5, 0.9)})


# -- schedules ---------------------------------------------------------------------------------


def lrs(name: str, steps: int, **kwargs) -> list[float]:
    opt = torch.optim.SGD(tiny_model().parameters(), lr=1.0)
    sched = build_scheduler(name, opt, total_steps=steps, **kwargs)
    out = []
    for _ in range(steps + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name", ["constant", "linear", "cosine", "cosine_with_restarts"])
def test_warmup_ramps_linearly_to_the_base_lr(name):
    out = lrs(name, 20, warmup_steps=4)
    assert out[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_decays_reach_the_floor_at_the_end():
    assert lrs("constant", 10, warmup_steps=0) == pytest.approx([1.0] * 11)
    linear = lrs("linear", 10, warmup_steps=0, min_lr_ratio=0.1)
    assert linear == pytest.approx([1 - 0.09 * i for i in range(11)])
    cosine = lrs("cosine", 10, warmup_steps=2, min_lr_ratio=0.1)
    assert cosine[2] == pytest.approx(1.0) and cosine[-1] == pytest.approx(0.1)
    assert cosine[6] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lrs("cosine", 10, warmup_steps=0)[-1] == pytest.approx(0.0, abs=1e-12)


def test_cosine_with_restarts_jumps_back_each_cycle():
    out = lrs("cosine_with_restarts", 12, warmup_steps=0, num_cycles=3)
    assert out[0] == out[4] == out[8] == pytest.approx(1.0)  # cycles of 4 steps
    assert out[2] == pytest.approx(0.5) and out[3] < out[2]
    assert out[12] == pytest.approx(0.0, abs=1e-12)


def test_scheduler_resumes_identically_from_state_dict():
    def make():
        opt = torch.optim.SGD(tiny_model().parameters(), lr=0.1)
        return opt, build_scheduler("cosine", opt, warmup_steps=3, total_steps=20, min_lr_ratio=0.05)

    opt, sched = make()
    for _ in range(7):
        opt.step()
        sched.step()
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)  # must pickle

    expected = []
    for _ in range(10):
        opt.step()
        sched.step()
        expected.append(sched.get_last_lr()[0])

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    opt2, sched2 = make()
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    resumed = []
    for _ in range(10):
        opt2.step()
        sched2.step()
        resumed.append(sched2.get_last_lr()[0])
    assert resumed == expected


def test_lr_factor_is_monotone_after_warmup():
    values = [lr_factor(s, "cosine", 5, 50, min_lr_ratio=0.2) for s in range(5, 51)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(0.2) and not any(math.isnan(v) for v in values)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"name": "cosin"}, "Did you mean 'cosine'"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 30}, "warmup_steps"),
        ({"total_steps": 0}, "total_steps"),
        ({"num_cycles": 0}, "num_cycles"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
    ],
)
def test_bad_scheduler_settings_are_named(kwargs, param):
    opt = torch.optim.SGD(tiny_model().parameters(), lr=0.1)
    args = {"name": "cosine", "warmup_steps": 0, "total_steps": 20, **kwargs}
    with pytest.raises(ConfigError, match=param):
        build_scheduler(optimizer=opt, **args)
