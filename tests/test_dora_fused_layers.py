"""DoRA on fused layers: every architecture whose export fuses layers saves a DoRA ComfyUI loads, or
refuses `network.dora` before step 1 (`Architecture.dora_refused`), so a new family must decide.

tuner's DoRA is column-wise, so on the parts of a fused layer (FLUX's `img_attn.qkv`) it has no fused
form and each part is written apart under its diffusers name (`formats.part_stem`): `transformer.<name>`
in comfy files, `lora_transformer_<name with "_">` in kohya files. ComfyUI 0.8's `comfy/lora.py`
(`model_lora_keys_unet`) maps diffusers names onto row slices of a fused weight, written here as data:

- its `Flux` class (FLUX.1, Kontext, and its subclasses `Chroma`, `Flux2`): `transformer.` and
  `lora_transformer_` names from `comfy.utils.flux_to_diffusers`;
- `SD3`: `transformer.` and `lora_transformer_` from `mmdit_to_diffusers` (attn2 included);
- `Lumina2` (Lumina 2 and Z-Image): `transformer.` / `diffusion_model.` names from `z_image_to_diffusers`,
  which spells Z-Image's `attention.to_q` in equal thirds (not Lumina 2's `attn.to_q`, whose k and v are
  smaller), and no `lora_transformer_`;
- `HunyuanVideo` (FramePack, FramePack-F1, HunyuanVideo 1.5) and HunyuanImage 2.1: Tencent's names only, no
  diffusers name;
- Ideogram 4 and MiniMax H3: the release's names only (its map taken as the generic rule); Qwen-Image 2.1:
  no ComfyUI map known, so none.
"""

import pytest
import torch

from project import make_project, run
from tuner.networks.delta import LORA, ModuleWeights
from tuner.networks.formats import layout_state
from tuner.registry import ARCHITECTURES, resolve_save_format

# architecture -> the diffusers-name stems ComfyUI maps onto fused rows for it ("" : none)
COMFY_PART_PREFIXES = {
    "flux": ("transformer.", "lora_transformer_"),
    "flux_kontext": ("transformer.", "lora_transformer_"),
    "chroma": ("transformer.", "lora_transformer_"),
    "flux2": ("transformer.", "lora_transformer_"),
    "flux2_klein": ("transformer.", "lora_transformer_"),
    "sd3": ("transformer.", "lora_transformer_"),
    "z_image": ("transformer.", "diffusion_model."),
    "lumina2": (),  # Z-Image's spelling of the parts, not Lumina 2's
    "hunyuan_video": (),
    "framepack": (),
    "framepack_1f": (),
    "hunyuan_video15": (),
    "hunyuan_video15_i2v": (),
    "framepack_f1": (),
    "hunyuan_image": (),  # its own model class (not HunyuanVideo's); the same Tencent-only key map
    "ideogram4": (),  # the generic `diffusion_model.` rule assumed (ComfyUI's Ideogram 4 map not confirmed)
    "minimax_h3": (),  # its fused `attn.qkv_proj`: the release's names only (ComfyUI's map not confirmed)
    "qwen_image_21": (),  # its fused `img_mlp.gate_up`: no ComfyUI map for the model known
}
FUSED = [name for name, record in ARCHITECTURES.items() if record.key_table().fused]


def _dora_part_stems(name: str) -> set[str]:
    """The stems of the default-layout file of a column-wise DoRA on the parts of one fused layer."""
    record = ARCHITECTURES[name]
    layer = record.key_table().fused[0]
    parts = [p.replace("{i}", "0") for p in layer.parts]
    modules = {p: ModuleWeights(LORA, {"down": torch.ones(2, 8), "up": torch.ones(8, 2)}, 2.0, torch.ones(1, 8))
               for p in parts}  # fmt: skip
    state, _ = layout_state(modules, resolve_save_format(name, "auto", dora=True), record.key_table())
    return {key.rsplit(".", 2)[0] if key.endswith(".weight") else key.rsplit(".", 1)[0] for key in state}


def test_every_architecture_with_fused_layers_is_decided():
    assert sorted(FUSED) == sorted(COMFY_PART_PREFIXES)


@pytest.mark.parametrize("name", FUSED)
def test_dora_is_refused_where_comfyui_would_not_load_the_parts(name):
    stems = _dora_part_stems(name)
    loads = (
        all(stem.startswith(COMFY_PART_PREFIXES[name]) for stem in stems)
        if COMFY_PART_PREFIXES[name]
        else False
    )
    assert bool(ARCHITECTURES[name].dora_refused) == (not loads), (name, sorted(stems))


@pytest.mark.parametrize("name", [n for n in FUSED if ARCHITECTURES[n].dora_refused])
def test_tuner_check_names_the_reason(name, tmp_path, capsys):
    config = make_project(tmp_path / "project", tmp_path / "model", architecture=name)
    code, out = run(capsys, "check", "--config", config, "--set", "network.dora=true")
    assert code == 2 and "network.dora" in out and ARCHITECTURES[name].dora_refused in out, out
