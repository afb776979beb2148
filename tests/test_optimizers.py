"""The named optimizers (`tuner.optimizers.build.NAMED`): each trains, each resumes exactly through the trainer, and
our own two (Automagic, AdamW8bitKahan) follow their update rules."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from project import cfg, make_cached_project, train_wan
from test_optim import tiny_model, train_steps
from tuner.errors import ConfigError
from tuner.optimizers.automagic import Automagic
from tuner.optimizers.build import NAMED, averaged_weights, build_optimizer
from tuner.optimizers.kahan import AdamW8bitKahan

# (lr, extra arguments) each is tried at: the package's recommendation where it has one
SETTINGS = {
    "adamw8bit": (1e-2, {"min_8bit_size": 0}),
    "paged_adamw8bit": (1e-2, {"min_8bit_size": 0}),
    "lion": (1e-3, {}),
    "lion8bit": (1e-3, {"min_8bit_size": 0}),
    "paged_lion8bit": (1e-3, {"min_8bit_size": 0}),
    "prodigy": (1.0, {}),
    "adamw_schedulefree": (1e-2, {}),
    "came": (1e-2, {}),
    "automagic": (1e-2, {"max_lr": 1e-1}),
    "adamw8bitkahan": (1e-2, {}),
    "genericoptim": (1e-2, {"subspace": "galore", "rank": 4, "update_every": 3, "orthogonalize": True}),
}


def test_every_named_optimizer_has_settings_here():
    assert set(SETTINGS) == set(NAMED)


@pytest.mark.parametrize("name", list(NAMED))
def test_named_optimizer_lowers_the_loss(name):
    lr, kwargs = SETTINGS[name]
    model = tiny_model()
    optimizer = build_optimizer(name, model.parameters(), lr, kwargs)
    if name == "adamw_schedulefree":
        optimizer.train()
    losses = train_steps(model, optimizer, steps=8)
    assert losses[-1] < losses[0], losses


def test_an_argument_the_optimizer_does_not_take_is_named():
    with pytest.raises(ConfigError, match="'automagic' does not take the argument 'lr_bumb'.*lr_bump"):
        build_optimizer("automagic", tiny_model().parameters(), 1e-4, {"lr_bumb": 1e-6})


def test_an_argument_a_package_optimizer_would_swallow_is_named():
    """pytorch_optimizer's CAME takes **kwargs and ignores what it does not know."""
    with pytest.raises(ConfigError, match="'came' does not take the argument 'betas2'"):
        build_optimizer("came", tiny_model().parameters(), 1e-4, {"betas2": (0.9, 0.99)})


def test_schedule_free_with_a_schedule_is_refused(tmp_path):
    config = tmp_path / "train.toml"
    config.write_text(
        '[model]\narchitecture = "wan"\ntransformer = "t.safetensors"\n[data]\ndataset_config = "d.toml"\n'
        '[train]\noptimizer = "adamw_schedulefree"\nlr_scheduler = "cosine"\n'
    )
    with pytest.raises(ConfigError, match="schedules its own learning rate.*warmup_steps"):
        cfg(config)


def test_averaged_weights_are_the_eval_point_and_training_resumes_exactly():
    model = tiny_model()
    optimizer = build_optimizer("adamw_schedulefree", model.parameters(), 1e-2, {})
    optimizer.train()
    train_steps(model, optimizer, steps=4)
    training = [p.detach().clone() for p in model.parameters()]
    with averaged_weights(optimizer):
        averaged = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), training))
    assert not all(torch.equal(a, t) for a, t in zip(averaged, training))
    optimizer.eval()  # the package's own view of the average
    assert all(torch.allclose(p, a) for p, a in zip(model.parameters(), averaged))


