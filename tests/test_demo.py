"""`make demo` runs `python -m tuner.demo`: keep it working end to end."""

import pytest

from tuner.demo import main


@pytest.mark.slow
@pytest.mark.parametrize(
    "architecture, sample",
    [("wan", "demo.mp4"), ("flux", "demo.png"), ("flux_kontext", "demo.png"), ("qwen_image", "demo.png"),
     ("qwen_image_edit", "demo.png")],
)  # fmt: skip
def test_demo_runs_end_to_end(tmp_path, capsys, architecture, sample):
    assert main(["--out", str(tmp_path), "--steps", "3", "--architecture", architecture]) == 0
    out = capsys.readouterr().out
    assert "Where everything is" in out
    for name in ("output/demo_lora.safetensors", f"samples/{sample}", "cache/index.sqlite", "train.toml"):
        assert (tmp_path / name).is_file(), name
