"""`tuner.networks.receivers`: which tool loads which adapter file, checked against real files and tools.

- The table's files are the real exporter's: `export_stems` (a weightless model) gives the stems
  `network.save` writes on the fixture, and the tools read both alike.
- ComfyUI: the stems the table-based rule loads are exactly those of the file's stems that ComfyUI's key
  map, built from the fixture's release file (`comfy_key_map`), holds.
- diffusers: each record's `diffusers_reads` is what the real `load_lora_weights` of its pipeline's loader
  does with each layout on the fixture's transformer (loads every module, 0 with a warning, or raises).
- `tuner lora info` and `tuner lora convert` say it.
"""

from __future__ import annotations

import logging

import diffusers
import pytest
import torch
from safetensors.torch import load_file

from project import DiffusersWarnings, cfg, make_project, run
from tuner.fixtures import write_fixture
from tuner.io import save_safetensors
from tuner.models.loading import read_tensor_shapes
from tuner.networks import LoRANetwork, TargetSpec
from tuner.networks.delta import LORA, ModuleWeights
from tuner.networks.formats import LAYOUTS, layout_state, parse_modules
from tuner.networks.receivers import comfy_key_map, export_stems, read_by_tools, read_file
from tuner.registry import ARCHITECTURES, resolve_save_format

pytest.importorskip("peft")

SAMPLE = ["wan", "hunyuan_video", "hunyuan_video15", "z_image", "sd3", "framepack", "sdxl", "krea2",
          "ideogram4", "hunyuan_image"]  # fmt: skip


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """arch -> its tiny fixture's paths, written once per module."""
    root, written = tmp_path_factory.mktemp("receivers"), {}

    def get(arch):
        if arch not in written:
            written[arch] = write_fixture(arch, root / arch)
        return written[arch]

    return get


def _model(arch, paths):
    record = ARCHITECTURES[arch]
    sub = "unet" if record.model_class == "UNet2DConditionModel" else "transformer"
    return record.transformer_class().from_pretrained(paths["diffusers"] / sub).eval()


def _save(arch, model, path, layout) -> set[str]:
    """The fixture's LoRA (rank 4, alpha 2) saved in `layout`; returns the module names adapted."""
    record = ARCHITECTURES[arch]
    network = LoRANetwork.apply_to(model, TargetSpec(record.default_targets), 4, 2.0,
                                   name_map=record.checkpoint_layout())  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for adapter in network:
            adapter.up.copy_(torch.randn(adapter.up.shape, generator=g) * 0.1)
    network.save(path, record.checkpoint_layout(), format=layout,
                 metadata={"tuner.architecture": arch})  # fmt: skip
    names = set(network.names())
    network.remove()
    return names


def _written(fixtures, arch, tmp_path):
    paths = fixtures(arch)
    model = _model(arch, paths)
    return paths, {layout: (tmp_path / f"{layout}.safetensors") for layout in LAYOUTS if
                   _save(arch, model, tmp_path / f"{layout}.safetensors", layout)}  # fmt: skip


@pytest.mark.parametrize("arch", SAMPLE)
def test_the_table_reads_the_files_training_writes(fixtures, arch, tmp_path):
    """What the tools do with the exporter's stems on a weightless model is what they do with the file."""
    paths, files = _written(fixtures, arch, tmp_path)
    release = read_tensor_shapes(paths["transformer_file"])
    for layout, path in files.items():
        name, readings = read_file(path)
        table = read_by_tools(arch, *export_stems(arch, layout))
        assert name == arch
        assert {t: r.verdict for t, r in readings.items()} == {t: r.verdict for t, r in table.items()}, layout
        # ComfyUI's rule from the key tables agrees with its key map built from the release file
        comfy = readings["ComfyUI"]
        if layout in ("comfy", "kohya", "musubi"):
            key_map = comfy_key_map(arch, release)
            assert set(comfy.loaded) == {s for s in comfy.loaded + comfy.ignored if s in key_map}, layout


def test_comfyui_drops_what_the_issue_found(fixtures, tmp_path):
    """HunyuanVideo's musubi file (`img_mlp_fc1`) loses its MLPs in ComfyUI and loads whole in musubi-tuner;
    the kohya file (`img_mlp_0`) is ComfyUI's; Z-Image's kohya file loses its attention in musubi-tuner."""
    hv = read_by_tools("hunyuan_video", *export_stems("hunyuan_video", "musubi"))
    assert hv["ComfyUI"].verdict.startswith("partial") and hv["musubi-tuner"].verdict == "loads"
    assert all("_mlp_fc" in stem for stem in hv["ComfyUI"].ignored)
    assert (
        read_by_tools("hunyuan_video", *export_stems("hunyuan_video", "kohya"))["ComfyUI"].verdict == "loads"
    )
    z = read_by_tools("z_image", *export_stems("z_image", "kohya"))["musubi-tuner"]
    assert z.ignored and all("attention" in stem for stem in z.ignored)


