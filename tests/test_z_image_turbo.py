"""Training on Z-Image-Turbo: `model.merge_adapters` (general, shown on the Z-Image fixture) and the
warning that names it.

`model.merge_adapters` folds adapter files into the loaded base transformer before anything else sees
it; training on the base with an adapter merged that way must equal training on a base file with the
same adapter merged by `tuner lora merge`, from the same cache.
"""

import json
import shutil
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from project import cfg, make_cached_project
from tuner.archs.z_image.loaders import load_transformer
from tuner.archs.z_image.trainer import ZImageModel
from tuner.config import load_config
from tuner.errors import ConfigError
from tuner.fixtures import write_fixture
from tuner.networks.lora import LoRANetwork
from tuner.networks.targets import TargetSpec
from tuner.tools.merge import merge_adapters
from tuner.trainers import trainer_class


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("z_image_merge")
    paths = write_fixture("z_image", root / "model")
    config = make_cached_project(root / "project", root / "model", architecture="z_image")
    return root, config, paths


def _adapter(trainer: ZImageModel, path, layout: str) -> None:
    """A trained-looking LoRA on the default targets, saved in `layout`; "ai-toolkit" is how ai-toolkit
    writes Z-Image adapters (the de-distillation adapter among them): diffusers' module names and
    lora_A / lora_B under `diffusion_model.`, no alpha, no metadata."""
    model = trainer.load_transformer(torch.float32)
    network = LoRANetwork.apply_to(model, TargetSpec(trainer.default_targets), rank=4, alpha=2,
                                   name_map=trainer.layout)  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    for adapter in network:
        adapter.up.data.copy_(torch.randn(adapter.up.shape, generator=gen) * 0.1)
    network.save(path, trainer.layout, format="diffusers" if layout == "ai-toolkit" else layout)
    if layout == "ai-toolkit":  # the alpha is folded into lora_B already
        tensors = load_file(str(path))
        save_file(
            {k.replace("transformer.", "diffusion_model.", 1): v for k, v in tensors.items()}, str(path)
        )


def _train(config, out, *overrides) -> tuple[list[float], dict[str, torch.Tensor], dict[str, str]]:
    trainer = trainer_class("z_image")(cfg(config, f"save.output_dir='{out}'", "log.tensorboard=false",
                                "train.max_steps=3", *overrides))  # fmt: skip
    final = trainer.train(log=lambda s: None)
    with safe_open(str(final), "pt") as f:
        return trainer.history, {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("layout", ["kohya", "diffusers", "ai-toolkit"])
def test_training_on_merged_adapters_equals_training_on_a_merged_file(project, tmp_path, layout):
    root, config, paths = project
    trainer = ZImageModel(cfg(config))
    first, second = tmp_path / f"dedistill_{layout}.safetensors", tmp_path / "style.safetensors"
    _adapter(trainer, first, layout)
    _adapter(trainer, second, "comfy")
    merged = tmp_path / "z_image_merged.safetensors"
    merge_adapters(
        paths["transformer_file"], [(str(first), 0.8), (str(second), -0.5)], merged, arch="z_image"
    )

    option = f"model.merge_adapters=['{first}:0.8', '{second}:-0.5']"

    # the base weights: equal to fp32 rounding (the file tool sums the deltas, the option adds each)
    in_memory = ZImageModel(cfg(config, option))
    model = in_memory.load_transformer(torch.float32)
    in_memory.merge_base_adapters(model)
    expected = load_transformer(merged, torch.float32).state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-6)

    # so is training on them, from the same cache
    want_loss, want, want_meta = _train(config, tmp_path / "premerged", f"model.transformer='{merged}'")
    got_loss, got, got_meta = _train(config, tmp_path / "in_memory", option)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)
    # the base it was trained on is recorded; the cache was the same one (no re-encoding asked for)
    assert json.loads(got_meta["tuner.merged_adapters"]) == [[first.name, 0.8], [second.name, -0.5]]
    assert "tuner.merged_adapters" not in want_meta
    assert want_loss != pytest.approx(_train(config, tmp_path / "plain")[0], rel=1e-6)  # the merge mattered


