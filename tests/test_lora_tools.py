"""`tuner lora info|convert|merge|extract|ema` on the tiny Wan fixture.

The commands run through the parser `tuner.tools.add_lora_commands` registers (what `tuner lora ...`
runs once the CLI includes it). Reference outputs come from the adapters applied as forward patches
to the fixture's transformer, loaded from the same original-layout single file as the merged files.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from safetensors.torch import load_file, save_file

from project import output
from tuner.archs.wan import loaders as wan
from tuner.errors import CheckpointError
from tuner.networks import LoRANetwork, TargetSpec, apply_adapter_file
from tuner.networks.formats import read_modules
from tuner.registry import ARCHITECTURES
from tuner.tools import add_lora_commands

WAN_TARGETS = ARCHITECTURES["wan"].default_targets


def lora_cli(*argv) -> None:
    parser = argparse.ArgumentParser(prog="tuner")
    add_lora_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["lora", *map(str, argv)])
    args.func(args)


def single_file(wan_model):
    return wan_model / "single" / "wan2.1_t2v_tiny.safetensors"


def base_model(wan_model):
    return wan.load_transformer(single_file(wan_model), torch.float32).requires_grad_(False)


def write_lora(wan_model, path, seed: int, rank: int = 4, alpha: float = 2.0, **options) -> None:
    """A trained-looking Wan adapter file in the comfy layout."""
    model = base_model(wan_model)
    torch.manual_seed(seed)
    network = LoRANetwork.apply_to(
        model, TargetSpec(WAN_TARGETS), rank, alpha, name_map=wan.original_module_name, **options
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    network.save(path, metadata={"tuner.architecture": "wan", "tuner.steps": str(seed * 10)})


def with_adapters(wan_model, *adapters: tuple[object, float]) -> torch.Tensor:
    model = base_model(wan_model)
    for path, strength in adapters:
        apply_adapter_file(model, path, strength, name_map=wan.original_module_name)
    return output(model)


# --- info, convert --------------------------------------------------------------------------------


def test_info_and_convert(wan_model, tmp_path, capsys):
    write_lora(wan_model, tmp_path / "a.safetensors", seed=1)
    lora_cli("info", tmp_path / "a.safetensors")
    text = capsys.readouterr().out
    for expected in ("format     comfy", "type       LoRA", "modules    20", "rank       4", "alpha      2.0",
                     "diffusion_model.blocks.N.self_attn.q  ×2", "tuner.architecture: wan"):  # fmt: skip
        assert expected in text, text

    lora_cli(
        "convert", tmp_path / "a.safetensors", tmp_path / "k.safetensors", "--to", "kohya", "--dtype", "bf16"
    )
    lora_cli("convert", tmp_path / "k.safetensors", tmp_path / "d.safetensors", "--to", "diffusers")
    lora_cli("info", tmp_path / "d.safetensors")
    text = capsys.readouterr().out
    assert "format     diffusers" in text and "transformer.blocks.N.attn1.to_q  ×2" in text
    assert (
        load_file(tmp_path / "k.safetensors")["lora_unet_blocks_0_self_attn_q.lora_down.weight"].dtype
        == torch.bfloat16
    )


def test_info_on_another_tools_kohya_loha(tmp_path, capsys):
    state = {
        "lora_unet_blocks_0_self_attn_q.hada_w1_a": torch.zeros(64, 2),
        "lora_unet_blocks_0_self_attn_q.hada_w1_b": torch.zeros(2, 64),
        "lora_unet_blocks_0_self_attn_q.hada_w2_a": torch.zeros(64, 2),
        "lora_unet_blocks_0_self_attn_q.hada_w2_b": torch.zeros(2, 64),
        "lora_unet_blocks_0_self_attn_q.alpha": torch.tensor(1.0),
    }
    save_file(state, str(tmp_path / "loha.safetensors"))
    lora_cli("info", tmp_path / "loha.safetensors")
    text = capsys.readouterr().out
    assert "format     kohya" in text and "type       LoHa" in text and "rank       2" in text


def test_info_on_a_model_file(wan_model, capsys):
    lora_cli("info", single_file(wan_model))
    assert "type       model (not an adapter)" in capsys.readouterr().out


# --- merge ----------------------------------------------------------------------------------------


def test_merge_then_forward_equals_adapter_forward(wan_model, tmp_path, capsys):
    write_lora(wan_model, tmp_path / "a.safetensors", seed=1)
    write_lora(wan_model, tmp_path / "b_comfy.safetensors", seed=2, rank=8, alpha=3.0)
    lora_cli("convert", tmp_path / "b_comfy.safetensors", tmp_path / "b.safetensors", "--to", "diffusers")
    expected = with_adapters(wan_model, (tmp_path / "a.safetensors", 0.8), (tmp_path / "b.safetensors", 0.5))
    assert not torch.allclose(expected, output(base_model(wan_model)), atol=1e-3)

    lora_cli("merge", "--model", single_file(wan_model), "--lora", f"{tmp_path / 'a.safetensors'}:0.8",
             "--lora", f"{tmp_path / 'b.safetensors'}:0.5", "--out", tmp_path / "merged.safetensors")  # fmt: skip
    assert "merged" in capsys.readouterr().out
    assert set(load_file(tmp_path / "merged.safetensors")) == set(load_file(single_file(wan_model)))
    merged = wan.load_transformer(tmp_path / "merged.safetensors", torch.float32)
    torch.testing.assert_close(output(merged), expected, atol=1e-5, rtol=1e-5)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # atomic: no temporary left


def test_merge_dora(wan_model, tmp_path):
    write_lora(wan_model, tmp_path / "dora.safetensors", seed=3, dora=True)
    expected = with_adapters(wan_model, (tmp_path / "dora.safetensors", 0.7))
    lora_cli("merge", "--model", single_file(wan_model), "--lora", f"{tmp_path / 'dora.safetensors'}:0.7",
             "--out", tmp_path / "merged.safetensors")  # fmt: skip
    merged = wan.load_transformer(tmp_path / "merged.safetensors", torch.float32)
    torch.testing.assert_close(output(merged), expected, atol=1e-5, rtol=1e-5)


def test_merge_into_fp8_scaled(wan_model, tmp_path):
    write_lora(wan_model, tmp_path / "a.safetensors", seed=1)
    lora_cli("merge", "--model", single_file(wan_model), "--lora", tmp_path / "a.safetensors",
             "--out", tmp_path / "merged.safetensors")  # fmt: skip
    lora_cli("merge", "--model", single_file(wan_model), "--lora", tmp_path / "a.safetensors", "--fp8",
             "--out", tmp_path / "fp8.safetensors")  # fmt: skip
    state = load_file(tmp_path / "fp8.safetensors")
    assert state["blocks.0.self_attn.q.weight"].dtype == torch.float8_e4m3fn
    assert state["blocks.0.self_attn.q.scale_weight"].shape == () and "scaled_fp8" in state
    assert (
        state["blocks.0.self_attn.q.bias"].dtype == torch.float32
        and state["head.modulation"].dtype == torch.float32
    )
    exact = output(wan.load_transformer(tmp_path / "merged.safetensors", torch.float32))
    approx = output(wan.load_transformer(tmp_path / "fp8.safetensors", torch.float32))  # ComfyUI's scaled fp8
    assert ((approx - exact).norm() / exact.norm()).item() < 0.1

    # merging into an fp8-scaled file dequantizes first
    lora_cli("merge", "--model", tmp_path / "fp8.safetensors", "--lora", f"{tmp_path / 'a.safetensors'}:0",
             "--dtype", "fp32", "--out", tmp_path / "again.safetensors")  # fmt: skip
    assert set(load_file(tmp_path / "again.safetensors")) == set(load_file(single_file(wan_model)))


def test_merge_refuses_an_adapter_of_another_model(wan_model, tmp_path):
    state = {f"diffusion_model.double_blocks.0.img_attn.qkv.lora_{m}.weight": torch.zeros(2, 2) for m in "AB"}
    save_file(state, str(tmp_path / "flux.safetensors"))
    with pytest.raises(CheckpointError):
        lora_cli("merge", "--model", single_file(wan_model), "--lora", tmp_path / "flux.safetensors",
                 "--out", tmp_path / "x.safetensors")  # fmt: skip


# --- extract --------------------------------------------------------------------------------------


def test_extract_recovers_a_merged_lora_at_full_rank(wan_model, tmp_path):
    write_lora(wan_model, tmp_path / "a.safetensors", seed=1, rank=4, alpha=3.0)
    lora_cli("merge", "--model", single_file(wan_model), "--lora", tmp_path / "a.safetensors",
             "--out", tmp_path / "merged.safetensors")  # fmt: skip
    lora_cli("extract", "--base", single_file(wan_model), "--tuned", tmp_path / "merged.safetensors",
             "--rank", 4, "--out", tmp_path / "extracted.safetensors")  # fmt: skip
    original, extracted = (
        read_modules(tmp_path / "a.safetensors")[0],
        read_modules(tmp_path / "extracted.safetensors")[0],
    )
    assert original.keys() == extracted.keys()
    for stem, weights in original.items():
        assert extracted[stem].rank == 4
        torch.testing.assert_close(extracted[stem].delta(), weights.delta(), atol=2e-6, rtol=1e-4)

    lora_cli("extract", "--base", single_file(wan_model), "--tuned", tmp_path / "merged.safetensors",
             "--rank", 2, "--format", "kohya", "--out", tmp_path / "low.safetensors")  # fmt: skip
    low = read_modules(tmp_path / "low.safetensors")[0]["lora_unet_blocks_0_self_attn_q"]
    assert low.rank == 2 and not torch.allclose(
        low.delta(), original["diffusion_model.blocks.0.self_attn.q"].delta(), atol=1e-4
    )


# --- ema ------------------------------------------------------------------------------------------


def test_ema_over_checkpoints_in_step_order(wan_model, tmp_path):
    for seed in (3, 1, 2):  # tuner.steps = 30, 10, 20
        write_lora(wan_model, tmp_path / f"s{seed}.safetensors", seed=seed)
    files = [tmp_path / f"s{seed}.safetensors" for seed in (3, 1, 2)]
    lora_cli("ema", *files, "--beta", 0.5, "--out", tmp_path / "ema.safetensors")
    s1, s2, s3 = (load_file(tmp_path / f"s{i}.safetensors") for i in (1, 2, 3))
    ema = load_file(tmp_path / "ema.safetensors")
    key = "diffusion_model.blocks.0.self_attn.q.lora_B.weight"
    torch.testing.assert_close(ema[key], 0.25 * s1[key] + 0.25 * s2[key] + 0.5 * s3[key])
    assert (
        ema["diffusion_model.blocks.0.self_attn.q.alpha"] == s1["diffusion_model.blocks.0.self_attn.q.alpha"]
    )

    write_lora(wan_model, tmp_path / "other_alpha.safetensors", seed=4, alpha=1.0)
    with pytest.raises(CheckpointError, match="equal alphas"):
        lora_cli("ema", files[0], tmp_path / "other_alpha.safetensors", "--out", tmp_path / "x.safetensors")
