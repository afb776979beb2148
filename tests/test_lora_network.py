"""LoRA network: targeting, forward patching, training, merge, files in the comfy/kohya/PEFT layouts.

Runs on a tiny diffusers Wan transformer (2 blocks, width 64) and on a plain nn.Sequential. The Wan
name map below is a test stand-in for the real per-architecture data (diffusers -> original names).
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import WanTransformer3DModel
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from project import wan_inputs
from tuner.errors import CheckpointError, TunerError
from tuner.networks import LoRANetwork, TargetSpec, apply_adapter_file, find_targets, load_lora_file

WAN_TARGETS = (
    r"blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)",
    r"blocks\.\d+\.ffn\.net\.(0\.proj|2)",
)
_WAN_RENAMES = [
    ("attn1.", "self_attn."),
    ("attn2.", "cross_attn."),
    ("to_q", "q"),
    ("to_k", "k"),
    ("to_v", "v"),
    ("to_out.0", "o"),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
]


def wan_name_map(name: str) -> str:
    """Like the real per-architecture tables: KeyError for modules it does not know."""
    if not name.startswith("blocks."):
        raise KeyError(name)
    for old, new in _WAN_RENAMES:
        name = name.replace(old, new)
    return name


def tiny_wan(seed: int = 0) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=32,
        in_channels=16,
        out_channels=16,
        text_dim=64,
        freq_dim=64,
        ffn_dim=128,
        num_layers=2,
        cross_attn_norm=True,
        rope_max_seq_len=32,
    )
    return model.eval().requires_grad_(False)


def run(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def randomize_up(network: LoRANetwork, seed: int = 2, std: float = 0.05) -> None:
    """A trained-looking LoRA without training: up is no longer zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in network:
            adapter.up.copy_(torch.randn(adapter.up.shape, generator=g) * std)


def apply_wan(model: nn.Module, rank: int = 4, alpha: float | None = 2.0, **kwargs) -> LoRANetwork:
    spec = TargetSpec(defaults=WAN_TARGETS)
    return LoRANetwork.apply_to(model, spec, rank, alpha, name_map=wan_name_map, **kwargs)


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(dtype).requires_grad_(False)


MLP_SPEC = TargetSpec(defaults=(r"\d+",))


# --- targeting ------------------------------------------------------------------------------------


def test_default_targets_are_the_block_projections():
    model = tiny_wan()
    names = list(find_targets(model, TargetSpec(defaults=WAN_TARGETS)))
    assert len(names) == 20
    assert names[:3] == ["blocks.0.attn1.to_q", "blocks.0.attn1.to_k", "blocks.0.attn1.to_v"]
    assert "blocks.1.ffn.net.2" in names and "proj_out" not in names


def test_exclude_then_include_wins():
    model = tiny_wan()
    spec = TargetSpec(
        defaults=WAN_TARGETS,
        exclude=(r".*\.attn2\..*",),
        include=(r"blocks\.0\.attn2\.to_q", r"proj_out"),
    )
    names = set(find_targets(model, spec))
    assert not any(".attn2." in n for n in names - {"blocks.0.attn2.to_q"})
    assert {"blocks.0.attn2.to_q", "proj_out", "blocks.1.attn1.to_q"} <= names
    assert len(names) == 20 - 8 + 2


def test_no_match_and_bad_regex_are_user_errors():
    with pytest.raises(TunerError, match="nomatch"):
        find_targets(tiny_wan(), TargetSpec(defaults=(r"nomatch\..*",)))
    with pytest.raises(TunerError, match="not a valid regular expression"):
        find_targets(tiny_wan(), TargetSpec(defaults=("blocks(",)))


# --- forward patching -----------------------------------------------------------------------------


