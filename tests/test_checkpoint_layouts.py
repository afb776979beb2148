"""Whole-model checkpoints in each architecture's original layout, for every architecture (issue #21).

- A full fine-tune saved in the default layout (`save.format`, comfy) has the key and shape set of the
  release's single file, and loads back, through the architecture's own loader and as a checkpoint to
  continue from, to exactly the trained weights.
- `memory.fp8_base` on a ComfyUI fp8 file, in both of ComfyUI's layouts, keeps the file's exact fp8
  values (fused layers split into their parts with the layer's scale), and the model's output equals
  the output with the dequantized weights to float rounding.
- An export that fails leaves the saved state behind, and `--resume latest` finishes the run.

These belong to the contract suite (`tests/test_contract.py`) and use the same tiny fixtures.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from project import cfg, contract_inputs, make_project
from test_fp8 import write_comfy_fp8_state
from test_full_finetune import network_config
from tuner import fp8
from tuner.fixtures import write_fixture
from tuner.memory import apply_memory_settings
from tuner.models.loading import load_tensors, normalize_state_dict, read_tensor_shapes
from tuner.networks import FullNetwork, build_network
from tuner.networks.layouts import diffusers_tensors, original_state_dict
from tuner.registry import resolve_save_format
from tuner.trainers import trainer_class

COMFY_PREFIX = "model.diffusion_model."
# original keys a ComfyUI fp8 test file quantizes: the blocks' (Z-Image's and Lumina 2's are `layers` and
# `*_refiner`; FLUX.3's per-mode lists are `content_mode_blocks.image.N`)
IN_FP8 = re.compile(r"(blocks|layers|refiner)\.(image\.|image_cond\.)?\d+\.|^final_layer\.")


@pytest.fixture
def case(contract):
    """(architecture, config, fixture paths) of every registered architecture, its cache filled."""
    return contract


def trainer_for(case, *overrides: str):
    arch, config, _ = case
    return trainer_class(arch)(cfg(config, *overrides))


def original_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    return {k.removeprefix(COMFY_PREFIX): v for k, v in read_tensor_shapes(path).items()}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# --- full fine-tune -------------------------------------------------------------------------------


def test_full_fine_tune_saves_the_default_layout_and_loads_back(case, tmp_path):
    trainer = trainer_for(case)
    model = trainer.load_transformer(torch.float32).requires_grad_(False)
    network = build_network(model, trainer.default_targets, network_config(type="full"), trainer.layout)
    optimizer = torch.optim.AdamW(network.param_groups(1e-3), weight_decay=0.0)
    noisy, t, cond = contract_inputs(trainer)
    trainer.predict(model, noisy, t, cond).pow(2).mean().backward()
    optimizer.step()
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}

    path = tmp_path / "full.safetensors"
    layout = resolve_save_format(case[0], "auto", full=True)  # what "auto" means for a full fine-tune
    network.save(path, trainer.layout, format=layout)
    assert original_shapes(path) == original_shapes(case[2]["transformer_file"])  # the release's layout
    fixture = {k.removeprefix(COMFY_PREFIX): v for k, v in load_tensors(case[2]["transformer_file"]).items()}
    assert any(not torch.equal(v, fixture[k]) for k, v in load_file(path).items())  # trained, not as loaded

    reloaded = trainer_for(case, f"model.transformer='{path}'").load_transformer(torch.float32)
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, trained[key]), key
    fresh = trainer.load_transformer(torch.float32)
    FullNetwork(fresh).load_weights(path, trainer.layout.inverse)  # continue training from the file
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, trained[key]), key


# --- fp8 base from a ComfyUI fp8 file ---------------------------------------------------------------


@pytest.mark.parametrize("layout", ["legacy", "comfy_quant"])
def test_fp8_base_keeps_a_comfyui_fp8_file_exact(case, tmp_path, layout):
    # the blocks' linear weights in fp8, as ComfyUI's files have them (FLUX's fused qkv and linear1
    # among them), and FLUX's final modulation, whose row halves diffusers swaps
    original = normalize_state_dict(load_tensors(case[2]["transformer_file"]), torch.float32)
    path = tmp_path / f"fp8_{layout}.safetensors"
    written = write_comfy_fp8_state(original, path, layout, quantized=IN_FP8.search)
    assert fp8.is_comfy_fp8_file(path)

    trainer = trainer_for(case, f"model.transformer='{path}'", "memory.fp8_base=true")
    model = trainer.load_transformer(torch.float32).requires_grad_(False)
    dequantized = copy.deepcopy(model)  # what loading without fp8_base gives: w8 · scale in fp32
    apply_memory_settings(
        model, trainer.cfg.memory, "cpu", fp8_source=str(path), name_map=trainer.layout.inverse
    )

    fp8_layers = {name: model.get_submodule(name) for name in fp8.fp8_linear_names(model)}
    stored = original_state_dict({f"{n}.weight": m.weight for n, m in fp8_layers.items()}, trainer.layout)
    # weights used outside a linear layer (HiDream's MoE routers) stay as loaded: dequantized
    modules = dict(model.named_modules())
    for stem in list(written):
        if stem in modules and not isinstance(modules[stem], torch.nn.Linear):
            assert torch.equal(modules[stem].weight, dequantized.get_submodule(stem).weight), stem
            del written[stem]
    # and so do linear layers whose dtype the model casts their input to (Kandinsky 6's modulation)
    for stem, (w8, _) in list(written.items()):
        names = [
            k.removesuffix(".weight") for k in diffusers_tensors(f"{stem}.weight", w8, trainer.layout.inverse)
        ]
        if all(fp8.reads_own_dtype(name, trainer.layout) for name in names):
            for name in names:
                assert torch.equal(modules[name].weight, dequantized.get_submodule(name).weight), name
            del written[stem]
    assert {k.removesuffix(".weight") for k in stored} == set(written)
    for stem, (w8, scale) in written.items():  # the exact stored bytes, back in the file's layout
        assert torch.equal(stored[f"{stem}.weight"].view(torch.uint8), w8.view(torch.uint8)), stem
        for key in diffusers_tensors(f"{stem}.weight", w8, trainer.layout.inverse):  # each part: the scale
            assert fp8_layers[key.removesuffix(".weight")].fp8_scale.item() == scale.item(), key

    noisy, t, cond = contract_inputs(trainer)
    with torch.no_grad():
        out = trainer.predict(model, noisy, t, cond)
        assert relative_error(out, trainer.predict(dequantized, noisy, t, cond)) < 1e-5
        reference = trainer_for(case).load_transformer(torch.float32)  # the unquantized fixture
        # fp8's own error with one scale per tensor: 0.009 (Qwen-Image) to 0.04 (FLUX) on these inputs;
        # 0.07 for Cosmos-Predict2 (its AdaLN-LoRA modulation is two fp8 linears per sub-layer) and 0.078
        # for HiDream, whose top-2 expert routing amplifies rounding (0.073 with its routers kept)
        assert relative_error(out, trainer.predict(reference, noisy, t, cond)) < 0.09


# --- a failing export ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_failing_export_leaves_the_state_and_resume_finishes_the_run(tmp_path, monkeypatch):
    """Issue #21: a FLUX full fine-tune whose export failed lost the whole run. The state is saved before
    the export now: `--resume latest` then writes the same file an uninterrupted run writes."""
    from tuner.cli import main

    write_fixture("flux", tmp_path / "model")
    config = make_project(tmp_path / "project", tmp_path / "model", architecture="flux")
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    sets = ["network.type='full'", "train.max_steps=2", "log.tensorboard=false"]

    def train(out: Path, *extra: str) -> int:
        overrides = [*sets, f"save.output_dir='{out}'"]
        return main(["train", "--config", str(config), *extra, *(a for s in overrides for a in ("--set", s))])

    assert train(tmp_path / "a") == 0
    with monkeypatch.context() as patch:

        def export_fails(*args, **kwargs):
            raise RuntimeError("export failed")

        patch.setattr(FullNetwork, "save", export_fails)
        with pytest.raises(RuntimeError, match="export failed"):
            train(tmp_path / "b")
    assert (tmp_path / "b" / "state" / "step000002" / "position.json").is_file()
    assert not (tmp_path / "b" / "demo_lora.safetensors").exists()

    assert train(tmp_path / "b", "--resume", "latest") == 0
    straight, resumed = (
        load_file(tmp_path / "a" / "demo_lora.safetensors"),
        load_file(tmp_path / "b" / "demo_lora.safetensors"),
    )
    assert straight.keys() == set(
        original_shapes(tmp_path / "model" / "single" / "flux1-dev_tiny.safetensors")
    )
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
