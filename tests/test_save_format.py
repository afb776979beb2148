"""`save.format = "auto"` (the default): per architecture, the layout both ComfyUI and diffusers load.

"auto" is resolved when the config is read, so `tuner check` and `tuner train` see the same layout and
refuse the same combinations. That each architecture's auto layout really loads in diffusers with the
same output is shown in `test_diffusers_interop.py` (Wan, FLUX.1) and `test_qwen_image_models.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from project import run
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
