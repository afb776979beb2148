"""fp8 base weights: error bounds, the autograd function, which layers stay precise, files, training.

Error bounds stated here (random normal weights, 64-wide blocks):
- per element: |W - dequant(W8)| <= max(2^-4 |W|, 2^-10 s)  (3-bit mantissa; subnormal spacing 2^-9 s)
- a linear layer's output: relative error < 0.035 (bf16 weights: < 0.003)
- the 4-block tiny Wan transformer's output: relative error < 0.05 versus fp32
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from project import wan_inputs
from test_blockswap import add_lora, tiny_wan
from tuner import fp8
from tuner.archs.wan.keys import diffusers_module_name, transformer_to_original
from tuner.errors import CheckpointError, TunerError


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_elementwise_error_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g) * torch.logspace(-3, 0, 256)  # magnitudes over 3 decades
    w8, scale = fp8.quantize_weight(w)
    assert w8.dtype == torch.float8_e4m3fn and scale.shape == (96, 4)
    err = (fp8.dequantize_weight(w8, scale, torch.float32) - w).abs()
    bound = torch.maximum(w.abs() * 2**-4, scale.repeat_interleave(64, dim=1) * 2**-10)
    assert (err <= bound * (1 + 1e-6)).all()


def test_linear_output_error_versus_bf16():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(128, 256, generator=g) / 16, torch.randn(32, 256, generator=g)
    exact = x @ w.t()
    w8, scale = fp8.quantize_weight(w)
    assert relative_error(x @ fp8.dequantize_weight(w8, scale, torch.float32).t(), exact) < 0.035
    assert relative_error(x @ w.bfloat16().float().t(), exact) < 0.003


def test_blocks_keep_an_outlier_from_flattening_its_row():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) / 16
    w[:, 0] *= 30_000  # one huge input channel: with one scale per row the rest turns subnormal
    blockwise = fp8.dequantize_weight(*fp8.quantize_weight(w, 64), torch.float32)
    per_row = fp8.dequantize_weight(*fp8.quantize_weight(w, None), torch.float32)
    assert relative_error(blockwise[:, 64:], w[:, 64:]) < 0.03
    assert relative_error(per_row[:, 64:], w[:, 64:]) > 0.04


def test_per_channel_when_inputs_are_not_a_multiple_of_64():
    w8, scale = fp8.quantize_weight(torch.randn(32, 48))
    assert scale.shape == (32, 1)
    assert relative_error(fp8.dequantize_weight(w8, scale, torch.float32), w8.float() * scale) == 0


@pytest.mark.parametrize("autocast", [False, True])
def test_fp8_linear_matches_the_dequantized_linear(autocast):
    torch.manual_seed(0)
    layer = nn.Linear(128, 64).requires_grad_(False)
    fp8.store_linear_fp8(layer)
    x = torch.randn(2, 5, 128, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = layer(x)
        dtype = torch.bfloat16 if autocast else torch.float32
        weight = fp8.dequantize_weight(layer.weight, layer.fp8_scale, dtype)
        y_ref = F.linear(x_ref.to(dtype), weight, layer.bias.to(dtype))
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)
    y.float().square().sum().backward()
    y_ref.float().square().sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-2 if autocast else 1e-6, atol=1e-6)


def test_backward_keeps_the_fp8_weight_not_a_dequantized_copy():
    layer = nn.Linear(256, 256).requires_grad_(False)
    fp8.store_linear_fp8(layer)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(torch.randn(4, 256, requires_grad=True))
    assert {t.dtype for t in saved} == {torch.float8_e4m3fn, torch.float32}
    assert sum(t.numel() * t.element_size() for t in saved) == 256 * 256 + 256 * 4 * 4  # fp8 + scales


def test_fp8_matmul_runs_scaled_mm_with_row_scales():
    torch.manual_seed(0)
    dense = nn.Linear(128, 64).requires_grad_(False)
    layer = nn.Linear(128, 64).requires_grad_(False)
    layer.load_state_dict(dense.state_dict())
    fp8.store_linear_fp8(layer, fp8_matmul=True)
    assert layer.fp8_scale.shape == (64, 1) and fp8.fp8_forward(layer).use_scaled_mm
    x = torch.randn(6, 128, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert relative_error(y, dense(x)) < 0.06  # weights and activations both in fp8
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32

    # A per-tensor scale (ComfyUI files) is spread over the rows _scaled_mm wants.
    per_tensor = nn.Linear(128, 64).requires_grad_(False)
    w8, scale = fp8.quantize_weight(dense.weight.reshape(1, -1), None)
    fp8.store_linear_fp8(per_tensor, w8.view(64, 128), scale.reshape(()), fp8_matmul=True)
    assert per_tensor.fp8_scale.shape == (64, 1) and fp8.fp8_forward(per_tensor).use_scaled_mm
    per_tensor.bias.copy_(dense.bias)
    assert relative_error(per_tensor(x.detach()), dense(x.detach())) < 0.06


def test_model_quantization_keeps_norms_embeddings_and_modulation():
    model = tiny_wan()
    names = fp8.quantize_linears(model, prefixes=("blocks",))
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert names == [n for n in linears if n.startswith("blocks.")]
    assert len(names) == 4 * 10  # per block: attn1 q k v out, attn2 q k v out, ffn in and out
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name not in names:  # embedders, time projection, head
            assert module.weight.dtype == torch.float32
    assert all(
        p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n or "scale_shift" in n
    )
    assert fp8.keeps_high_precision("transformer_blocks.0.norm1.linear")  # FLUX AdaLayerNormZero
    assert fp8.keeps_high_precision("transformer_blocks.0.img_mod.1")  # Qwen-Image modulation
    assert not fp8.keeps_high_precision("language_model.layers.0.self_attn.q_proj")  # HiDream-O1: not `_mod`


def test_fp8_model_output_close_to_fp32():
    reference, model = tiny_wan(), tiny_wan()
    fp8.quantize_linears(model, prefixes=("blocks",))
    with torch.no_grad():
        assert relative_error(model(**wan_inputs())[0], reference(**wan_inputs())[0]) < 0.05


def test_refuses_to_quantize_under_an_adapter():
    model = tiny_wan()
    add_lora(model)
    with pytest.raises(TunerError, match="before attaching adapters"):
        fp8.quantize_linears(model, prefixes=("blocks",))


def test_fp8_checkpoint_round_trip(tmp_path):
    model = tiny_wan()
    fp8.quantize_linears(model, prefixes=("blocks",))
    fp8.save_fp8_checkpoint(model, tmp_path / "wan_fp8.safetensors")
    loaded = tiny_wan(seed=7)
    layers = fp8.load_fp8_checkpoint(loaded, tmp_path / "wan_fp8.safetensors")
    assert sorted(layers) == sorted(fp8.fp8_linear_names(model))
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with torch.no_grad():
        assert torch.equal(loaded(**wan_inputs())[0], model(**wan_inputs())[0])

    state = model.state_dict()
    state.pop("blocks.0.attn1.to_q.bias")
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "broken.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        fp8.load_fp8_checkpoint(tiny_wan(), tmp_path / "broken.safetensors")


def write_comfy_fp8(model: nn.Module, path, layout: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A Wan model's block linears per-tensor quantized in one of ComfyUI's two fp8 layouts, original Wan
    names with the `model.diffusion_model.` prefix; returns {original layer: (w8, scale)}."""
    return write_comfy_fp8_state(transformer_to_original(model.state_dict()), path, layout)


