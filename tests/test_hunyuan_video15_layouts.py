"""HunyuanVideo 1.5's two single-file layouts, and adapters named as ComfyUI's HunyuanVideo 1.5 model reads them.

Comfy-Org's repackaged files fuse each double block's q/k/v (`img_attn_qkv`), Tencent's release keeps
them apart (`img_attn_q`); see `tuner.archs.hunyuan_video15.keys` for where these facts come from. The
ComfyUI key rules (ComfyUI 0.8: `comfy/supported_models.py` renames a file's keys to its module names,
`comfy/lora.py` maps adapter names onto them) are `tuner.networks.receivers`' data, not ComfyUI's code.
"""

import re

import pytest
import torch
from safetensors.torch import load_file

from project import cfg, make_project
from tuner.archs.hunyuan_video15 import loaders as hv
from tuner.archs.hunyuan_video15.keys import HUNYUAN_VIDEO15_LAYOUT, TENCENT_LAYOUT
from tuner.errors import ConfigError
from tuner.fixtures import write_fixture
from tuner.models.loading import load_tensors, read_tensor_shapes
from tuner.networks import LoRANetwork, TargetSpec
from tuner.networks.delta import LORA, ModuleWeights
from tuner.networks.factory import apply_adapter_file
from tuner.networks.formats import layout_state
from tuner.networks.loha import LoHaNetwork
from tuner.networks.receivers import comfy_key_map
from tuner.registry import ARCHITECTURES
from tuner.tools.merge import merge_adapters


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_fixture("hunyuan_video15", tmp_path_factory.mktemp("hunyuan_video15_model"))


@pytest.fixture(scope="module")
def model(paths):
    return hv.load_transformer(paths["diffusers"], torch.float32).requires_grad_(False)


def comfy_adapter_names(file_keys) -> set[str]:
    """Every adapter stem ComfyUI maps onto a weight of its HunyuanVideo 1.5 model built from a file with
    `file_keys` (`receivers.comfy_key_map`: its module names under `diffusion_model.` and `lora_unet_`, and
    diffusion-pipe's release names under `diffusion_model.` / `transformer.`). A file in Tencent's
    separate-q/k/v layout does not load into the model at all."""
    return comfy_key_map("hunyuan_video15", file_keys)


def _network(model, cls=LoRANetwork, seed=0, **options):
    targets = TargetSpec(ARCHITECTURES["hunyuan_video15"].default_targets)
    network = cls.apply_to(model, targets, 4, 2.0, name_map=HUNYUAN_VIDEO15_LAYOUT, **options)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return network


def _stems(path) -> set[str]:
    return {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in load_file(path)}


def _deltas(network) -> dict[str, torch.Tensor]:
    return {name: weights.delta() for name, weights in network.weights().items()}


# ---------------------------------------------------------------------------------------------------
# The two files
# ---------------------------------------------------------------------------------------------------


def test_comfyui_file_fuses_what_tencent_keeps_apart_rows_q_k_v(paths):
    """musubi-tuner splits a ComfyUI file's `*_attn_qkv` (weight and bias) into thirds q, k, v."""
    comfy, tencent = load_tensors(paths["transformer_file"]), load_tensors(paths["tencent_transformer_file"])
    fused = {k for k in comfy if "_attn_qkv." in k and k.startswith("double_blocks.")}
    assert fused == {f"double_blocks.0.{s}_attn_qkv.{t}" for s in ("img", "txt") for t in ("weight", "bias")}
    for key in fused:
        thirds = comfy[key].chunk(3)
        for part, third in zip("qkv", thirds):
            assert torch.equal(tencent[key.replace("_qkv.", f"_{part}.")], third), key
    separate = {
        k for k in tencent if re.fullmatch(r"double_blocks\.\d+\.(img|txt)_attn_[qkv]\.(weight|bias)", k)
    }
    assert len(separate) == 12 and comfy.keys() - fused == tencent.keys() - separate


