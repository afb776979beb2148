"""Adapter file layouts: comfy keys match the original release, conversions are lossless, fusing is exact.

Runs on the tiny Wan fixture (its diffusers transformer, and its original-layout single file for the
key check) and on a synthetic model with a fused qkv layer for the fused-layer builder.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from project import output
from tuner.archs.wan.loaders import original_module_name
from tuner.errors import CheckpointError, TunerError
from tuner.models.loading import read_tensor_shapes
from tuner.networks import (
    LoHaNetwork,
    LoKrNetwork,
    LoRAModule,
    LoRANetwork,
    TargetSpec,
    apply_adapter_file,
)
from tuner.networks.architectures import ArchitectureKeys
from tuner.networks.formats import read_modules
from tuner.networks.fused import FusedLayer
from tuner.registry import ARCHITECTURES
from tuner.tools.convert import convert_adapter

WAN_TARGETS = ARCHITECTURES["wan"].default_targets

# Every layer the users train, plus layers outside the defaults, to check their names too.
ALL_LINEARS = TargetSpec(WAN_TARGETS, include=(r"proj_out", r"condition_embedder\..*"))
COMFY_SUFFIXES = {
    "lora_A.weight", "lora_B.weight", "alpha", "dora_scale",
    "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b",
    "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b",
}  # fmt: skip
NETWORKS = {
    "lora": (LoRANetwork, {}),
    "lora_dora": (LoRANetwork, {"dora": True}),
    "loha": (LoHaNetwork, {}),
    "lokr": (LoKrNetwork, {}),
    "lokr_both": (LoKrNetwork, {"decompose_both": True}),
    "lokr_full": (LoKrNetwork, {"full_matrix": True}),
}


@pytest.fixture(scope="module")
def wan_transformer(wan_model):
    return WanTransformer3DModel.from_pretrained(wan_model / "diffusers" / "transformer").eval()


def perturb(network, seed: int = 0, std: float = 0.05) -> None:
    """A trained-looking adapter without training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)


def deltas(path) -> dict[str, torch.Tensor]:
    return {stem: w.delta() for stem, w in read_modules(path)[0].items()}


# --- comfy keys are the original release's --------------------------------------------------------


@pytest.mark.parametrize("kind", NETWORKS)
def test_every_comfy_key_names_a_weight_of_the_original_file(kind, wan_transformer, wan_model, tmp_path):
    cls, options = NETWORKS[kind]
    network = cls.apply_to(wan_transformer, ALL_LINEARS, 4, 2.0, name_map=original_module_name, **options)
    try:
        network.save(tmp_path / "a.safetensors")
    finally:
        network.remove()
    original = read_tensor_shapes(wan_model / "single" / "wan2.1_t2v_tiny.safetensors")
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert all(any(k.endswith("." + suffix) for suffix in COMFY_SUFFIXES) for k in keys)
    modules, _ = read_modules(tmp_path / "a.safetensors")  # strict: every key is an adapter tensor
    assert len(modules) == len(network) == 26  # 20 block layers, 5 embedders, the head
    for stem, weights in modules.items():
        assert stem.startswith("diffusion_model.")
        weight_key = stem.removeprefix("diffusion_model.") + ".weight"
        assert weight_key in original, stem
        assert weights.shape == original[weight_key], stem
        if weights.dora_scale is not None:
            assert weights.dora_scale.shape == (1, original[weight_key][1])


# --- conversions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr_both", "lora_dora"])
def test_comfy_kohya_round_trip_is_bit_exact(kind, wan_transformer, tmp_path):
    cls, options = NETWORKS[kind]
    network = cls.apply_to(
        wan_transformer, TargetSpec(WAN_TARGETS), 4, 2.0, name_map=original_module_name, **options
    )
    perturb(network)
    network.save(tmp_path / "comfy.safetensors", metadata={"tuner.architecture": "wan"})
    network.remove()
    convert_adapter(tmp_path / "comfy.safetensors", tmp_path / "kohya.safetensors", "kohya")
    kohya = load_file(tmp_path / "kohya.safetensors")
    assert any(k.startswith("lora_unet_blocks_0_self_attn_q.") for k in kohya)
    convert_adapter(tmp_path / "kohya.safetensors", tmp_path / "back.safetensors", "comfy")
    before, after = load_file(tmp_path / "comfy.safetensors"), load_file(tmp_path / "back.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_lora_through_diffusers_layout_is_bit_exact_for_power_of_two_scales(wan_transformer, tmp_path):
    network = LoRANetwork.apply_to(
        wan_transformer, TargetSpec(WAN_TARGETS), 8, 2.0, name_map=original_module_name
    )
    perturb(network)
    network.save(tmp_path / "0-comfy.safetensors", metadata={"tuner.architecture": "wan"})
    network.remove()
    chain = ["comfy", "diffusers", "kohya", "diffusers", "comfy"]
    for i, layout in enumerate(chain[1:], start=1):
        convert_adapter(
            tmp_path / f"{i - 1}-{chain[i - 1]}.safetensors", tmp_path / f"{i}-{layout}.safetensors", layout
        )
    diffusers = load_file(tmp_path / "1-diffusers.safetensors")
    assert "transformer.blocks.0.attn1.to_q.lora_A.weight" in diffusers and not any(
        "alpha" in k for k in diffusers
    )
    before, after = load_file(tmp_path / "0-comfy.safetensors"), load_file(tmp_path / "4-comfy.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr", "lokr_full"])
