"""The `tuner` command itself: help, error reporting, small subcommands."""

import pytest
from PIL import Image

from project import make_project, run
from tuner.cli import build_parser


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for name in ("fixtures", "cache", "train", "generate", "timesteps", "check", "lora", "ui"):
        assert name in out


def test_user_errors_print_one_line_and_exit_2(tmp_path, capsys):
    code, out = run(capsys, "check", "--config", tmp_path / "missing.toml")
    assert code == 2 and out.startswith("error: ") and "missing.toml" in out and "Traceback" not in out


def test_check_and_timesteps_histogram(tmp_path, wan_model, capsys):
    config = make_project(tmp_path, wan_model)
    code, out = run(capsys, "check", "--config", config)
    assert code == 0 and "2 dataset(s)" in out
    png = tmp_path / "hist.png"
    code, out = run(
        capsys, "timesteps", "--config", config, "--set", "timesteps.mode=logit_normal", "--out", png
    )
    assert code == 0
    with Image.open(png) as img:
        assert img.width > 200 and img.height > 100
    code, out = run(
        capsys, "timesteps", "--config", config, "--set", "timesteps.mode=logit_norml", "--out", png
    )
    assert code == 2 and "Did you mean 'logit_normal'" in out


def test_timesteps_plots_every_mode(tmp_path, wan_model, capsys):
    from tuner.diffusion.timesteps import MODES

    config = make_project(tmp_path, wan_model)
    for mode in MODES:
        png = tmp_path / f"{mode}.png"
        code, out = run(capsys, "timesteps", "--config", config, "--set", f"timesteps.mode={mode}",
                        "--set", "timesteps.max_timestep=0.9", "--seq-len", "1024", "--out", png)  # fmt: skip
        assert code == 0, out
        with Image.open(png) as img:
            assert img.format == "PNG" and img.width > 200 and img.height > 100
            colors = dict((c, n) for n, c in img.convert("RGB").getcolors(maxcolors=100_000))
        assert colors.get((70, 120, 190), 0) > 1000, mode  # the histogram's bars are drawn


def test_fixtures_command_writes_both_layouts(tmp_path, capsys):
    code, out = run(capsys, "fixtures", "wan", tmp_path / "m")
    assert code == 0
    assert (tmp_path / "m" / "diffusers" / "model_index.json").is_file()
    assert (tmp_path / "m" / "single" / "wan2.1_t2v_tiny.safetensors").is_file()
    code, out = run(capsys, "fixtures", "nope", tmp_path / "n")
    assert code == 2 and "known:" in out.lower() and "wan" in out