def test_full_fine_tunes_are_written_in_the_comfyui_layout(model, paths):
    """A full fine-tune's file (the layout's `to_original`) has the keys of Comfy-Org's files."""
    written = HUNYUAN_VIDEO15_LAYOUT.to_original(model.state_dict())
    assert written.keys() == read_tensor_shapes(paths["transformer_file"]).keys()
    assert (
        "double_blocks.0.img_attn_qkv.weight" in written
        and "double_blocks.0.img_attn_q.weight" not in written
    )
    assert (
        TENCENT_LAYOUT.to_original(model.state_dict()).keys()
        == read_tensor_shapes(paths["tencent_transformer_file"]).keys()
    )


# ---------------------------------------------------------------------------------------------------
# Adapters: every key one ComfyUI maps, and they read back
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["comfy", "kohya"])
@pytest.mark.parametrize("cls", [LoRANetwork, LoHaNetwork], ids=["lora", "loha"])
def test_every_exported_key_names_a_module_of_comfyui_model(model, paths, tmp_path, layout, cls):
    """The default and kohya files name only modules ComfyUI's HunyuanVideo 1.5 model has (q/k/v fused,
    the MLPs' kohya names ComfyUI's `img_mlp_0`), and read back to the same adapters."""
    network = _network(model, cls)
    try:
        path = tmp_path / f"{layout}.safetensors"
        network.save(path, HUNYUAN_VIDEO15_LAYOUT, format=layout)
        expected = _deltas(network)
    finally:
        network.remove()
    stems = _stems(path)
    assert len(stems) == 8  # img/txt: fused qkv, proj, mlp in and out
    assert stems <= comfy_adapter_names(read_tensor_shapes(paths["transformer_file"])), sorted(stems)
    assert not any(s.endswith(("attn_q", "attn_k", "attn_v")) for s in stems)
    if layout == "kohya":
        assert (
            "lora_unet_double_blocks_0_img_mlp_0" in stems
            and "lora_unet_double_blocks_0_txt_attn_qkv" in stems
        )
    loaded = apply_adapter_file(model, path, name_map=HUNYUAN_VIDEO15_LAYOUT)
    try:
        got = {name: weights.delta() for name, weights in loaded.weights().items()}
    finally:
        loaded.remove()
    assert got.keys() == expected.keys()
    for name, delta in expected.items():
        torch.testing.assert_close(got[name], delta, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", ["comfy", "kohya"])
def test_adapters_in_tencent_names_still_read(model, tmp_path, layout):
    """Files naming q/k/v apart (tuner's before, musubi-tuner's `lora_unet_..._img_attn_q` / `_img_mlp_fc1`)."""
    network = _network(model)
    try:
        path = tmp_path / "tencent.safetensors"
        network.save(path, TENCENT_LAYOUT.keys, format=layout)
        expected = _deltas(network)
    finally:
        network.remove()
    assert any(s.endswith(("img_attn_q", "img_mlp_fc1", "img_mlp.fc1")) for s in _stems(path))
    loaded = apply_adapter_file(model, path, name_map=HUNYUAN_VIDEO15_LAYOUT)
    try:
        got = _deltas(loaded)
    finally:
        loaded.remove()
    assert (
        all(torch.equal(got[name], delta) for name, delta in expected.items())
        and got.keys() == expected.keys()
    )


def musubi_adapter_names(tencent_file_keys) -> set[str]:
    """Every adapter stem musubi-tuner's HunyuanVideo 1.5 LoRA names: `lora_unet_` + its model's module name
    with "_", its model holding Tencent's names (a ComfyUI file's `*_attn_qkv` split on load)."""
    return {"lora_unet_" + k.removesuffix(".weight").replace(".", "_") for k in tencent_file_keys
            if k.endswith(".weight")}  # fmt: skip


def test_musubi_file_names_modules_of_musubis_model(model, paths, tmp_path):
    """`musubi` writes Tencent's separate q/k/v and `img_mlp_fc1` (musubi-tuner would drop ComfyUI's fused
    `img_attn_qkv` silently), and reads back to the same adapters."""
    network = _network(model)
    try:
        path = tmp_path / "musubi.safetensors"
        network.save(path, HUNYUAN_VIDEO15_LAYOUT, format="musubi")
        expected = _deltas(network)
    finally:
        network.remove()
    stems = _stems(path)
    assert len(stems) == 12  # img/txt: q, k, v, proj, mlp in and out
    assert stems <= musubi_adapter_names(read_tensor_shapes(paths["tencent_transformer_file"])), sorted(stems)
    assert {"lora_unet_double_blocks_0_img_attn_q", "lora_unet_double_blocks_0_txt_attn_v",
            "lora_unet_double_blocks_0_img_mlp_fc1"} <= stems  # fmt: skip
    loaded = apply_adapter_file(model, path, name_map=HUNYUAN_VIDEO15_LAYOUT)
    try:
        got = _deltas(loaded)
    finally:
        loaded.remove()
    assert got.keys() == expected.keys()
    for name, delta in expected.items():
        torch.testing.assert_close(got[name], delta, atol=1e-6, rtol=1e-5)


def test_musubi_file_keeps_the_refiners_qkv_fused():
    """musubi-tuner's model keeps the text refiner's `self_attn_qkv` fused (its loader splits only the double
    blocks'): the `musubi` layout fuses it, and nothing else."""
    refiner = "context_embedder.token_refiner.refiner_blocks.0.attn"
    names = [f"{refiner}.{p}" for p in ("to_q", "to_k", "to_v")] + ["transformer_blocks.0.attn.to_q",
             "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v"]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    modules = {n: ModuleWeights(LORA, {"down": torch.randn(2, 8, generator=g), "up": torch.randn(8, 2, generator=g)},
                                1.0) for n in names}  # fmt: skip
    state, _ = layout_state(modules, "musubi", HUNYUAN_VIDEO15_LAYOUT)
    stems = {k.split(".")[0] for k in state}
    assert stems == {"lora_unet_txt_in_individual_token_refiner_blocks_0_self_attn_qkv"} | {
        f"lora_unet_double_blocks_0_img_attn_{p}" for p in "qkv"
    }


def test_kohya_file_merges_like_the_default_one(model, paths, tmp_path):
    """`tuner lora merge` reads the kohya MLP names (ComfyUI's, not the checkpoint's) through the table."""
    network = _network(model)
    try:
        network.save(tmp_path / "comfy.safetensors", HUNYUAN_VIDEO15_LAYOUT, format="comfy")
        network.save(tmp_path / "kohya.safetensors", HUNYUAN_VIDEO15_LAYOUT, format="kohya")
    finally:
        network.remove()
    for layout in ("comfy", "kohya"):
        merge_adapters(paths["transformer_file"], [(tmp_path / f"{layout}.safetensors", 1.0)],
                       tmp_path / f"merged_{layout}.safetensors")  # fmt: skip
    comfy, kohya = (
        load_file(tmp_path / "merged_comfy.safetensors"),
        load_file(tmp_path / "merged_kohya.safetensors"),
    )
    base = load_tensors(paths["transformer_file"])
    assert comfy.keys() == kohya.keys() == base.keys()
    assert not torch.equal(
        comfy["double_blocks.0.img_mlp.fc1.weight"], base["double_blocks.0.img_mlp.fc1.weight"]
    )
    for key in comfy:
        torch.testing.assert_close(kohya[key], comfy[key], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------
# DoRA: refused before anything runs
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["hunyuan_video15", "hunyuan_video15_i2v"])
def test_dora_is_refused_when_the_config_loads(tmp_path, arch):
    """A column-wise DoRA of q, k or v alone has no fused form, and ComfyUI names no part of `img_attn.qkv`."""
    config = make_project(tmp_path / "project", tmp_path / "model", architecture=arch)
    cfg(config)  # fine without DoRA
    with pytest.raises(ConfigError, match=r"network\.dora.*img_attn\.qkv"):
        cfg(config, "network.dora=true")