def test_apply_leaves_output_and_base_keys_unchanged():
    model = tiny_wan()
    keys_before = list(model.state_dict())
    reference = run(model, wan_inputs())
    network = apply_wan(model)
    assert len(network) == 20
    assert list(model.state_dict()) == keys_before  # the base layers stayed in place
    assert all(p.dtype == torch.float32 for p in network.parameters())
    assert torch.equal(run(model, wan_inputs()), reference)  # up starts at zero

    network.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_training_changes_output_and_not_base_weights():
    model = tiny_wan()
    base_weights = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = wan_inputs()
    reference = run(model, inputs)
    network = apply_wan(model)
    optimizer = torch.optim.AdamW(network.param_groups(lr=1e-2), weight_decay=0.0)
    target = torch.randn_like(reference)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(**inputs)[0], target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.allclose(run(model, inputs), reference, atol=1e-4)
    assert all(torch.equal(v, base_weights[k]) for k, v in model.state_dict().items())


def test_merge_equals_lora_forward():
    model = tiny_wan()
    network = apply_wan(model)
    randomize_up(network)
    network.set_multiplier(0.7)
    with_lora = run(model, wan_inputs())
    network.merge_into_base()
    assert all("forward" not in m.__dict__ for m in model.modules())
    torch.testing.assert_close(run(model, wan_inputs()), with_lora, atol=1e-5, rtol=1e-5)  # fp32


def test_multiplier_scales_the_delta_linearly():
    model = mlp()
    x = torch.randn(3, 32)
    base = model(x)
    # only the last layer: a delta passed through GELU and a second layer would not be linear
    network = LoRANetwork.apply_to(model, TargetSpec(defaults=("2",)), rank=4, alpha=8)
    randomize_up(network)
    delta_one = model(x) - base
    network.set_multiplier(2.5)
    torch.testing.assert_close(model(x) - base, 2.5 * delta_one, atol=1e-6, rtol=1e-5)
    network.set_multiplier(0.0)
    assert torch.equal(model(x), base)


def test_rank_and_module_dropout_only_in_train_mode():
    model = mlp()
    x = torch.randn(4, 32)
    network = LoRANetwork.apply_to(model, MLP_SPEC, rank=8, rank_dropout=0.5, module_dropout=0.5, dropout=0.3)
    randomize_up(network)
    network.eval()
    outputs = [model(x) for _ in range(3)]
    assert all(torch.equal(o, outputs[0]) for o in outputs)
    network.train()
    torch.manual_seed(0)
    train_outputs = [model(x) for _ in range(8)]
    assert any(not torch.allclose(o, outputs[0]) for o in train_outputs)
    assert any(not torch.allclose(a, b) for a, b in zip(train_outputs, train_outputs[1:]))


def test_module_dropout_skips_the_whole_adapter():
    model = mlp()
    x = torch.randn(4, 32)
    base = model(x)
    network = LoRANetwork.apply_to(model, TargetSpec(defaults=("0",)), rank=4, module_dropout=0.5)
    randomize_up(network)
    torch.manual_seed(0)
    skipped = [torch.equal(model(x), base) for _ in range(20)]
    assert 0 < sum(skipped) < 20


def test_two_networks_stack_and_remove_in_any_order():
    model = mlp()
    x = torch.randn(2, 32)
    base = model(x)
    first = LoRANetwork.apply_to(model, MLP_SPEC, rank=2)
    second = LoRANetwork.apply_to(model, MLP_SPEC, rank=2)
    randomize_up(first, seed=1)
    randomize_up(second, seed=2)
    both = model(x)
    first.remove()
    only_second = model(x)
    second.remove()
    assert torch.equal(model(x), base)
    assert not torch.allclose(both, only_second)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_remove_keeps_a_wrapper_installed_after_us():
    model = mlp()
    x = torch.randn(2, 32)
    base = model(x)
    network = LoRANetwork.apply_to(model, MLP_SPEC, rank=2)
    randomize_up(network)
    with_lora = model(x)
    calls = []
    inner = model[0].forward

    def wrapper(inputs):
        calls.append(1)
        return inner(inputs)

    model[0].forward = wrapper  # e.g. a diffusers hook registered after the LoRA
    assert torch.equal(model(x), with_lora)
    network.remove()
    assert torch.equal(model(x), base) and len(calls) == 2


