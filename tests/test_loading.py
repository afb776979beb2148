"""Shared checkpoint-loading helpers."""

import pytest
import torch

from tuner.models.loading import normalize_shapes, normalize_state_dict


@pytest.mark.parametrize(
    "extra",
    [
        {"scaled_fp8": torch.zeros(0), "blocks.0.q.scale_weight": torch.tensor(0.5)},  # older ComfyUI layout
        {
            "blocks.0.q.weight_scale": torch.tensor(0.5),
            "blocks.0.q.comfy_quant": torch.zeros(4, dtype=torch.uint8),
        },
    ],
)
def test_comfy_fp8_weights_are_dequantized_in_both_layouts(extra):
    weight = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    stored = {"model.diffusion_model.blocks.0.q.weight": weight.to(torch.float8_e4m3fn),
              "model.diffusion_model.blocks.0.q.bias": torch.ones(2)}  # fmt: skip
    stored.update({f"model.diffusion_model.{k}": v for k, v in extra.items()})
    out = normalize_state_dict(stored, torch.float32)
    assert set(out) == {"blocks.0.q.weight", "blocks.0.q.bias"}
    torch.testing.assert_close(out["blocks.0.q.weight"], weight * 0.5)
    assert set(normalize_shapes({k: tuple(v.shape) for k, v in stored.items()})) == set(out)
