"""The memory entry point: settings validation, everything at once, text encoders, and the benchmark's
tiny CPU mode (so `benchmarks/gpu_memory.py` keeps running)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import UMT5Config, UMT5EncoderModel

from project import wan_inputs
from test_blockswap import add_lora, tiny_wan, train_step
from test_fp8 import write_comfy_fp8
from tuner import attention, fp8
from tuner.archs.wan.keys import diffusers_module_name
from tuner.errors import ConfigError, TunerError
from tuner.fixtures.weights import fill_random_
from tuner.memory import MemorySettings, apply_memory_settings, block_lists_of, quantize_text_encoder
from tuner.offload import FakeTransfer


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"blocks_to_swap": -1}, "blocks_to_swap"),
        ({"blocks_to_swap": "max"}, "blocks_to_swap"),
        ({"blocks_to_swap": True}, "blocks_to_swap"),
        ({"vram_budget_gb": -2.0}, "vram_budget_gb"),
        ({"swap_mode": "d2h"}, "swap_mode"),
        ({"fp8_matmul": True}, "needs memory.fp8_base"),
        ({"attention": "flashattn"}, "did you mean"),
    ],
)
def test_invalid_settings_are_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        MemorySettings(**fields)


def test_everything_at_once_matches_fp8_alone():
    reference = tiny_wan()
    apply_memory_settings(reference, MemorySettings(fp8_base=True, attention="sdpa_math"), "cpu")
    want_out, want = train_step(reference, add_lora(reference), wan_inputs())

    model, fake = tiny_wan(), FakeTransfer()
    settings = MemorySettings(blocks_to_swap=2, activation_offload=True, fp8_base=True, attention="sdpa_math")
    handle = apply_memory_settings(model, settings, "cpu", transfer=fake)
    handle.checkpointing.min_bytes = 0  # the tiny model's activations are below the default 1 MiB
    out, got = train_step(model, add_lora(model), wan_inputs())
    assert torch.equal(out, want_out)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert len(handle.fp8_layers) == 40 and handle.block_swap.blocks_to_swap == 2
    assert attention.current_backend(model) == "sdpa_math"
    assert any(kind == "offload" for kind, _ in fake.log)
    assert handle.summary() == (
        "fp8 base on 40 layers, 2 of 4 blocks swapped (h2d_only, ring of 2, largest 0 MiB), "
        "activations offloaded to host, attention sdpa_math"
    )


def test_comfyui_fp8_source_keeps_the_files_values(tmp_path):
    path = tmp_path / "wan_fp8_scaled.safetensors"
    written = write_comfy_fp8(tiny_wan(), path, "legacy")
    model = tiny_wan(seed=5)
    settings = MemorySettings(fp8_base=True)
    apply_memory_settings(model, settings, "cpu", fp8_source=str(path), name_map=diffusers_module_name)
    stem, (w8, _) = next(iter(written.items()))
    assert torch.equal(
        model.get_submodule(diffusers_module_name(stem)).weight.view(torch.uint8), w8.view(torch.uint8)
    )


def test_adapters_must_come_after():
    model = tiny_wan()
    add_lora(model)
    with pytest.raises(TunerError, match="before adapters are attached"):
        apply_memory_settings(model, MemorySettings(fp8_base=True), "cpu")


def test_swapping_needs_cuda_unless_a_transfer_is_given():
    with pytest.raises(TunerError, match="need a CUDA device"):
        apply_memory_settings(tiny_wan(), MemorySettings(blocks_to_swap=1), "cpu")


def test_block_lists_are_known_per_class():
    assert block_lists_of(tiny_wan()) == ("blocks",)
    with pytest.raises(TunerError, match="no architecture record names Linear"):
        block_lists_of(nn.Linear(2, 2))


@pytest.mark.parametrize(("mode", "bound"), [("fp8", 0.25), ("int8", 0.06), ("nf4", 0.7)])
def test_text_encoder_quantization(mode, bound):
    """Relative error of the last hidden state of a random 2-layer UMT5 (measured: fp8 0.15, int8 0.03,
    nf4 0.46; random tiny encoders amplify errors far more than trained ones)."""
    config = UMT5Config(
        vocab_size=256,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
    )
    with torch.random.fork_rng(devices=[]):
        reference = fill_random_(UMT5EncoderModel(config), 0).eval()
    model = copy.deepcopy(reference)
    assert quantize_text_encoder(model, mode) == 12  # 2 layers × (q k v o wi_0 wi_1), `wo` kept
    assert model.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(input_ids=ids).last_hidden_state
        got = model(input_ids=ids).last_hidden_state
    assert ((got - want).norm() / want.norm()).item() < bound
    if mode == "fp8":
        assert len(fp8.fp8_linear_names(model)) == 12
