"""Shared helpers for end-to-end tests: a tiny Wan project (fixture, dataset, TOMLs) in a folder."""

from __future__ import annotations

import re
from pathlib import Path

from tuner.cli import main as tuner
from tuner.config import load_config
from tuner.demo import prepare


def make_project(
    root: Path, model: Path, steps: int = 4, architecture: str = "wan", **train_overrides
) -> Path:
    """Write the demo project under `root` using the fixture at `model`; return the config path."""
    config = prepare(root, steps=steps, model=model, architecture=architecture)
    text = config.read_text()
    for key, value in train_overrides.items():
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    config.write_text(text)
    return config


def run(capsys, *argv: str) -> tuple[int, str]:
    """Run the tuner CLI; return (exit code, stdout + stderr)."""
    capsys.readouterr()
    code = tuner([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def summary(output: str) -> tuple[int, int, int]:
    m = re.search(r"encoded (\d+), reused (\d+), pruned (\d+)", output)
    assert m, output
    return tuple(int(g) for g in m.groups())


def cfg(config: Path, *overrides: str):
    return load_config(config, list(overrides))
