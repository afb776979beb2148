"""LoHa and LoKr: their updates are the Hadamard / Kronecker formulas, they train, merge, save and load.

Unit tests run on small MLPs with deterministic weights; the CLI tests at the end train on the tiny
Wan fixture through `tuner train` (they need `network.type` in the config schema and the trainer built
through `tuner.networks.factory.build_network`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tuner.errors import CheckpointError, TunerError
from tuner.networks import LoHaNetwork, LoKrNetwork, LoRANetwork, TargetSpec, apply_adapter_file
from tuner.networks.delta import to_lora
from tuner.networks.keys import read_safetensors
from tuner.networks.loha import _HadamardLinear
from tuner.networks.lokr import factorize

SPEC = TargetSpec(defaults=(r"\d+",))


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48)).requires_grad_(False)


def perturb(network, seed: int = 0, std: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)


def inputs() -> torch.Tensor:
    return torch.randn(4, 5, 32, generator=torch.Generator().manual_seed(1))


NETWORKS = {
    "loha": lambda model, **kw: LoHaNetwork.apply_to(model, SPEC, 4, 2.0, **kw),
    "lokr": lambda model, **kw: LoKrNetwork.apply_to(model, SPEC, 4, 2.0, **kw),
    "lokr_both": lambda model, **kw: LoKrNetwork.apply_to(model, SPEC, 2, 1.0, decompose_both=True, **kw),
    "lokr_full": lambda model, **kw: LoKrNetwork.apply_to(model, SPEC, 4, 2.0, full_matrix=True, **kw),
    "lokr_factor4": lambda model, **kw: LoKrNetwork.apply_to(model, SPEC, 4, 2.0, factor=4, **kw),
}


# --- the formulas ---------------------------------------------------------------------------------


def test_factorize():
    assert factorize(5120) == (64, 80)
    assert factorize(64) == (8, 8)
    assert factorize(128) == (8, 16)
    assert factorize(5120, 8) == (8, 640)
    assert factorize(13) == (1, 13)
    with pytest.raises(TunerError):
        factorize(64, 0)


def test_loha_update_is_a_hadamard_product():
    network = NETWORKS["loha"](mlp())
    perturb(network)
    a = network["0"]
    p1 = a.hada_w1_a @ a.hada_w1_b
    p2 = a.hada_w2_a @ a.hada_w2_b
    expected = torch.stack([torch.stack([p1[i, j] * p2[i, j] for j in range(32)]) for i in range(64)]) * 0.5
    torch.testing.assert_close(a.delta_weight(), expected)
    x = inputs()
    torch.testing.assert_close(a(x), F.linear(x, expected), atol=1e-6, rtol=1e-5)


def test_lokr_update_is_a_kronecker_product_and_its_forward_never_builds_it():
    network = NETWORKS["lokr"](mlp())
    perturb(network)
    a = network["2"]  # 48 x 64 = (6 x 8) kron (8 x 8)
    assert a.factors["lokr_w1"].shape == (6, 8) and a.factors["lokr_w2_a"].shape == (8, 4)
    w1, w2 = a.factors["lokr_w1"], a.factors["lokr_w2_a"] @ a.factors["lokr_w2_b"]
    block = torch.empty(48, 64)
    for i in range(6):
        for j in range(8):
            block[i * 8 : (i + 1) * 8, j * 8 : (j + 1) * 8] = w1[i, j] * w2  # block (i, j) = w1[i, j] · w2
    torch.testing.assert_close(a.delta_weight(), block * 0.5)
    x = torch.randn(4, 5, 64)
    torch.testing.assert_close(a(x), F.linear(x, block * 0.5), atol=1e-5, rtol=1e-5)


def test_lokr_modes_and_their_file_keys(tmp_path):
    for kind, keys in (
        ("lokr", {"lokr_w1", "lokr_w2_a", "lokr_w2_b"}),
        ("lokr_both", {"lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b"}),
        ("lokr_full", {"lokr_w1", "lokr_w2"}),
    ):
        network = NETWORKS[kind](mlp())
        network.save(tmp_path / f"{kind}.safetensors")
        suffixes = {k.rsplit(".", 1)[1] for k in load_file(tmp_path / f"{kind}.safetensors")}
        assert suffixes == keys | {"alpha"}, kind
    assert network["0"].scale == 1.0
    with pytest.raises(TunerError, match="exclude each other"):
        LoKrNetwork.apply_to(mlp(), SPEC, 4, decompose_both=True, full_matrix=True)


@pytest.mark.parametrize("layout", ["comfy", "kohya"])
def test_full_matrix_lokr_writes_the_alpha_of_its_scale(tmp_path, layout):
    """Issue #21: without `alpha` keys LyCORIS's `create_lycoris_from_weights` fails on float(None). Both
    factors full means no rank and scale 1 (LyCORIS and ComfyUI ignore alpha then): alpha 1 says so."""
    network = NETWORKS["lokr_full"](mlp())  # configured with alpha 2.0, which a full-matrix LoKr ignores
    perturb(network)
    path = tmp_path / f"{layout}.safetensors"
    network.save(path, format=layout)
    tensors = load_file(path)
    stems = {k.rsplit(".", 1)[0] for k in tensors}
    assert len(stems) == 2
    for stem in stems:  # `diffusion_model.0` / `lora_unet_0`: the module is the stem's last character
        assert tensors[f"{stem}.alpha"].dtype == torch.float32 and tensors[f"{stem}.alpha"].item() == 1.0
        # LyCORIS's functional math for two full factors: ΔW = w1 ⊗ w2, scale 1 whatever alpha says
        delta = torch.kron(tensors[f"{stem}.lokr_w1"], tensors[f"{stem}.lokr_w2"])
        assert torch.equal(delta, network[stem[-1]].delta_weight())
    model, base, x = mlp(), mlp(), inputs()
    loaded = apply_adapter_file(model, path)
    with torch.no_grad():
        for name in ("0", "2"):
            base.get_submodule(name).weight.add_(network[name].delta_weight())
        torch.testing.assert_close(model(x), base(x), atol=1e-5, rtol=1e-5)
    assert all(module.scale == 1.0 for module in loaded)


def test_hadamard_linear_gradients():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=g, dtype=torch.double, requires_grad=True)
            for s in ((3, 5, 12), (8, 3), (3, 12), (8, 3), (3, 12))]  # fmt: skip
    assert torch.autograd.gradcheck(lambda *a: _HadamardLinear.apply(*a, 0.7), args)


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_bf16_base_under_autocast(kind):
    model = mlp().to(torch.bfloat16)
    network = NETWORKS[kind](model, dora=True)
    perturb(network)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(inputs().to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    y.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in network.parameters())


@pytest.mark.parametrize("kind", NETWORKS)
def test_exact_lora_form(kind):
    network = NETWORKS[kind](mlp())
    perturb(network)
    for adapter in network:
        weights = adapter.weights()
        torch.testing.assert_close(to_lora(weights).delta(), weights.delta(), atol=1e-5, rtol=1e-5)


# --- training, merge, files -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", NETWORKS)
def test_starts_at_zero_trains_and_merges(kind):
    model = mlp()
    x = inputs()
    base = model(x)
    network = NETWORKS[kind](model)
    assert torch.equal(model(x), base)
    optimizer = torch.optim.AdamW(network.param_groups(1e-2), weight_decay=0.0)
    target = torch.randn_like(base)
    losses = []
    for _ in range(5):
        loss = F.mse_loss(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with torch.no_grad():
        network.set_multiplier(0.7)
        with_adapter = model(x)
        network.merge_into_base()
        torch.testing.assert_close(model(x), with_adapter, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", NETWORKS)
def test_save_load_round_trip(kind, tmp_path):
    model = mlp()
    x = inputs()
    network = NETWORKS[kind](model)
    perturb(network)
    expected = model(x)
    network.save(tmp_path / "a.safetensors", metadata={"note": "x"})
    network.remove()

    fresh_model = mlp()
    torch.manual_seed(7)  # another init
    fresh = NETWORKS[kind](fresh_model)
    assert fresh.load_weights(tmp_path / "a.safetensors")["note"] == "x"
    assert torch.equal(fresh_model(x), expected)

    inference_model = mlp()
    loaded = apply_adapter_file(inference_model, tmp_path / "a.safetensors")
    assert type(loaded) is type(network) and not loaded.training
    # Frozen tensors may take another matmul kernel than ones that require grad: equal to ~1 ulp.
    torch.testing.assert_close(inference_model(x), expected, atol=1e-6, rtol=1e-6)


def test_loading_another_type_or_shape_is_refused(tmp_path):
    loha = NETWORKS["loha"](mlp())
    loha.save(tmp_path / "loha.safetensors")
    with pytest.raises(CheckpointError, match="not LoRA tensors"):
        LoRANetwork.apply_to(mlp(), SPEC, 4).load_weights(tmp_path / "loha.safetensors")
    with pytest.raises(CheckpointError, match="network expects"):
        LoHaNetwork.apply_to(mlp(), SPEC, 8).load_weights(tmp_path / "loha.safetensors")
    NETWORKS["lokr"](mlp()).save(tmp_path / "lokr.safetensors")
    with pytest.raises(CheckpointError, match="decompose_both"):
        NETWORKS["lokr_both"](mlp()).load_weights(tmp_path / "lokr.safetensors")


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_dropouts_act_only_in_train_mode(kind):
    model = mlp()
    x = inputs()
    network = NETWORKS[kind](model, dropout=0.2, rank_dropout=0.5, module_dropout=0.3)
    perturb(network)
    network.eval()
    assert torch.equal(model(x), model(x))
    network.train()
    torch.manual_seed(0)
    outputs = [model(x) for _ in range(6)]
    assert any(not torch.allclose(a, b) for a, b in zip(outputs, outputs[1:]))


# --- through the CLI (needs the trainer wired to build_network) -----------------------------------


@pytest.fixture(scope="module")
def cached_project(tmp_path_factory, wan_model):
    from project import make_project
    from tuner.cli import main

    config = make_project(tmp_path_factory.mktemp("loha_lokr_project"), wan_model, steps=3)
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    return config


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["network.type='loha'"],
        ["network.type='lokr'", "network.factor=4"],
        ["network.type='lokr'", "network.decompose_both=true"],
        ["network.type='lokr'", "network.full_matrix=true"],
    ],
    ids=["loha", "lokr", "lokr_both", "lokr_full"],
)
def test_cli_trains_saves_and_reloads(overrides, cached_project, wan_model, tmp_path):
    from diffusers import WanTransformer3DModel

    from tuner.archs.wan.loaders import original_module_name
    from tuner.cli import main

    out = tmp_path / "out"
    sets = [
        a for o in (f"save.output_dir='{out}'", "log.tensorboard=false", *overrides) for a in ("--set", o)
    ]
    assert main(["train", "--config", str(cached_project), *sets]) == 0
    adapter = out / "demo_lora.safetensors"
    kind = overrides[0].split("'")[1]
    assert read_safetensors(adapter)[1]["tuner.network_type"] == kind

    model = WanTransformer3DModel.from_pretrained(wan_model / "diffusers" / "transformer").eval()
    network = apply_adapter_file(model, adapter, name_map=original_module_name)
    assert network.network_type == kind and len(network) == 20
    # continue training from the saved file
    more = [*sets, "--set", f"network.network_weights='{adapter}'", "--set", f"save.output_dir='{out}2'"]
    assert main(["train", "--config", str(cached_project), *more]) == 0