def test_loraplus_param_groups():
    network = apply_wan(tiny_wan())
    plain = network.param_groups(lr=1e-4)
    assert len(plain) == 1 and plain[0]["lr"] == 1e-4 and len(plain[0]["params"]) == 40
    down, up = network.param_groups(lr=1e-4, loraplus_lr_ratio=16)
    assert down["lr"] == 1e-4 and up["lr"] == pytest.approx(1.6e-3)
    assert {id(p) for p in up["params"]} == {id(a.up) for a in network}
    assert {id(p) for p in down["params"]} == {id(a.down) for a in network}


# --- precision ------------------------------------------------------------------------------------


def test_bf16_base_with_fp32_adapter_trains_and_merges():
    model = mlp(dtype=torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    network = LoRANetwork.apply_to(model, MLP_SPEC, rank=4)
    assert all(p.dtype == torch.float32 for p in network.parameters())
    randomize_up(network)
    y = model(x)
    assert y.dtype == torch.bfloat16
    y.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in network.parameters())
    with torch.no_grad():
        with_lora = model(x)
        network.merge_into_base()
        assert model[0].weight.dtype == torch.bfloat16
        torch.testing.assert_close(model(x), with_lora, atol=0.05, rtol=0.02)  # bf16 weight rounding


def test_fp8_storage_base_via_layerwise_casting():
    model = tiny_wan()
    model.to(torch.bfloat16).enable_layerwise_casting(
        storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16
    )
    before = run(model, wan_inputs(dtype=torch.bfloat16))
    network = apply_wan(model)
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.float8_e4m3fn
    assert all(p.dtype == torch.float32 for p in network.parameters())
    assert torch.equal(run(model, wan_inputs(dtype=torch.bfloat16)), before)
    randomize_up(network)
    after = run(model, wan_inputs(dtype=torch.bfloat16))
    assert after.dtype == torch.bfloat16 and not torch.equal(after, before)
    network.remove()  # someone wrapped forward before us: removal must keep their wrapper working
    assert torch.equal(run(model, wan_inputs(dtype=torch.bfloat16)), before)


# --- files ----------------------------------------------------------------------------------------