def test_the_default_loads_in_comfyui_and_in_diffusers_where_any_layout_does():
    """`save.format = "auto"` loads whole in ComfyUI; where a layout loads whole in both ComfyUI and diffusers,
    the default is one (no layout of lumina2 or the HunyuanVideo family does: the table says so)."""
    both = {}
    for name, record in ARCHITECTURES.items():
        verdicts = {layout: read_by_tools(name, *export_stems(name, layout)) for layout in LAYOUTS}
        assert verdicts[record.save_format]["ComfyUI"].verdict == "loads", name
        both[name] = [
            layout
            for layout, r in verdicts.items()
            if r["ComfyUI"].verdict == r["diffusers"].verdict == "loads"
        ]
        assert not both[name] or record.save_format in both[name], (name, both[name])
    assert not both["lumina2"] and not both["hunyuan_video"] and not both["hunyuan_video15"]
    assert both["sd3"] == both["kandinsky5"] == ["diffusers"]
    assert both["ltx2"] == both["ltx_video"] == ["comfy_folded"]
    assert both["ideogram4"] == ["comfy", "comfy_folded"]


def test_dora_never_saves_in_the_diffusers_layout_by_default(tmp_path):
    """PEFT cannot hold tuner's column-wise DoRA: "auto" falls back to comfy where the default is diffusers."""
    assert resolve_save_format("sd3", "auto") == "diffusers"
    assert resolve_save_format("sd3", "auto", dora=True) == "comfy"
    assert resolve_save_format("wan", "auto", dora=True) == "comfy"
    assert (
        resolve_save_format("ltx2", "auto", full=True)
        == resolve_save_format("sd3", "auto", full=True)
        == "comfy"
    )
    config = make_project(tmp_path / "project", tmp_path / "model", architecture="sd3")
    assert cfg(config).save.format == "diffusers" and cfg(config, "network.dora=true").save.format == "comfy"


@pytest.mark.parametrize("kind", ["lora", "loha"])
def test_comfy_folded_has_no_alpha_keys_and_reads_back_exactly(kind):
    """`comfy_folded`: comfy's stems, LoRA only, the scale in lora_B; the metadata restores alpha."""
    g = torch.Generator().manual_seed(0)
    if kind == "lora":
        tensors = {"down": torch.randn(4, 8, generator=g), "up": torch.randn(8, 4, generator=g)}
    else:
        tensors = {r: torch.randn(s, generator=g) for r, s in
                   (("hada_w1_a", (8, 2)), ("hada_w1_b", (2, 8)), ("hada_w2_a", (8, 2)), ("hada_w2_b", (2, 8)))}  # fmt: skip
    name = "transformer_blocks.0.attn1.to_q"
    modules = {name: ModuleWeights(kind, tensors, 3.0)}
    keys = ARCHITECTURES["ltx_video"].key_table()
    state, metadata = layout_state(modules, "comfy_folded", keys)
    assert set(state) == {f"diffusion_model.{name}.lora_A.weight", f"diffusion_model.{name}.lora_B.weight"}
    back = parse_modules(state, metadata, "folded")[f"diffusion_model.{name}"]
    torch.testing.assert_close(back.delta(), modules[name].delta(), atol=1e-5, rtol=1e-5)
    assert back.alpha is not None  # restored from the metadata: converting back gives alpha again


def test_loha_loads_in_no_diffusers_layout_but_its_own():
    modules = export_stems("wan", "comfy")[0]
    loha = {stem: ModuleWeights("loha", {r: torch.zeros(2, 2) for r in ("hada_w1_a", "hada_w1_b", "hada_w2_a",
            "hada_w2_b")}, 1.0) for stem in modules}  # fmt: skip
    readings = read_by_tools("wan", loha)
    assert readings["diffusers"].verdict == "refused" and readings["ComfyUI"].verdict == "loads"


# ---------------------------------------------------------------------------------------------------
# diffusers: the real loaders
# ---------------------------------------------------------------------------------------------------


def diffusers_outcome(loader: str, model, path) -> tuple[str, set[str]]:
    """("loads" | "ignores" | "refuses", the modules given a layer) of the pipeline loader's `load_lora_weights`,
    run on a host holding only the denoiser (what the pipeline would hold under `transformer` / `unet`)."""
    mixin = getattr(diffusers.loaders.lora_pipeline, loader)

    class Host(mixin):
        hf_device_map = None

        def __init__(self, denoiser) -> None:
            self.transformer = self.unet = denoiser
            self.components = {"transformer": denoiser}
            self.text_encoder = self.text_encoder_2 = None

    warnings, logger = DiffusersWarnings(), logging.getLogger("diffusers")
    # the warning is read whatever level an earlier test in this worker left diffusers at (a guard: a
    # seed-8484 full run missed it for 11 architectures; the cause was not found)
    level = logger.level
    logger.addHandler(warnings)
    logger.setLevel(logging.WARNING)
    try:
        Host(model).load_lora_weights(str(path))
    except Exception:
        return "refuses", set()
    finally:
        logger.removeHandler(warnings)
        logger.setLevel(level)
    injected = {k.split(".lora_A.")[0] for k in model.state_dict() if ".lora_A." in k}
    if not injected:
        assert any("No LoRA keys" in m for m in warnings.messages), warnings.messages
    return ("loads" if injected else "ignores"), injected


