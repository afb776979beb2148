"""`make demo` runs `python -m tuner.demo`: keep it working end to end, for every registered architecture.

Per architecture the demo runs in its contract group's process, on what conftest.py's `contract` built
there: the fixture (the same `write_fixture` and seed, passed as `--model`) and the cache it filled with
the demo's own dataset and settings (copied in first). Every CLI step runs for real: cache latents and
cache text find every entry cached (the encoding itself ran in `contract`, through the same commands),
train, and generate with the LoRA. `make demo` as typed, which writes its own fixture and encodes its
cache, runs once (Wan, the default architecture).
"""

import shutil

import pytest

from tuner.demo import data_kinds, main


def _check_outputs(out, architecture: str, capsys) -> str:
    """What the demo printed, once the files it reports are checked."""
    printed = capsys.readouterr().out
    assert "Where everything is" in printed
    sample = "demo.mp4" if data_kinds(architecture)[0] else "demo.png"
    for name in ("output/demo_lora.safetensors", f"samples/{sample}", "cache/index.sqlite", "train.toml"):
        assert (out / name).is_file(), name
    return printed


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys, contract):
    architecture, config, _ = contract
    model = config.parent.parent / "model"  # `contract` writes the fixture beside its project
    shutil.copytree(config.parent / "cache", tmp_path / "cache")
    argv = ["--out", str(tmp_path), "--steps", "3", "--architecture", architecture, "--model", str(model)]
    assert main(argv) == 0
    printed = _check_outputs(tmp_path, architecture, capsys)
    # the demo's data and settings are the contract project's (tests/project.py): nothing left to encode
    assert printed.count("encoded 0, reused") == 2, printed
    assert not (tmp_path / "model").exists()


@pytest.mark.slow
def test_make_demo_writes_its_own_fixture(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--steps", "3"]) == 0
    printed = _check_outputs(tmp_path, "wan", capsys)
    assert "encoded 0," not in printed
    assert any((tmp_path / "model").iterdir())


def test_a_model_folder_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"--model .*missing: no such folder; give the folder a fixture"):
        main(["--out", str(tmp_path / "out"), "--model", str(tmp_path / "missing")])
    assert not (tmp_path / "out").exists()