def test_saved_keys_follow_the_comfy_layout(tmp_path):
    network = apply_wan(tiny_wan(), rank=4, alpha=2.0)
    path = tmp_path / "lora.safetensors"
    network.save(path, metadata={"tuner.run": "test", "note": json.dumps({"steps": 5})}, dtype=torch.bfloat16)
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        metadata = f.metadata()
        q_down = f.get_tensor("diffusion_model.blocks.0.self_attn.q.lora_A.weight")
        ffn_up = f.get_tensor("diffusion_model.blocks.1.ffn.0.lora_B.weight")
        alpha = f.get_tensor("diffusion_model.blocks.1.cross_attn.o.alpha")
    stems = {
        f"diffusion_model.blocks.{b}.{attn}.{p}"
        for b in (0, 1)
        for attn in ("self_attn", "cross_attn")
        for p in "qkvo"
    } | {f"diffusion_model.blocks.{b}.ffn.{i}" for b in (0, 1) for i in (0, 2)}
    assert keys == {f"{s}.{suffix}" for s in stems for suffix in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert q_down.shape == (4, 64) and q_down.dtype == torch.bfloat16
    assert ffn_up.shape == (128, 4)
    assert alpha.shape == () and alpha.dtype == torch.float32 and alpha.item() == 2.0
    assert metadata["tuner.network_type"] == "lora" and metadata["tuner.format"] == "comfy"
    assert metadata["tuner.rank"] == "4" and float(metadata["tuner.alpha"]) == 2.0
    assert len(json.loads(metadata["tuner.targets"])) == 20
    assert json.loads(metadata["note"]) == {"steps": 5}


def test_save_load_round_trip_reproduces_outputs(tmp_path):
    model = tiny_wan()
    network = apply_wan(model)
    randomize_up(network)
    expected = run(model, wan_inputs())
    path = tmp_path / "lora.safetensors"
    network.save(path, metadata={"epoch": "3"})

    fresh_model = tiny_wan()
    torch.manual_seed(123)  # a different init of down
    fresh = apply_wan(fresh_model)
    metadata = fresh.load_weights(path)
    assert metadata["epoch"] == "3"
    assert torch.equal(run(fresh_model, wan_inputs()), expected)

    # inference path: rank and alpha come from the file
    infer_model = tiny_wan()
    loaded = apply_adapter_file(infer_model, path, multiplier=1.0, name_map=wan_name_map)
    assert not loaded.training and not loaded.trainable_parameters()
    assert torch.equal(run(infer_model, wan_inputs()), expected)


def test_name_map_given_at_save_and_inverse_at_load(tmp_path):
    """The trainer's way: the network knows no name map; save and load are told one."""
    model = tiny_wan()
    network = LoRANetwork.apply_to(model, TargetSpec(defaults=WAN_TARGETS), rank=4)
    randomize_up(network)
    expected = run(model, wan_inputs())
    path = tmp_path / "lora.safetensors"
    network.save(path, wan_name_map)
    assert "diffusion_model.blocks.0.self_attn.q" in load_lora_file(path)[0]

    inverse_table = {wan_name_map(name): name for name in network.names()}
    fresh_model = tiny_wan()
    fresh = LoRANetwork.apply_to(fresh_model, TargetSpec(defaults=WAN_TARGETS), rank=4)
    with pytest.raises(CheckpointError, match="match no adapted module"):
        fresh.load_weights(path)
    fresh.load_weights(path, inverse_table.__getitem__)
    assert torch.equal(run(fresh_model, wan_inputs()), expected)


def test_load_is_strict(tmp_path):
    network = apply_wan(tiny_wan())
    path = tmp_path / "lora.safetensors"
    network.save(path)
    state = load_lora_file(path)[0]
    assert len(state) == 20 and state["diffusion_model.blocks.0.self_attn.q"].rank == 4

    partial = apply_wan(tiny_wan(), rank=4)
    full = dict(network.file_state_dict())
    fewer = {k: v for k, v in full.items() if ".ffn." not in k}
    save_file(fewer, str(tmp_path / "fewer.safetensors"))
    with pytest.raises(CheckpointError, match=r"fewer\.safetensors.*4 adapted modules have no weights"):
        partial.load_weights(tmp_path / "fewer.safetensors")
    with pytest.raises(CheckpointError, match="match no adapted module"):
        head = {f"diffusion_model.head.head.lora_{m}.weight": torch.zeros(4, 4) for m in "AB"}
        partial.load_weights({**full, **head})
    with pytest.raises(CheckpointError, match="not LoRA tensors"):
        partial.load_weights({**full, "diffusion_model.blocks.0.self_attn.q.hada_w1_a": torch.zeros(4, 64)})
    with pytest.raises(CheckpointError, match="network expects"):
        apply_wan(tiny_wan(), rank=8).load_weights(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        partial.load_weights(tmp_path / "missing.safetensors")


def _comfy_to_kohya(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    suffixes = {
        ".lora_A.weight": ".lora_down.weight",
        ".lora_B.weight": ".lora_up.weight",
        ".alpha": ".alpha",
    }
    converted = {}
    for key, tensor in state.items():
        old, new = next((old, new) for old, new in suffixes.items() if key.endswith(old))
        stem = key.removeprefix("diffusion_model.").removesuffix(old)
        converted[f"lora_unet_{stem.replace('.', '_')}{new}"] = tensor
    return converted


def _to_peft(network: LoRANetwork) -> dict[str, torch.Tensor]:
    """diffusers names, no alpha: the scale is folded into up."""
    state = {}
    for adapter in network:
        state[f"transformer.{adapter.name}.lora_A.weight"] = adapter.down.detach().clone()
        state[f"transformer.{adapter.name}.lora_B.weight"] = adapter.up.detach() * adapter.scale
    return state


def test_kohya_and_peft_layouts_map_onto_the_same_modules(tmp_path):
    model = tiny_wan()
    network = apply_wan(model, alpha=2.0)  # scale 0.5
    randomize_up(network)
    expected = run(model, wan_inputs())

    kohya = _comfy_to_kohya(network.file_state_dict())
    assert "lora_unet_blocks_0_self_attn_q.lora_down.weight" in kohya
    save_file(kohya, str(tmp_path / "kohya.safetensors"))
    save_file(_to_peft(network), str(tmp_path / "peft.safetensors"))
    for name in ("kohya", "peft"):
        fresh_model = tiny_wan()
        loaded = apply_adapter_file(fresh_model, tmp_path / f"{name}.safetensors", name_map=wan_name_map)
        assert sorted(loaded.names()) == sorted(network.names())
        torch.testing.assert_close(run(fresh_model, wan_inputs()), expected, atol=1e-6, rtol=1e-6)
        resumed_model = tiny_wan()
        apply_wan(resumed_model).load_weights(tmp_path / f"{name}.safetensors")
        torch.testing.assert_close(run(resumed_model, wan_inputs()), expected, atol=1e-6, rtol=1e-6)


def test_peft_alpha_from_diffusers_metadata(tmp_path):
    model = mlp()
    network = LoRANetwork.apply_to(model, MLP_SPEC, rank=4, alpha=1.0)
    randomize_up(network)
    x = torch.randn(2, 32)
    expected = model(x)
    state = {
        f"transformer.{a.name}.lora_{m}.weight": getattr(a, p)
        for a in network
        for m, p in (("A", "down"), ("B", "up"))
    }
    save_file(
        {k: v.detach().contiguous() for k, v in state.items()},
        str(tmp_path / "peft.safetensors"),
        metadata={"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": 1, "transformer.r": 4})},
    )
    fresh = mlp()
    apply_adapter_file(fresh, tmp_path / "peft.safetensors")
    torch.testing.assert_close(fresh(x), expected)


def test_sequential_kohya_names_and_ambiguity():
    model = mlp()
    network = LoRANetwork.apply_to(model, MLP_SPEC, rank=2)
    kohya = _comfy_to_kohya(network.file_state_dict())
    assert set(kohya) >= {"lora_unet_0.lora_down.weight", "lora_unet_2.lora_up.weight"}
    network.load_weights(kohya)

    # `a_b.c` and `a.b_c` share the kohya form `a_b_c`: refuse to guess.
    root = nn.Module()
    root.a_b, root.a = nn.Module(), nn.Module()
    root.a_b.c, root.a.b_c = nn.Linear(4, 4), nn.Linear(4, 4)
    both = LoRANetwork.apply_to(root, TargetSpec(defaults=(r".*",)), rank=2)
    comfy = both.file_state_dict()
    both.load_weights(comfy)  # dotted names are unambiguous
    with pytest.raises(CheckpointError, match="fit several modules"):
        both.load_weights(_comfy_to_kohya({k: v for k, v in comfy.items() if ".a_b.c." in k}))


def test_diffusers_reads_our_file_as_an_original_layout_wan_lora(tmp_path):
    """diffusers converts original-layout Wan LoRAs itself: our keys and alpha must survive it."""
    pytest.importorskip("peft")
    from diffusers import WanPipeline

    model = tiny_wan()
    network = apply_wan(model, rank=4, alpha=3.0)
    randomize_up(network)
    expected = run(model, wan_inputs())
    network.save(tmp_path / "lora.safetensors")

    state = WanPipeline.lora_state_dict(tmp_path / "lora.safetensors")
    state = state[0] if isinstance(state, tuple) else state
    other = tiny_wan()
    other.load_lora_adapter(state, prefix="transformer")
    torch.testing.assert_close(run(other, wan_inputs()), expected, atol=1e-5, rtol=1e-5)


def test_a_layer_without_a_release_name_is_refused_before_training():
    """An adapter the release's layout cannot name would fail at the save after training; the network
    refuses it when it is built instead."""
    from tuner.config.schema import NetworkConfig
    from tuner.errors import ConfigError
    from tuner.networks.architectures import ArchitectureKeys
    from tuner.networks.factory import build_network

    only_attention = ArchitectureKeys("test", (("blocks.{i}.attn1.to_q", "blocks.{i}.self_attn.q"),))
    cfg = NetworkConfig(include=(r"blocks\.0\.attn1\.to_q", r"proj_out"))
    with pytest.raises(ConfigError, match="could not be saved in the comfy layout.*proj_out"):
        build_network(tiny_wan(), (), cfg, only_attention, save_format="comfy")