DIFFUSERS_SAMPLE = [
    "wan", "qwen_image", "sd3", "z_image", "framepack", "ltx_video",
    pytest.param("hunyuan_video", marks=pytest.mark.slow), pytest.param("hidream", marks=pytest.mark.slow),
    pytest.param("kandinsky5", marks=pytest.mark.slow), pytest.param("lumina2", marks=pytest.mark.slow),
    pytest.param("flux2", marks=pytest.mark.slow), pytest.param("sdxl", marks=pytest.mark.slow),
    pytest.param("ltx2", marks=pytest.mark.slow), pytest.param("flux", marks=pytest.mark.slow),
    pytest.param("krea2", marks=pytest.mark.slow), pytest.param("aura_flow", marks=pytest.mark.slow),
    pytest.param("ernie_image", marks=pytest.mark.slow),
    pytest.param("ideogram4", marks=pytest.mark.slow), pytest.param("minimax_h3", marks=pytest.mark.slow),
]  # fmt: skip


@pytest.mark.parametrize("arch", DIFFUSERS_SAMPLE)
def test_diffusers_reads_each_layout_as_the_table_says(fixtures, arch, tmp_path):
    record = ARCHITECTURES[arch]
    paths = fixtures(arch)
    for layout in LAYOUTS:
        model = _model(arch, paths)
        names = _save(arch, model, tmp_path / f"{layout}.safetensors", layout)
        expected = record.diffusers_reads[layout]
        if record.folder in ("flux", "chroma") and layout in ("kohya", "musubi"):
            continue  # its FLUX.1 converter hard-codes the release's width: test_diffusers_interop's real-width case
        outcome, injected = diffusers_outcome(
            record.diffusers_loader, model, tmp_path / f"{layout}.safetensors"
        )
        assert outcome == expected.split(":")[0], (layout, outcome)
        if outcome == "loads":
            drops = dict(record.diffusers_drops).get(layout)
            assert injected == {n for n in names if not (drops and drops in n)}, layout


# ---------------------------------------------------------------------------------------------------
# The commands
# ---------------------------------------------------------------------------------------------------


def _file(path, arch: str, layout: str, modules=None) -> None:
    modules = modules if modules is not None else export_stems(arch, layout)[0]
    state = {f"{stem}.{suffix}": t for stem, w in modules.items() for suffix, t in
             {"lora_down.weight" if layout in ("kohya", "musubi") else "lora_A.weight": w.tensors["down"],
              "lora_up.weight" if layout in ("kohya", "musubi") else "lora_B.weight": w.tensors["up"]}.items()}  # fmt: skip
    save_safetensors(state, path, metadata={"tuner.architecture": arch})


def test_lora_info_names_the_tools_and_what_they_drop(capsys, tmp_path):
    path = tmp_path / "musubi.safetensors"
    _file(path, "hunyuan_video", "musubi")
    code, out = run(capsys, "lora", "info", path)
    assert code == 0
    assert "loads in" in out and "musubi-tuner: loads" in out
    assert "ComfyUI: partial (4 of 10 ignored), e.g. lora_unet_double_blocks_0_img_mlp_fc1" in out, out
    assert "diffusers: refused" in out


def test_lora_convert_warns_when_its_tool_would_drop_modules(capsys, tmp_path):
    """A column-wise DoRA of HunyuanVideo's q/k/v is written apart under diffusers' names, which ComfyUI's
    HunyuanVideo model does not map: converting it to kohya (for ComfyUI) says so."""
    g = torch.Generator().manual_seed(0)
    names = [f"transformer_blocks.0.attn.{p}" for p in ("to_q", "to_k", "to_v")]
    modules = {n: ModuleWeights(LORA, {"down": torch.randn(2, 8, generator=g), "up": torch.randn(8, 2, generator=g)},
                                2.0, torch.rand(1, 8, generator=g) + 0.5) for n in names}  # fmt: skip
    state, metadata = layout_state(modules, "comfy", ARCHITECTURES["hunyuan_video"].key_table())
    save_safetensors(
        state, tmp_path / "dora.safetensors", metadata={**metadata, "tuner.architecture": "hunyuan_video"}
    )
    code, out = run(
        capsys, "lora", "convert", tmp_path / "dora.safetensors", tmp_path / "k.safetensors", "--to", "kohya"
    )
    assert code == 0
    assert "warning: ComfyUI would load this kohya file without 3 of its modules" in out, out
    assert "lora_transformer_transformer_blocks_0_attn_to_q" in out
    # a file ComfyUI loads whole converts without a word
    _file(tmp_path / "comfy.safetensors", "wan", "comfy")
    code, out = run(
        capsys, "lora", "convert", tmp_path / "comfy.safetensors", tmp_path / "w.safetensors", "--to", "kohya"
    )
    assert code == 0 and "warning" not in out
    assert parse_modules(load_file(tmp_path / "w.safetensors"), {}, "w")
