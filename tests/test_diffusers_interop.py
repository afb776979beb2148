"""Our files load with diffusers' own LoRA loaders, with the same result; and we read PEFT's files.

- Wan: the auto layout (comfy) and the diffusers layout through `WanPipeline.load_lora_weights`.
- FLUX.1: the auto layout (kohya) through diffusers' own FLUX LoRA conversion, at the real width (its
  converter hard-codes FLUX.1's sizes, so the tiny fixture cannot be used; the LoRA tensors are small).
- Qwen-Image: see `test_qwen_image_models.py`.

The Wan pipeline comes from the tiny fixture's diffusers folder; every component is put in eval mode
(a pipeline loaded from disk is, but a constructed one is not, and T5 dropout would make outputs
differ). Tolerance: outputs agree to atol = rtol = 1e-5 in fp32 (measured ~1e-6: PEFT computes
B(A x) where we compute the same product in another order).
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel

from project import DiffusersWarnings, output
from tuner.archs.wan.loaders import original_module_name
from tuner.errors import TunerError
from tuner.networks import LoHaNetwork, LoKrNetwork, LoRANetwork, TargetSpec, apply_adapter_file
from tuner.networks.keys import read_safetensors
from tuner.registry import ARCHITECTURES, resolve_save_format

WAN_TARGETS = ARCHITECTURES["wan"].default_targets

pytest.importorskip("peft")

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def perturb(network, std: float = 0.05) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)


def fixture_pipeline(wan_model) -> WanPipeline:
    pipe = WanPipeline.from_pretrained(wan_model / "diffusers")
    for component in (pipe.transformer, pipe.vae, pipe.text_encoder):
        component.eval()
    return pipe


@pytest.mark.parametrize(
    "cls, options",
    [(LoRANetwork, {}), (LoHaNetwork, {}), (LoKrNetwork, {}), (LoKrNetwork, {"full_matrix": True})],
    ids=["lora", "loha", "lokr", "lokr_full"],
)
def test_diffusers_export_loads_in_wan_pipeline(cls, options, wan_model, tmp_path):
    ours = WanTransformer3DModel.from_pretrained(wan_model / "diffusers" / "transformer").eval()
    network = cls.apply_to(ours, TargetSpec(WAN_TARGETS), 4, 3.0, name_map=original_module_name, **options)
    perturb(network)
    expected = output(ours)
    network.save(tmp_path / "lora.safetensors", format="diffusers")
    metadata = read_safetensors(tmp_path / "lora.safetensors")[1]
    assert metadata["tuner.network_type"] == "lora" and metadata.get("tuner.trained_as") == (
        None if cls is LoRANetwork else network.network_type
    )

    assert_loads_in_wan_pipeline(wan_model, tmp_path / "lora.safetensors", network, expected)


def assert_loads_in_wan_pipeline(wan_model, path, network, expected) -> None:
    """`load_lora_weights` takes every module of `network` from `path`, says nothing about keys, and
    the transformer then computes `expected`."""
    pipe = fixture_pipeline(wan_model)
    warnings = DiffusersWarnings()
    logger = logging.getLogger("diffusers")
    logger.addHandler(warnings)
    try:
        pipe.load_lora_weights(path)
    finally:
        logger.removeHandler(warnings)
    assert not [m for m in warnings.messages if "key" in m.lower()], warnings.messages

    # Every one of our modules became a PEFT LoRA layer.
    state = pipe.transformer.state_dict()
    injected = {k.split(".lora_A.")[0] for k in state if ".lora_A." in k}
    assert injected == set(network.names())
    torch.testing.assert_close(output(pipe.transformer), expected, **TOLERANCE)


def test_wan_auto_layout_loads_in_wan_pipeline(wan_model, tmp_path):
    """What training writes by default (comfy: original names, alpha 3 of rank 4) loads unchanged."""
    record = ARCHITECTURES["wan"]
    ours = WanTransformer3DModel.from_pretrained(wan_model / "diffusers" / "transformer").eval()
    network = LoRANetwork.apply_to(ours, TargetSpec(WAN_TARGETS), 4, 3.0, name_map=record.key_table())
    perturb(network)
    expected = output(ours)
    network.save(tmp_path / "lora.safetensors", format=resolve_save_format("wan", "auto"))
    assert "diffusion_model.blocks.0.self_attn.q.alpha" in read_safetensors(tmp_path / "lora.safetensors")[0]
    assert_loads_in_wan_pipeline(wan_model, tmp_path / "lora.safetensors", network, expected)


def test_column_wise_dora_refuses_the_diffusers_layout(wan_model, tmp_path):
    model = WanTransformer3DModel.from_pretrained(wan_model / "diffusers" / "transformer").eval()
    network = LoRANetwork.apply_to(model, TargetSpec(WAN_TARGETS), 4, dora=True)
    with pytest.raises(TunerError, match="comfy or kohya"):
        network.save(tmp_path / "dora.safetensors", format="diffusers")


def test_we_read_a_peft_dora_file(wan_model, tmp_path):
    """A DoRA trained with PEFT (row-wise magnitudes, `lora_magnitude_vector`) as diffusers saves it."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    peft_model = WanTransformer3DModel.from_pretrained(wan_model / "diffusers" / "transformer").eval()
    peft_model.add_adapter(
        LoraConfig(r=4, lora_alpha=4, use_dora=True, target_modules=["to_q", "to_v", "ffn.net.2"])
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    expected = output(peft_model)
    state = {f"transformer.{k}": v.contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}
    assert any("lora_magnitude_vector" in k for k in state)
    save_file(state, str(tmp_path / "peft_dora.safetensors"))

    ours = WanTransformer3DModel.from_pretrained(wan_model / "diffusers" / "transformer").eval()
    network = apply_adapter_file(ours, tmp_path / "peft_dora.safetensors", name_map=original_module_name)
    assert len(network) == 2 * 5  # per block: q and v of both attentions, and ffn.net.2
    torch.testing.assert_close(output(ours), expected, **TOLERANCE)


# --- FLUX.1 at the real width, through diffusers' own conversion ----------------------------------


def test_flux_auto_layout_through_diffusers_converter(tmp_path):
    """Every default target of one double and one single block, rank 4, at FLUX.1's real sizes (hidden
    3072, MLP 12288), saved in FLUX's auto layout (kohya: fused `qkv` / `linear1`); diffusers' FLUX
    loader converts it back to one LoRA per diffusers module. Its ΔW = B @ A must be ours, s · up @ down,
    for every module: alpha (here varied, also within one fused layer) is folded into its factors."""
    from diffusers.loaders import FluxLoraLoaderMixin

    from tuner.io import save_safetensors
    from tuner.networks.delta import LORA, ModuleWeights
    from tuner.networks.formats import layout_state

    hidden, mlp, rank = 3072, 12288, 4
    g = torch.Generator().manual_seed(0)

    def lora(out_features: int, in_features: int, alpha: float) -> ModuleWeights:
        down = torch.randn(rank, in_features, generator=g) * 0.02
        return ModuleWeights(
            LORA, {"down": down, "up": torch.randn(out_features, rank, generator=g) * 0.02}, alpha
        )

    double, single = "transformer_blocks.0", "single_transformer_blocks.0"
    modules = {f"{double}.attn.{n}": lora(hidden, hidden, 2.0) for n in ("to_q", "to_k", "to_v")}  # one scale
    modules |= {
        f"{double}.attn.{n}": lora(hidden, hidden, 8.0) for n in ("add_q_proj", "add_k_proj", "add_v_proj")
    }
    modules |= {f"{double}.attn.{n}": lora(hidden, hidden, 1.0) for n in ("to_out.0", "to_add_out")}
    for ff in ("ff", "ff_context"):
        modules |= {
            f"{double}.{ff}.net.0.proj": lora(mlp, hidden, 3.0),
            f"{double}.{ff}.net.2": lora(hidden, mlp, 4.0),
        }
    # linear1's parts with different scales: tuner folds each into its rows
    for name, out_features, alpha in (("attn.to_q", hidden, 1.0), ("attn.to_k", hidden, 2.0),
                                      ("attn.to_v", hidden, 6.0), ("proj_mlp", mlp, 3.0)):  # fmt: skip
        modules[f"{single}.{name}"] = lora(out_features, hidden, alpha)
    modules[f"{single}.proj_out"] = lora(hidden, hidden + mlp, 4.0)
    record = ARCHITECTURES["flux"]
    assert all(any(re.fullmatch(p, name) for p in record.default_targets) for name in modules)

    state, metadata = layout_state(modules, resolve_save_format("flux", "auto"), record.key_table())
    assert "lora_unet_single_blocks_0_linear1.lora_down.weight" in state
    save_safetensors(state, tmp_path / "lora.safetensors", metadata=metadata)

    converted = FluxLoraLoaderMixin.lora_state_dict(str(tmp_path / "lora.safetensors"))
    assert {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in converted} == set(modules)
    for name, weights in modules.items():
        up, down = (converted[f"transformer.{name}.lora_{ab}.weight"].double() for ab in "BA")
        # ΔW applied to random directions (in float64): equal maps, without building 12288 × 3072
        # matrices, which takes seconds on this machine; a difference of rank ≤ 8 cannot vanish on
        # 16 random directions
        probe = torch.randn(down.shape[1], 16, generator=g, dtype=torch.float64)
        ours = weights.scale * (weights.tensors["up"].double() @ (weights.tensors["down"].double() @ probe))
        # fp32 rounding: diffusers multiplies alpha / rank (e.g. 0.75) into the fp32 factors
        torch.testing.assert_close(up @ (down @ probe), ours, atol=1e-6 * ours.abs().max().item(), rtol=1e-6)
