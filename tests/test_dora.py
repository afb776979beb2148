"""DoRA: W' = m (W + ΔW) / ‖W + ΔW‖ per column, as a LoRA (or LoHa / LoKr) option.

The reference below is written from the formula, independently of `tuner.networks.delta`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tuner.errors import CheckpointError, ConfigError
from tuner.networks import LoHaNetwork, LoRANetwork, TargetSpec, apply_adapter_file
from tuner.networks.dora import DoRAModule
from tuner.networks.options import check_save_format

SPEC = TargetSpec(defaults=(r"\d+",))


def mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48)).to(dtype).requires_grad_(False)


def inputs(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(4, 5, 32, generator=torch.Generator().manual_seed(1)).to(dtype)


def perturb(network, std: float = 0.1) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)


def dora_reference(weight: torch.Tensor, up, down, scale: float, magnitude: torch.Tensor) -> torch.Tensor:
    """m · V / ‖V‖ with V = W + s·up·down, one norm per column (input channel)."""
    v = weight + scale * up @ down
    column_norms = torch.sqrt((v * v).sum(dim=0, keepdim=True))
    return magnitude * v / column_norms


def test_starts_as_the_base_model_and_learns_a_magnitude_per_column():
    model = mlp()
    x = inputs()
    base = model(x)
    network = LoRANetwork.apply_to(model, SPEC, 4, 2.0, dora=True)
    adapter = network["0"]
    assert isinstance(adapter, DoRAModule) and adapter.magnitude.shape == (1, 32)
    torch.testing.assert_close(adapter.magnitude, model[0].weight.norm(dim=0, keepdim=True))
    torch.testing.assert_close(model(x), base, atol=1e-6, rtol=1e-6)
    model(x).pow(2).mean().backward()
    assert adapter.magnitude.grad is not None and adapter.inner.up.grad is not None


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_forward_and_merge_follow_the_formula(strength):
    model = mlp()
    x = inputs()
    weights = {i: model[i].weight.clone() for i in (0, 2)}
    network = LoRANetwork.apply_to(model, SPEC, 4, 2.0, dora=True)
    perturb(network)
    network.set_multiplier(strength)
    with torch.no_grad():
        y = model(x)
        merged = {}
        for i in (0, 2):
            a = network[str(i)]
            target = dora_reference(weights[i], a.inner.up, a.inner.down, a.inner.scale, a.magnitude)
            merged[i] = weights[i] + strength * (target - weights[i])  # a loader's strength
        h = F.gelu(F.linear(x, merged[0], model[0].bias))
        torch.testing.assert_close(y, F.linear(h, merged[2], model[2].bias), atol=1e-5, rtol=1e-5)
        network.merge_into_base()
        torch.testing.assert_close(model(x), y, atol=1e-5, rtol=1e-5)


def test_dora_around_loha():
    model = mlp()
    network = LoHaNetwork.apply_to(model, SPEC, 4, 2.0, dora=True)
    perturb(network, std=0.02)
    x = inputs()
    with torch.no_grad():
        y = model(x)
        network.merge_into_base()
        torch.testing.assert_close(model(x), y, atol=1e-5, rtol=1e-5)


def test_bf16_base():
    model = mlp(torch.bfloat16)
    network = LoRANetwork.apply_to(model, SPEC, 4, dora=True)
    perturb(network)
    y = model(inputs(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    y.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in network.parameters())


def test_file_keys_and_round_trip(tmp_path):
    model = mlp()
    x = inputs()
    network = LoRANetwork.apply_to(model, SPEC, 4, 2.0, dora=True)
    perturb(network)
    expected = model(x)
    network.save(tmp_path / "dora.safetensors", dtype=torch.bfloat16)
    state = load_file(tmp_path / "dora.safetensors")
    assert state["diffusion_model.0.dora_scale"].shape == (1, 32)
    assert state["diffusion_model.0.dora_scale"].dtype == torch.float32  # magnitudes keep fp32
    assert {k.split(".", 2)[2] for k in state} == {"lora_A.weight", "lora_B.weight", "alpha", "dora_scale"}
    network.save(tmp_path / "dora32.safetensors")
    network.remove()

    fresh_model = mlp()
    LoRANetwork.apply_to(fresh_model, SPEC, 4, dora=True).load_weights(tmp_path / "dora32.safetensors")
    torch.testing.assert_close(fresh_model(x), expected, atol=1e-6, rtol=1e-6)
    inference_model = mlp()
    apply_adapter_file(inference_model, tmp_path / "dora32.safetensors")
    torch.testing.assert_close(inference_model(x), expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(CheckpointError, match="network.dora = true"):
        LoRANetwork.apply_to(mlp(), SPEC, 4).load_weights(tmp_path / "dora32.safetensors")


def test_config_refuses_dora_with_the_diffusers_layout():
    check_save_format(dora=False, layout="diffusers")
    check_save_format(dora=True, layout="kohya")
    with pytest.raises(ConfigError, match="save.format"):
        check_save_format(dora=True, layout="diffusers")


def test_continuing_a_plain_lora_as_dora_keeps_its_output(tmp_path):
    model = mlp()
    x = inputs()
    lora = LoRANetwork.apply_to(model, SPEC, 4, 2.0)
    perturb(lora)
    expected = model(x)
    lora.save(tmp_path / "lora.safetensors")
    lora.remove()
    LoRANetwork.apply_to(model, SPEC, 4, dora=True).load_weights(tmp_path / "lora.safetensors")
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)  # m = ‖W + ΔW‖


# --- through the CLI (needs the trainer wired to build_network) -----------------------------------


@pytest.mark.slow
def test_cli_trains_dora_saves_and_reloads(tmp_path, wan_model):
    from diffusers import WanTransformer3DModel

    from project import make_project
    from tuner.archs.wan.loaders import original_module_name
    from tuner.cli import main

    config = make_project(tmp_path, wan_model, steps=3)
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    sets = ["--set", "log.tensorboard=false", "--set", "network.dora=true"]
    assert main(["train", "--config", str(config), *sets]) == 0
    adapter = tmp_path / "output" / "demo_lora.safetensors"
    assert any(k.endswith(".dora_scale") for k in load_file(adapter))
    model = WanTransformer3DModel.from_pretrained(wan_model / "diffusers" / "transformer").eval()
    network = apply_adapter_file(model, adapter, name_map=original_module_name)
    assert all(isinstance(a, DoRAModule) for a in network) and len(network) == 20
    # continuing from the weights is a new run: it trains into its own output_dir
    more = [
        *sets,
        "--set",
        f"network.network_weights='{adapter}'",
        "--set",
        f"save.output_dir='{tmp_path / 'again'}'",
    ]
    assert main(["train", "--config", str(config), *more]) == 0


# --- FLUX.1: column-wise DoRA on the parts of fused layers ----------------------------------------
# FLUX's release keeps q/k/v in one `qkv` layer (and q/k/v/MLP-in in `linear1`). A per-column DoRA of
# to_q alone has no exact fused form, so those parts are written apart, under names ComfyUI maps onto
# the fused weight's rows; everything must read them back exactly.


@pytest.fixture(scope="module")
def flux_paths(tmp_path_factory):
    from tuner.fixtures import write_fixture

    return write_fixture("flux", tmp_path_factory.mktemp("flux_model"))


def flux_model(paths):
    from tuner.archs.flux import loaders as flux

    return flux.load_transformer(paths["diffusers"], torch.float32).eval().requires_grad_(False)


def flux_output(model) -> torch.Tensor:
    from tuner.archs.flux import loaders as flux

    g = torch.Generator().manual_seed(1)
    noisy, t5, pooled = (
        torch.randn(1, 16, 4, 4, generator=g),
        torch.randn(1, 7, 64, generator=g),
        torch.randn(1, 32, generator=g),
    )
    with torch.no_grad():
        return flux.predict_velocity(model, noisy, torch.tensor([0.5]), t5, pooled, 1.0)


def flux_dora(model) -> LoRANetwork:
    from tuner.registry import ARCHITECTURES

    record = ARCHITECTURES["flux"]
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), 4, 2.0, dora=True, name_map=record.key_table()
    )
    perturb(network, std=0.05)
    return network


@pytest.mark.parametrize("layout", ["auto", "comfy"])
def test_flux_dora_is_saved_apart_and_reads_back_exactly(layout, flux_paths, tmp_path):
    """A FLUX DoRA run used to train to the end and then fail to save (nothing written)."""
    from tuner.registry import ARCHITECTURES, resolve_save_format

    keys = ARCHITECTURES["flux"].key_table()
    model = flux_model(flux_paths)
    network = flux_dora(model)
    expected = flux_output(model)
    path = tmp_path / "dora.safetensors"
    network.save(path, format=resolve_save_format("flux", layout))

    state = load_file(path)
    part = (
        "lora_transformer_transformer_blocks_0_attn_to_q"
        if layout == "auto"  # kohya: FLUX's auto layout
        else "transformer.transformer_blocks.0.attn.to_q"
    )
    assert state[f"{part}.dora_scale"].shape == (1, 64) and state[f"{part}.alpha"].item() == 2.0
    assert not any("qkv" in k or "linear1" in k for k in state)  # no inexact fused adapter
    plain = (
        "lora_unet_double_blocks_0_img_attn_proj"
        if layout == "auto"
        else "diffusion_model.double_blocks.0.img_attn.proj"
    )
    assert f"{plain}.dora_scale" in state  # layers the release does not fuse keep their original names

    fresh = flux_model(flux_paths)
    loaded = apply_adapter_file(fresh, path, name_map=keys)
    assert len(loaded) == len(network) and all(isinstance(a, DoRAModule) for a in loaded)
    torch.testing.assert_close(flux_output(fresh), expected, atol=1e-5, rtol=1e-5)
    loaded.remove()
    flux_dora(fresh).load_weights(path)  # continue training from it
    torch.testing.assert_close(flux_output(fresh), expected, atol=1e-5, rtol=1e-5)


def test_flux_dora_file_tools(flux_paths, tmp_path, capsys):
    """`tuner lora info / convert / merge` read the parts written apart; convert round trips bit for bit."""
    from tuner.archs.flux import loaders as flux
    from tuner.cli import main
    from tuner.errors import TunerError
    from tuner.networks.keys import read_safetensors
    from tuner.tools.convert import convert_adapter

    model = flux_model(flux_paths)
    network = flux_dora(model)
    expected = flux_output(model)
    network.save(tmp_path / "kohya.safetensors", format="kohya", metadata={"tuner.architecture": "flux"})

    assert main(["lora", "info", str(tmp_path / "kohya.safetensors")]) == 0
    info = capsys.readouterr().out
    assert "format     kohya" in info and "type       LoRA + DoRA" in info
    assert main(["lora", "convert", str(tmp_path / "kohya.safetensors"), str(tmp_path / "comfy.safetensors"),
                 "--to", "comfy"]) == 0  # fmt: skip
    assert (
        convert_adapter(tmp_path / "comfy.safetensors", tmp_path / "back.safetensors", "auto")[1] == "kohya"
    )
    before, after = load_file(tmp_path / "kohya.safetensors"), load_file(tmp_path / "back.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(TunerError, match="column-wise DoRA"):
        convert_adapter(tmp_path / "kohya.safetensors", tmp_path / "peft.safetensors", "diffusers")

    merged = tmp_path / "merged.safetensors"
    assert main(["lora", "merge", "--model", str(flux_paths["transformer_file"]),
                 "--lora", str(tmp_path / "comfy.safetensors"), "--out", str(merged)]) == 0  # fmt: skip
    merged_model = flux.load_transformer(merged, torch.float32).eval()
    torch.testing.assert_close(flux_output(merged_model), expected, atol=1e-5, rtol=1e-5)

    extracted = tmp_path / "extracted.safetensors"
    assert main(["lora", "extract", "--base", str(flux_paths["transformer_file"]), "--tuned", str(merged),
                 "--rank", "2", "--format", "auto", "--out", str(extracted)]) == 0  # fmt: skip
    assert read_safetensors(extracted)[1]["tuner.format"] == "kohya"  # FLUX's auto layout