# -- Automagic ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bias_correction", [True, False])
def test_automagic_rates_grow_while_the_sign_holds_and_shrink_when_it_flips(bias_correction):
    """Against a direct fp64 computation of the rule for a vector (full second moment); the optimizer
    computes in fp32. bias_correction = False is ai-toolkit's second moment (the raw average)."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    opt = Automagic([p], lr=1e-3, min_lr=9.99e-4, max_lr=1.0005e-3, lr_bump=1e-6, beta2=0.9, eps=0.0,
                    bias_correction=bias_correction)  # fmt: skip
    grads = [[1.0, 1.0, 1.0], [2.0, -1.0, 1.0], [1.0, -1.0, 1.0]]
    w, v = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    rate, last = torch.full((3,), 1e-3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for step, g in enumerate(grads, 1):
        g = torch.tensor(g, dtype=torch.float64)
        v = 0.9 * v + 0.1 * g * g
        u = g / (v / (1 - 0.9**step if bias_correction else 1.0)).sqrt()
        u = u / max(1.0, u.pow(2).mean().sqrt().item())
        rate = (rate + 1e-6 * torch.sign(u) * last).clamp(9.99e-4, 1.0005e-3)
        last = torch.sign(u)
        w = w - rate * u
        p.grad = g.clone()
        opt.step()
        assert torch.allclose(p.detach(), w, rtol=1e-6, atol=0), step  # the optimizer runs in fp32
    assert torch.allclose(opt.state[p]["lr"].double(), rate, atol=1e-10)
    # element 0 kept its sign twice (+2 bumps, clamped at max_lr), element 1 flipped then held
    assert rate.tolist() == pytest.approx([1.0005e-3, 1e-3, 1.0005e-3], abs=1e-10)
    assert opt.mean_lr() == pytest.approx(rate.mean().item(), abs=1e-10)


def test_automagic_without_bias_correction_moves_the_first_steps_further():
    """ai-toolkit's raw second moment is (1 − β2^t) too small early on: its first updates are larger
    (here at the RMS clip) than the bias-corrected ones."""
    moved = {}
    for corrected in (True, False):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.zeros(8, 8))
        opt = Automagic([p], lr=1e-3, bias_correction=corrected, clip_threshold=10.0)
        for i in range(3):
            p.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(i))
            opt.step()
        moved[corrected] = p.detach().abs().sum().item()
    assert moved[False] > 2 * moved[True]


def test_automagic_factors_the_second_moment_of_matrices():
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = Automagic([p], lr=1e-4)
    p.grad = torch.randn(6, 4)
    opt.step()
    state = opt.state[p]
    assert state["row"].shape == (6,) and state["col"].shape == (4,) and "sq" not in state


# -- AdamW8bitKahan -----------------------------------------------------------------------------


def test_kahan_keeps_the_small_updates_that_plain_bf16_loses():
    """Weights near 0.1 (bf16 step 2^-11 ≈ 5e-4) trained for 1,000 steps at lr 1e-5, each element's
    gradient keeping its sign: fp32 AdamW moves them by ~1e-2 in total. Plain bf16 AdamW rounds every
    single update away; the Kahan run's stored weights stay within 5% of the reference's movement."""
    g = torch.Generator().manual_seed(0)
    start = 0.1 + 0.01 * torch.rand(4096, generator=g)
    direction = torch.randn(4096, generator=g).sign()
    grads = [direction * (1 + 0.1 * torch.rand(4096, generator=g)) for _ in range(1000)]

    def run(dtype, optimizer_cls):
        p = torch.nn.Parameter(start.to(dtype).clone())  # `.to` of the same dtype would share storage
        opt = optimizer_cls([p], lr=1e-5, weight_decay=0.0)
        for grad in grads:
            p.grad = grad.to(dtype)
            opt.step()
        return p.detach().float()

    reference = run(torch.float32, torch.optim.AdamW)
    moved = (reference - start.to(torch.bfloat16).float()).abs().mean()
    kahan_error = (run(torch.bfloat16, AdamW8bitKahan) - reference).abs().mean() / moved
    plain_error = (run(torch.bfloat16, torch.optim.AdamW) - reference).abs().mean() / moved
    assert moved > 5e-3, moved
    assert kahan_error < 0.05, kahan_error
    assert plain_error > 0.5, plain_error


def test_kahan_state_is_8_bit_and_fp32_weights_need_no_compensation():
    half, full = (
        torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.ones(1000)),
    )
    opt = AdamW8bitKahan([half, full], lr=1e-3)
    half.grad, full.grad = torch.ones_like(half), torch.ones_like(full)
    opt.step()
    assert opt.state[half]["m"].dtype == torch.uint8 and opt.state[half]["v"].dtype == torch.uint8
    assert opt.state[half]["m_absmax"].numel() == 4  # blocks of 256
    assert "compensation" in opt.state[half] and "compensation" not in opt.state[full]


# -- every optimizer resumes exactly through the trainer ----------------------------------------


@pytest.fixture(scope="module")
def project(tmp_path_factory, wan_model):
    return make_cached_project(tmp_path_factory.mktemp("optimizers"), wan_model)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "adafactor", *NAMED])
def test_n_then_n_more_steps_equal_2n_steps(project, tmp_path, name):
    lr, kwargs = SETTINGS.get(name, (1e-3, {}))
    args = ", ".join(f"{k} = {json.dumps(v)}" for k, v in kwargs.items())  # JSON scalars are TOML
    common = (f"train.optimizer='{name}'", f"train.learning_rate={lr}", f"train.optimizer_args={{ {args} }}",
              "train.lr_warmup_steps=0", "save.every_n_epochs=0")  # fmt: skip
    straight = train_wan(project, tmp_path / "a", "train.max_steps=4", *common)
    train_wan(project, tmp_path / "b", "train.max_steps=2", *common)
    extended = train_wan(project, tmp_path / "b", "train.max_steps=4", *common, resume="latest")
    assert extended.history == straight.history[2:]
    a, b = (
        load_file(str(tmp_path / "a" / "demo_lora.safetensors")),
        load_file(str(tmp_path / "b" / "demo_lora.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
