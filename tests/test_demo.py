"""`make demo` runs `python -m tuner.demo`: keep it working end to end."""

import pytest

from tuner.demo import main


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "Where everything is" in out
    for name in ("output/demo_lora.safetensors", "samples/demo.mp4", "cache/index.sqlite", "train.toml"):
        assert (tmp_path / name).is_file(), name