def test_merge_adapters_entries_are_parsed_at_load_time(project, tmp_path):
    _, config, _ = project
    model = load_config(config, ["model.merge_adapters=['a.safetensors:0.5', '/x/b.safetensors']"]).model
    assert model.adapter_merges() == ((str(config.parent / "a.safetensors"), 0.5), ("/x/b.safetensors", 1.0))
    with pytest.raises(ConfigError, match="merge_adapters.*strength"):
        load_config(config, ["model.merge_adapters=['a.safetensors:strong']"])


def test_turbo_without_a_merged_adapter_warns_naming_the_option(project, tmp_path):
    root, config, paths = project
    turbo = tmp_path / "z_image_turbo_tiny.safetensors"
    shutil.copy(paths["transformer_file"], turbo)
    adapter = tmp_path / "dedistill.safetensors"
    _adapter(ZImageModel(cfg(config)), adapter, "kohya")
    with pytest.warns(UserWarning, match=r"Turbo.*model\.merge_adapters") as caught:
        _train(config, tmp_path / "turbo", f"model.transformer='{turbo}'")
    assert len([w for w in caught if "merge_adapters" in str(w.message)]) == 1  # once per run
    with warnings.catch_warnings(record=True) as quiet:  # none with the adapter merged, nor for Base
        warnings.simplefilter("always")
        _train(config, tmp_path / "turbo_merged", f"model.transformer='{turbo}'",
               f"model.merge_adapters=['{adapter}']")  # fmt: skip
        _train(config, tmp_path / "base")
    assert not [str(w.message) for w in quiet if "merge_adapters" in str(w.message)]


def test_generation_sees_the_merged_adapters(project, tmp_path):
    """`tuner generate` with model.merge_adapters draws what it draws from the pre-merged file."""
    import numpy as np
    from PIL import Image

    from tuner.generate import GenerateOptions, generate

    _, config, paths = project
    adapter = tmp_path / "dedistill.safetensors"
    _adapter(ZImageModel(cfg(config)), adapter, "kohya")
    merged = tmp_path / "merged.safetensors"
    merge_adapters(paths["transformer_file"], [(str(adapter), 1.0)], merged, arch="z_image")

    def draw(name, *overrides):
        opts = GenerateOptions(prompt="a cat", out=str(tmp_path / f"{name}.png"), width=32, height=32, frames=1,
                               steps=2, guidance_scale=1.0, device="cpu")  # fmt: skip
        return np.asarray(
            Image.open(generate(cfg(config, *overrides), opts, log=lambda s: None)), dtype=float
        )

    want = draw("premerged", f"model.transformer='{merged}'")
    got = draw("in_memory", f"model.merge_adapters=['{adapter}']")
    plain = draw("plain")
    assert np.abs(got - want).max() <= 1  # 8-bit rounding
    assert np.abs(plain - want).max() > 1


def test_two_expert_models_refuse_merge_adapters():
    """Which expert would an adapter go into? Two-expert models are told to merge into each file."""
    from types import SimpleNamespace

    from tuner.archs.wan.trainer_wan22 import Wan22T2VModel
    from tuner.config.schema import ModelConfig
    from tuner.errors import TrainingError
    from tuner.registry import architecture

    trainer = Wan22T2VModel.__new__(Wan22T2VModel)
    model = ModelConfig(
        architecture="wan22_t2v", transformer="high.safetensors", merge_adapters=("a.safetensors",)
    )
    trainer.cfg, trainer.record = SimpleNamespace(model=model), architecture("wan22_t2v")
    with pytest.raises(TrainingError, match="merge_adapters.*tuner lora merge"):
        trainer.merge_base_adapters(torch.nn.Linear(2, 2))
