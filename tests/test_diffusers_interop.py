"""Our `diffusers`-layout files load with diffusers' own `WanPipeline.load_lora_weights`, and we read PEFT's.

The pipeline comes from the tiny Wan fixture's diffusers folder; every component is put in eval mode
(a pipeline loaded from disk is, but a constructed one is not, and T5 dropout would make outputs
differ). Tolerance: outputs agree to atol = rtol = 1e-5 in fp32 (measured ~1e-6: PEFT computes
B(A x) where we compute the same product in another order).
"""

from __future__ import annotations

import logging

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel

from project import output
from tuner.errors import TunerError
from tuner.models.wan import original_module_name
from tuner.networks import LoHaNetwork, LoKrNetwork, LoRANetwork, TargetSpec, apply_adapter_file
from tuner.networks.keys import read_safetensors
from tuner.registry import ARCHITECTURES

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


class _Warnings(logging.Handler):
    """diffusers' loggers do not propagate; collect what they say while loading."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


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

    pipe = fixture_pipeline(wan_model)
    warnings = _Warnings()
    logger = logging.getLogger("diffusers")
    logger.addHandler(warnings)
    try:
        pipe.load_lora_weights(tmp_path / "lora.safetensors")
    finally:
        logger.removeHandler(warnings)
    assert not [m for m in warnings.messages if "key" in m.lower()], warnings.messages

    # Every one of our modules became a PEFT LoRA layer.
    state = pipe.transformer.state_dict()
    injected = {k.split(".lora_A.")[0] for k in state if ".lora_A." in k}
    assert injected == set(network.names())
    torch.testing.assert_close(output(pipe.transformer), expected, **TOLERANCE)


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