def test_every_layout_encodes_the_same_update(kind, wan_transformer, tmp_path):
    """Also with a scale that is not a power of two (alpha 3, rank 4): equal up to fp32 rounding."""
    cls, options = NETWORKS[kind]
    network = cls.apply_to(
        wan_transformer, TargetSpec(WAN_TARGETS), 4, 3.0, name_map=original_module_name, **options
    )
    perturb(network)
    expected = output(wan_transformer)
    network.save(tmp_path / "comfy.safetensors", metadata={"tuner.architecture": "wan"})
    network.remove()
    reference = deltas(tmp_path / "comfy.safetensors")
    for layout in ("diffusers", "kohya"):
        convert_adapter(tmp_path / "comfy.safetensors", tmp_path / f"{layout}.safetensors", layout)
        convert_adapter(tmp_path / f"{layout}.safetensors", tmp_path / f"{layout}_back.safetensors", "comfy")
        back = deltas(tmp_path / f"{layout}_back.safetensors")
        assert back.keys() == reference.keys()
        for stem, delta in reference.items():
            torch.testing.assert_close(back[stem], delta, atol=1e-6, rtol=1e-5)
        loaded = apply_adapter_file(
            wan_transformer, tmp_path / f"{layout}.safetensors", name_map=original_module_name
        )
        try:
            torch.testing.assert_close(output(wan_transformer), expected, atol=1e-5, rtol=1e-5)
        finally:
            loaded.remove()


def test_network_saves_and_reloads_every_layout(wan_transformer, tmp_path):
    network = LoHaNetwork.apply_to(
        wan_transformer, TargetSpec(WAN_TARGETS), 4, 4.0, name_map=original_module_name
    )
    perturb(network)
    expected = output(wan_transformer)
    for layout in ("comfy", "kohya"):
        network.save(tmp_path / f"{layout}.safetensors", format=layout)
    network.remove()
    for layout in ("comfy", "kohya"):
        fresh = LoHaNetwork.apply_to(
            wan_transformer, TargetSpec(WAN_TARGETS), 4, name_map=original_module_name
        )
        fresh.load_weights(tmp_path / f"{layout}.safetensors")
        assert torch.equal(output(wan_transformer), expected)
        fresh.remove()


def test_reading_is_strict(tmp_path):
    conv = {
        "lora_unet_x.lora_down.weight": torch.zeros(2, 4, 3, 3),
        "lora_unet_x.lora_up.weight": torch.zeros(4, 2, 1, 1),
    }
    tucker = {"lora_unet_x.hada_t1": torch.zeros(2, 2, 3, 3)}
    mixed = {
        "diffusion_model.x.lora_A.weight": torch.zeros(2, 4),
        "diffusion_model.x.hada_w1_a": torch.zeros(4, 2),
    }
    lonely = {"diffusion_model.x.lora_A.weight": torch.zeros(2, 4)}
    for state, message in ((conv, "not matrices"), (tucker, "not adapter tensors"), (mixed, "several adapter types"),
                           (lonely, "lacks")):  # fmt: skip
        with pytest.raises(CheckpointError, match=message):
            read_modules(state)


# --- fused layers ---------------------------------------------------------------------------------


class SplitAttention(nn.Module):
    """diffusers-style: separate q, k, v projections."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.to_q, self.attn.to_k, self.attn.to_v = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)
        self.attn.to_out = nn.Linear(32, 16)

    def forward(self, x):
        a = self.attn
        return a.to_out(torch.cat([a.to_q(x), a.to_k(x), a.to_v(x)], dim=-1))


class FusedAttention(nn.Module):
    """The original release's layout: one qkv projection."""

    def __init__(self, split: SplitAttention) -> None:
        super().__init__()
        a = split.attn
        self.qkv = nn.Linear(16, 32)
        self.proj = nn.Linear(32, 16)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight]))
            self.qkv.bias.copy_(torch.cat([a.to_q.bias, a.to_k.bias, a.to_v.bias]))
            self.proj.load_state_dict(a.to_out.state_dict())

    def forward(self, x):
        return self.proj(self.qkv(x))


