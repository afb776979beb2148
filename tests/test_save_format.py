"""`save.format = "auto"` (the default): per architecture, the layout both ComfyUI and diffusers load.

"auto" is resolved when the config is read, so `tuner check` and `tuner train` see the same layout and
refuse the same combinations. That each architecture's auto layout really loads in diffusers with the
same output is shown in `test_diffusers_interop.py` (Wan, FLUX.1) and `test_qwen_image_models.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from project import make_project, run
from tuner.config import load_config
from tuner.errors import ConfigError
from tuner.registry import ARCHITECTURES, SAVE_LAYOUTS, resolve_save_format


def write_config(root: Path, architecture: str, extra: str = "") -> Path:
    (root / "imgs").mkdir(parents=True, exist_ok=True)
    (root / "dataset.toml").write_text('[[datasets]]\nimage_directory = "imgs"\n')
    path = root / "train.toml"
    path.write_text(
        f'[model]\narchitecture = "{architecture}"\ntransformer = "model.safetensors"\n'
        f'[data]\ndataset_config = "dataset.toml"\n{extra}'
    )
    return path


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_auto_is_the_records_layout_and_a_layout_stands_for_itself(name, tmp_path):
    assert load_config(write_config(tmp_path, name)).save.format == ARCHITECTURES[name].save_format
    for layout in SAVE_LAYOUTS:
        cfg = load_config(write_config(tmp_path, name, f'[save]\nformat = "{layout}"\n'))
        assert cfg.save.format == layout == resolve_save_format(name, layout)


def test_resolving_names_what_is_wrong():
    assert resolve_save_format("flux_kontext", "auto") == "kohya"
    with pytest.raises(ConfigError, match="unknown adapter format 'peft'.*auto, comfy"):
        resolve_save_format("wan", "peft")
    with pytest.raises(ConfigError, match="Did you mean 'flux'"):
        resolve_save_format("flx", "auto")


def test_check_accepts_flux_dora_in_auto_and_refuses_it_in_diffusers(tmp_path, capsys):
    """tuner's DoRA is per column: the diffusers (PEFT) layout cannot hold it; FLUX's auto layout can."""
    ok = write_config(tmp_path / "ok", "flux", "[network]\ndora = true\n")
    code, out = run(capsys, "check", "--config", ok)
    assert code == 0 and "ok" in out
    bad = write_config(tmp_path / "bad", "flux", '[network]\ndora = true\n[save]\nformat = "diffusers"\n')
    code, out = run(capsys, "check", "--config", bad)
    assert code == 2 and "network.dora = true cannot be saved with save.format = 'diffusers'" in out


@pytest.mark.slow
def test_a_flux_dora_run_saves_its_adapter_and_state(tmp_path, capsys):
    """A FLUX.1 DoRA run used to train to its last step and then write nothing (the fused layers)."""
    from tuner.fixtures import write_fixture

    write_fixture("flux", tmp_path / "model")
    config = make_project(tmp_path / "project", tmp_path / "model", steps=2, architecture="flux")
    for what in ("latents", "text"):
        assert run(capsys, "cache", what, "--config", config)[0] == 0
    code, log = run(capsys, "train", "--config", config, "--set", "network.dora=true",
                    "--set", "log.tensorboard=false")  # fmt: skip
    assert code == 0, log
    out = config.parent / "output"
    adapter = load_file(out / "demo_lora.safetensors")
    assert any(k.endswith(".dora_scale") for k in adapter)
    assert any(k.startswith("lora_unet_") for k in adapter)  # FLUX's auto layout: kohya
    assert (out / "state" / "step000002" / "position.json").is_file()
