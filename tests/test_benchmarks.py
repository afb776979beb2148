"""Every benchmark runs in its smoke mode (tiny sizes, CPU) and prints its ratio lines.

These check that the scripts work and that what they print parses as finite positive numbers; they
assert nothing about speed (a ratio measured on a busy 2-core CI machine says nothing)."""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Import a benchmark script as a module (its directory on sys.path, as when run as a script).
    Toy sizes run on one thread: on a shared 2-core machine more threads only wait for each other."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield importlib.import_module
    torch.set_num_threads(threads)


def ratios(out: str, label: str) -> list[float]:
    """The numbers after `label` on every line that has it; each must be finite and positive."""
    found = [float(m) for m in re.findall(rf"{label}\s+([-+0-9.eEinfa]+)", out)]
    assert found, f"no {label!r} line in:\n{out}"
    assert all(math.isfinite(r) and r > 0 for r in found), found
    return found


@pytest.mark.slow
def test_train_overhead_smoke(bench, capsys):
    result = bench("train_overhead").main(
        ["--steps", "3", "--warmup", "1", "--rounds", "1", "--dim", "64", "--layers", "1", "--threads", "1"]
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


# --- GPU benchmarks: smoke mode on the CPU ----------------------------------------------------------


@pytest.mark.slow
def test_gpu_memory_smoke_checks_the_switches(bench, capsys, tmp_path):
    table = tmp_path / "memory.md"
    argv = ["--tiny", "--steps", "1", "--swap", "0", "all", "--checkpointing", "none", "offload"]
    rows = bench("gpu_memory").main([*argv, "--markdown", str(table)])
    out = capsys.readouterr().out
    assert len(rows) == 2 * 2 * 2 and "NOT GPU measurements" in out
    for row in rows:
        assert 0 < row["placement_bytes"] <= row["peak_bytes"] < float("inf")
        assert math.isfinite(row["seconds_per_step"]) and row["seconds_per_step"] > 0
    by = {(r["blocks_to_swap"], r["fp8"], r["checkpointing"]): r["peak_bytes"] for r in rows}
    assert by[8, True, "none"] < by[8, False, "none"] < by[0, False, "none"]  # swap and fp8 save weights
    assert re.search(r"Check: .*: (\d+) of \1 pairs .* agree", out)
    assert table.read_text().count("| tiny |") == 8 and "Check:" in table.read_text()


def test_gpu_memory_check_names_a_switch_that_does_not_save(bench):
    check_savings = bench("gpu_memory").check_savings
    row = {"model": "m", "blocks_to_swap": 0, "fp8": False, "checkpointing": "plain", "peak_bytes": 10}
    rows = [
        row,
        {**row, "fp8": True, "peak_bytes": 10},  # fp8 saved nothing
        {**row, "blocks_to_swap": 4, "peak_bytes": 5},
        {**row, "checkpointing": "offload", "peak_bytes": float("inf")},  # did not fit: worse
    ]
    checked, failures = check_savings(rows, ("blocks_to_swap", "fp8", "checkpointing"))
    assert checked == 3 and len(failures) == 2
    assert failures[0].startswith("fp8 False → True")
    assert failures[1].startswith("checkpointing plain → offload")
    assert check_savings(rows, ("blocks_to_swap",)) == (1, [])


def test_gpu_memory_rows_never_write_the_shared_host_weights(bench):
    memory = bench("gpu_memory")
    wan = memory.WanBench(memory.TINY, tiny=True)
    before = {name: t.clone() for name, t in wan.host.items()}
    wan.run(swap=8, fp8_base=True, checkpointing="offload", steps=1)
    wan.run(swap=0, steps=1)
    assert all(torch.equal(before[name], t) for name, t in wan.host.items())