TOY_KEYS = ArchitectureKeys(
    "toy",
    renames=(("attn.to_out", "proj"),),
    fused=(FusedLayer("qkv", ("attn.to_q", "attn.to_k", "attn.to_v"), proportions=(2, 1, 1)),),
)


def toy_network(model: SplitAttention, alphas=(1.0, 3.0, 0.5), ranks=(2, 3, 4)) -> LoRANetwork:
    """Parts with different ranks and scales (1/2, 1, 1/8), so the builder has to fold."""
    layers = [model.attn.to_q, model.attn.to_k, model.attn.to_v]
    adapters = [
        LoRAModule(n, layer, r, a)
        for n, layer, r, a in zip(("attn.to_q", "attn.to_k", "attn.to_v"), layers, ranks, alphas)
    ]
    adapters.append(LoRAModule("attn.to_out", model.attn.to_out, 2, 2.0))
    network = LoRANetwork(adapters, name_map=TOY_KEYS)
    perturb(network, std=0.3)
    return network


@pytest.mark.parametrize("alphas", [(1.0, 3.0, 0.5), (2.0, 3.0, 4.0)], ids=["folded", "shared_scale"])
def test_fused_qkv_adapter_is_exact(alphas, tmp_path):
    torch.manual_seed(0)
    split_model = SplitAttention()
    fused_model = FusedAttention(split_model)
    x = torch.randn(3, 5, 16)
    network = toy_network(split_model, alphas)
    expected = split_model(x)
    per_part = torch.cat([network[n].delta_weight() for n in ("attn.to_q", "attn.to_k", "attn.to_v")])
    network.save(tmp_path / "fused.safetensors")

    state = load_file(tmp_path / "fused.safetensors")
    assert set(state) == {
        f"diffusion_model.{m}.{s}"
        for m in ("qkv", "proj")
        for s in ("lora_A.weight", "lora_B.weight", "alpha")
    }
    down, up = state["diffusion_model.qkv.lora_A.weight"], state["diffusion_model.qkv.lora_B.weight"]
    assert down.shape == (9, 16) and up.shape == (32, 9)
    assert torch.count_nonzero(up[:16, 2:]) == 0 and torch.count_nonzero(up[16:24, :2]) == 0  # block diagonal
    fused_delta = read_modules(tmp_path / "fused.safetensors")[0]["diffusion_model.qkv"].delta()
    torch.testing.assert_close(fused_delta, per_part, atol=1e-6, rtol=1e-6)

    # The fused file applied to the original layout computes what the split adapters did.
    for module, stem in ((fused_model.qkv, "qkv"), (fused_model.proj, "proj")):
        with torch.no_grad():
            module.weight += read_modules(tmp_path / "fused.safetensors")[0][
                f"diffusion_model.{stem}"
            ].delta()
    torch.testing.assert_close(fused_model(x), expected, atol=1e-5, rtol=1e-5)

    # ... and splits back: exactly with tuner's metadata, at the fused rank without it.
    network.remove()
    fresh = LoRANetwork([LoRAModule(a.name, a.base, a.rank) for a in network], name_map=TOY_KEYS)
    fresh.load_weights(tmp_path / "fused.safetensors")
    for a, b in zip(network, fresh):
        assert a.alpha == b.alpha
        torch.testing.assert_close(b.up, a.up, atol=0, rtol=1e-6)
    torch.testing.assert_close(split_model(x), expected, atol=1e-6, rtol=1e-6)
    fresh.remove()
    save_file(state, str(tmp_path / "foreign.safetensors"))  # no metadata: another tool's fused file
    foreign = apply_adapter_file(split_model, tmp_path / "foreign.safetensors", name_map=TOY_KEYS)
    assert foreign["attn.to_q"].rank == 9
    torch.testing.assert_close(split_model(x), expected, atol=1e-5, rtol=1e-5)


def test_fused_layer_needs_all_its_parts():
    model = SplitAttention()
    network = LoRANetwork.apply_to(model, TargetSpec((r"attn\.to_[qk]",)), 2, name_map=TOY_KEYS)
    with pytest.raises(TunerError, match="adapt all of them or none"):
        network.file_state_dict()
