"""`make demo` runs `python -m tuner.demo`: keep it working end to end, for every registered architecture."""

import pytest

from tuner.demo import data_kinds, main
from tuner.registry import ARCHITECTURES


@pytest.mark.slow
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_demo_runs_end_to_end(tmp_path, capsys, architecture):
    assert main(["--out", str(tmp_path), "--steps", "3", "--architecture", architecture]) == 0
    out = capsys.readouterr().out
    assert "Where everything is" in out
    sample = "demo.mp4" if data_kinds(architecture)[0] else "demo.png"
    for name in ("output/demo_lora.safetensors", f"samples/{sample}", "cache/index.sqlite", "train.toml"):
        assert (tmp_path / name).is_file(), name
