"""Attention backends: every installed one agrees with sdpa, the override switch, and the errors.

Only the sdpa family runs on this CPU machine; the flash / sage / xformers paths are tested through their
error messages, and through a stand-in spec where a constraint (dtype, no backward) needs a usable kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers.models.attention_processor import Attention
from torch import nn

from project import wan_inputs
from test_blockswap import add_lora, tiny_wan
from tuner import attention
from tuner.errors import TunerError


def backends_of(model: nn.Module) -> set[str]:
    return {str(m.processor._attention_backend) for _, m in attention.attention_modules(model)}


def test_sdpa_is_the_default_and_runs_everywhere():
    assert attention.DEFAULT == "sdpa"
    assert attention.current_backend(tiny_wan()) == "sdpa"
    assert {"sdpa", "sdpa_math"} <= set(attention.available_backends("cpu"))


@pytest.mark.parametrize("name", attention.available_backends("cpu"))
def test_every_installed_backend_agrees_with_sdpa(name):
    model = tiny_wan()
    lora = add_lora(model)
    inputs = wan_inputs(batch=2)
    out = model(**inputs)[0]
    out.square().mean().backward()
    want = [p.grad.clone() for p in lora.parameters()]
    lora.zero_grad()
    with attention.override(model, name):
        assert attention.current_backend(model) == name
        got_out = model(**inputs)[0]
        got_out.square().mean().backward()
    torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-5)
    for p, w in zip(lora.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)


def test_a_backend_is_set_on_one_model_not_on_the_process():
    """diffusers' `set_attention_backend` also makes its backend the process's default, which every other
    model (a pipeline a user builds beside a tuner model) then uses: tuner sets the one model only."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    default = _AttentionBackendRegistry._active_backend
    attention.set_backend(tiny_wan(), "sdpa_math")
    assert _AttentionBackendRegistry._active_backend is default
    assert backends_of(tiny_wan()) == {"None"}


def test_override_restores_the_previous_backend():
    model = tiny_wan()
    attention.set_backend(model, "sdpa_math")
    with attention.override(model, "sdpa"):
        assert backends_of(model) == {"AttentionBackendName.NATIVE"}
    assert attention.current_backend(model) == "sdpa_math"
    assert backends_of(model) == {"AttentionBackendName._NATIVE_MATH"}
    with pytest.raises(RuntimeError, match="boom"), attention.override(model, "sdpa"):
        raise RuntimeError("boom")
    assert attention.current_backend(model) == "sdpa_math"


def test_unknown_backend_names_the_closest():
    with pytest.raises(TunerError, match="did you mean 'flash'"):
        attention.set_backend(tiny_wan(), "flahs")


@pytest.mark.parametrize("name", [n for n, b in attention.BACKENDS.items() if not attention._installed(b)])
def test_missing_packages_say_how_to_install(name):
    with pytest.raises(TunerError, match="is not installed"):
        attention.set_backend(tiny_wan(), name, "cuda")


def test_cuda_only_backends_refuse_the_cpu(monkeypatch):
    monkeypatch.setattr(attention, "_installed", lambda backend: True)
    for name in ("flash", "flash3", "sage", "xformers", "sdpa_flash", "sdpa_cudnn"):
        with pytest.raises(TunerError, match="not on cpu"):
            attention.check_backend(name, "cpu")


@pytest.fixture
def stand_in(monkeypatch):
    """Make a backend spec usable on CPU by pointing it at torch's sdpa, keeping its other constraints."""

    def make(name: str, **changes) -> str:
        spec = dataclasses.replace(
            attention.BACKENDS[name], module=None, devices=("cpu",), diffusers="native", **changes
        )
        monkeypatch.setitem(attention.BACKENDS, name, spec)
        return name

    return make


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # fp32 norm weights in bf16
def test_half_precision_kernels_refuse_fp32_at_the_first_call(stand_in):
    model = tiny_wan()
    attention.set_backend(model, stand_in("flash"))
    with pytest.raises(TunerError, match="bf16/fp16 only.*float32"), torch.no_grad():
        model(**wan_inputs())
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        model(**wan_inputs())


def test_sage_has_no_backward(stand_in):
    model = tiny_wan()
    attention.set_backend(model, stand_in("sage", dtypes=None))
    with pytest.raises(TunerError, match="no backward pass"):
        model(**wan_inputs())
    with torch.no_grad():
        model(**wan_inputs())


def test_models_outside_diffusers_dispatch_only_take_sdpa():
    class Legacy(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention(query_dim=32, heads=2, dim_head=16)  # AttnProcessor2_0 calls torch directly

    model = Legacy()
    attention.set_backend(model, "sdpa")
    with pytest.raises(TunerError, match="do not go through diffusers' attention dispatch"):
        attention.set_backend(model, "sdpa_math")
