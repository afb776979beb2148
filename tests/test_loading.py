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


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_one_component_of_a_bundling_file_is_read_alone(tmp_path, suffix):
    from tuner.io import save_safetensors
    from tuner.models.loading import component_entries, load_component_tensors

    bundled = {"first_stage_model.conv.weight": torch.ones(2), "text.clip.embed.weight": torch.arange(3.0)}
    path = tmp_path / f"bundle{suffix}"
    save_safetensors(bundled, path) if suffix == ".safetensors" else torch.save(bundled, path)
    assert component_entries(bundled, ("other.", "text.clip.")) == {
        "embed.weight": bundled["text.clip.embed.weight"]
    }
    assert component_entries(bundled, ("other.",)) == bundled  # a file of that component alone
    loaded = load_component_tensors(path, ("text.clip.",))
    assert loaded.keys() == {"embed.weight"} and torch.equal(loaded["embed.weight"], torch.arange(3.0))
    assert load_component_tensors(path, ()).keys() == bundled.keys()


def test_meta_keys_are_built_once_per_class_and_config(monkeypatch):
    """A single file's expected keys come from a model built on the meta device: once per (class, config
    folder) in a process, and each caller gets its own list."""
    from tuner.archs.wan.loaders import VAE_VARIANTS
    from tuner.models.component import diffusers_class
    from tuner.models.identify import diffusers_meta_keys

    cls, folder = diffusers_class("AutoencoderKLWan"), VAE_VARIANTS[-1].config_dir
    first = diffusers_meta_keys(cls, folder)
    monkeypatch.setattr(cls, "from_config", lambda *a, **k: pytest.fail("built a second time"))
    first.append("changed by the caller")
    assert diffusers_meta_keys(cls, folder) == first[:-1]