def write_comfy_fp8_state(
    original: dict[str, torch.Tensor], path, layout: str, quantized=lambda key: key.startswith("blocks.")
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A state dict in the original release's layout written as one of ComfyUI's two fp8 layouts (see
    `tuner.fp8`): the 2-D weights whose key `quantized` accepts are per-tensor quantized; keys get the
    `model.diffusion_model.` prefix. Returns {original layer: (w8, scale)}."""
    tensors, layers = {}, {}
    for key, value in original.items():
        stem = key.removesuffix(".weight")
        if key.endswith(".weight") and value.ndim == 2 and quantized(key):
            scale = value.abs().max().float() / 448
            w8 = (value / scale).to(torch.float8_e4m3fn)
            layers[stem] = (w8, scale)
            tensors[f"{stem}.weight"] = w8
            if layout == "legacy":
                tensors[f"{stem}.scale_weight"] = scale.reshape(1)
            else:
                tensors[f"{stem}.weight_scale"] = scale
                tensors[f"{stem}.comfy_quant"] = torch.tensor(
                    list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8
                )
        else:
            tensors[key] = value
    if layout == "legacy":
        tensors["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    metadata = {} if layout == "legacy" else {"_quantization_metadata": json.dumps({"layers": list(layers)})}
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in tensors.items()}, path, metadata)
    return layers


@pytest.mark.parametrize("layout", ["legacy", "comfy_quant"])
def test_comfyui_fp8_files_load_with_their_exact_values(tmp_path, layout):
    path = tmp_path / "wan_fp8_scaled.safetensors"
    written = write_comfy_fp8(tiny_wan(), path, layout)
    assert fp8.is_comfy_fp8_file(path)
    model = tiny_wan(seed=5)  # other weights: every fp8 layer must come from the file
    names = fp8.load_comfy_fp8_weights(model, path, diffusers_module_name)
    assert len(names) == len(written) == 40
    for stem, (w8, scale) in written.items():
        layer = model.get_submodule(diffusers_module_name(stem))
        assert torch.equal(layer.weight.view(torch.uint8), w8.view(torch.uint8))
        assert layer.fp8_scale.item() == scale.item()
    dequantized = tiny_wan()
    with torch.no_grad():
        for stem, (w8, scale) in written.items():
            dequantized.get_submodule(diffusers_module_name(stem)).weight.copy_(w8.float() * scale)
        for name, p in dequantized.named_parameters():
            if not name.startswith("blocks.") or not name.endswith(".weight") or p.ndim != 2:
                p.copy_(model.get_parameter(name))
        assert relative_error(model(**wan_inputs())[0], dequantized(**wan_inputs())[0]) < 1e-5


def test_comfyui_fp8_file_for_another_model_is_refused(tmp_path):
    path = tmp_path / "other.safetensors"
    write_comfy_fp8(tiny_wan(), path, "legacy")
    with pytest.raises(CheckpointError, match="no matching linear layer"):
        fp8.load_comfy_fp8_weights(tiny_wan(), path)  # original names, no name map


def test_lora_on_an_fp8_base_trains():
    model = tiny_wan()
    fp8.quantize_linears(model, prefixes=("blocks",))
    lora = add_lora(model)
    target = torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(9))
    optimizer = torch.optim.AdamW(lora.parameters(), lr=2e-2)
    losses = []
    for _ in range(12):
        loss = F.mse_loss(model(**wan_inputs())[0], target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.dtype == torch.float32 for p in lora.parameters())


def test_an_fp8_time_embedding_is_kept_out_of_fp8_storage(wan_model, tmp_path):
    """Some ComfyUI fp8 files store Wan's time embedding in fp8 too. diffusers' Wan casts the timestep to
    that layer's weight dtype, so it must not stay in fp8 storage: it is loaded dequantized, as the
    model's loader does without fp8_base, and the forward pass works."""
    from tuner.archs.wan.keys import WAN_LAYOUT
    from tuner.archs.wan.loaders import load_transformer
    from tuner.memory import MemorySettings, apply_memory_settings

    path = tmp_path / "wan_fp8_scaled.safetensors"
    from tuner.models.loading import load_tensors, normalize_state_dict

    single = next((wan_model / "single").glob("wan2.1_t2v_*.safetensors"))
    original = normalize_state_dict(load_tensors(single), torch.float32)
    written = write_comfy_fp8_state(original, path, "comfy_quant",
                                    quantized=lambda key: key.startswith(("blocks.", "time_embedding.")))  # fmt: skip
    assert any(stem.startswith("time_embedding.") for stem in written)
    dequantized = load_transformer(str(path), torch.float32)
    model = load_transformer(str(path), torch.float32).requires_grad_(False)
    names = apply_memory_settings(
        model, MemorySettings(fp8_base=True), "cpu", fp8_source=str(path), name_map=WAN_LAYOUT.inverse
    ).fp8_layers
    assert names and not any("time_embedder" in name for name in names)
    with torch.no_grad():
        assert relative_error(model(**wan_inputs())[0], dequantized(**wan_inputs())[0]) < 1e-5
