"""Every benchmark runs in its smoke mode (tiny sizes, CPU) and prints its ratio lines.

These check that the scripts work and that what they print parses as finite positive numbers; they
assert nothing about speed (a ratio measured on a busy 2-core CI machine says nothing)."""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Import a benchmark script as a module (its directory on sys.path, as when run as a script)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


def ratios(out: str, label: str) -> list[float]:
    """The numbers after `label` on every line that has it; each must be finite and positive."""
    found = [float(m) for m in re.findall(rf"{label}\s+([-+0-9.eEinfa]+)", out)]
    assert found, f"no {label!r} line in:\n{out}"
    assert all(math.isfinite(r) and r > 0 for r in found), found
    return found


@pytest.mark.slow
def test_train_overhead_smoke(bench, capsys):
    result = bench("train_overhead").main(
        ["--steps", "3", "--warmup", "1", "--rounds", "1", "--dim", "64", "--layers", "1"]
    )
    out = capsys.readouterr().out
    assert ratios(out, "ratio") == [pytest.approx(result["ratio"], abs=1e-3)]
    assert re.search(r"bare loop\s+\d+\.\d+ ms/step", out)
    assert re.search(r"tuner train\s+\d+\.\d+ ms/step", out)
    assert "device cpu" in out


def test_cache_read_smoke(bench, capsys, tmp_path):
    argv = ["--n", "24", "--workers", "2", "--shape", "4,2,8,8", "--rounds", "1", "--dir", str(tmp_path)]
    bench("cache_read").main(argv)
    out = capsys.readouterr().out
    assert re.search(r"in-process .* ratio [0-9.]+x", out) and re.search(r"2 workers .* ratio [0-9.]+x", out)
    assert len(ratios(out, "ratio")) == 2
    assert list(tmp_path.iterdir()) == []  # it deletes what it wrote
