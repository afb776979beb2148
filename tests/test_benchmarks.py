"""Every benchmark runs in its smoke mode (tiny sizes, CPU) and prints its ratio lines.

These check that the scripts work and that what they print parses as finite positive numbers; they
assert nothing about speed (a ratio measured on a busy 2-core CI machine says nothing)."""

from __future__ import annotations

import importlib
import math
import re
import shlex
import subprocess
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


@pytest.mark.slow
def test_optimizers_smoke(bench, capsys):
    bench("optimizers").main(["--steps", "2", "--tail", "1", "--only", "adamw", "adamw8bitkahan"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    assert [r[1].strip() for r in rows] == ["`adamw`", "`adamw8bitkahan`"]
    assert [float(r[3]) for r in rows] == [8.0, pytest.approx(2.0, abs=0.05)]  # fp32 weights: no compensation
    assert all(math.isfinite(float(r[4])) for r in rows)


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


@pytest.mark.slow
def test_gpu_speed_smoke(bench, capsys, tmp_path):
    result = bench("gpu_speed").main(["--tiny", "--steps", "1", "--markdown-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert len(ratios(out, "ratio")) == len(result) >= 2 + 1 + 4  # swap ×2, fp8 matmul, ≥2 backends × 2
    assert "swap 4 of 8 blocks ÷ none" in result and "fp8 matmul on ÷ off" in result
    assert result["sdpa training step ÷ sdpa"] == 1.0 and "sdpa_math forward ÷ sdpa" in result
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention.md", "fp8_matmul.md", "swap.md"]
    assert all("NOT GPU measurements" in p.read_text() for p in tmp_path.iterdir())


# --- the suite --------------------------------------------------------------------------------------

SUITE = BENCHMARKS / "gpu_suite.sh"
DOC = BENCHMARKS.parent / "docs" / "memory.md"


def suite_phases() -> dict[str, list[str]]:
    """{phase: its python arguments} as gpu_suite.sh runs them."""
    text = SUITE.read_text().replace("\\\n", " ")
    phases = re.findall(r"^phase (\S+) \d+ (.+)$", text, flags=re.MULTILINE)
    return {name: shlex.split(args) for name, args in phases}


def test_suite_time_limits_fit_eight_minutes():
    limits = [int(n) for n in re.findall(r"^phase \S+ (\d+) ", SUITE.read_text(), flags=re.MULTILINE)]
    assert len(limits) == 6 and sum(limits) <= 450  # leaves time for start-up, kill grace and the report


def test_suite_is_valid_bash_and_fills_every_doc_section(bench):
    subprocess.run(["bash", "-n", str(SUITE)], check=True)
    phases = suite_phases()
    assert set(phases) == {"memory-1.3B", "memory-14B", "swap", "fp8_matmul", "attention", "train-overhead"}
    listed = re.search(r"for name in (.+); do", SUITE.read_text()).group(1).split()
    assert listed == list(phases)
    doc = DOC.read_text()
    for name in [*phases, "environment"]:
        assert f"<!-- gpu-suite:{name}:begin -->" in doc and f"<!-- gpu-suite:{name}:end -->" in doc


@pytest.mark.slow
def test_suite_arguments_parse_in_smoke_mode(bench, capsys, tmp_path):
    """The 14B rows the suite asks for, run on the toy (which has the same block-count words)."""
    argv = suite_phases()["memory-14B"]
    assert argv[0] == "benchmarks/gpu_memory.py"
    out = tmp_path / "memory-14B.md"
    args = [str(out) if a == "$RESULTS/memory-14B.md" else a for a in argv[1:]]
    rows = bench("gpu_memory").main([*args, "--tiny"])
    assert [(r["blocks_to_swap"], r["fp8"], r["checkpointing"]) for r in rows][-1] == (8, True, "offload")
    assert out.is_file()


def test_report_replaces_sections_and_reruns_replace_them(bench, tmp_path):
    report = bench("report")
    doc = tmp_path / "memory.md"
    doc.write_text(DOC.read_text())
    (tmp_path / "swap.md").write_text("| a |\n|---|\n| 1 |\n")
    (tmp_path / "fp8.md").write_text("| b |\n|---|\n| 2 |\n")
    argv = [str(doc), f"swap={tmp_path / 'swap.md'}", f"attention={tmp_path / 'missing.md'}"]
    argv += [f"fp8_matmul={tmp_path / 'fp8.md'}", "--note", "attention=Stopped at the suite's 65 s limit"]
    argv += ["--note", "fp8_matmul=Stopped at the suite's 40 s limit"]
    report.main(argv)
    once = doc.read_text()
    assert "<!-- gpu-suite:swap:begin -->\n| a |\n|---|\n| 1 |\n<!-- gpu-suite:swap:end -->" in once
    assert "**Not measured**: Stopped at the suite's 65 s limit." in once
    assert "limit; the rows below are those measured by then.**\n\n| b |" in once
    report.main(argv)
    assert doc.read_text() == once  # a rerun replaces, it does not append
    assert once.count("gpu-suite:") == DOC.read_text().count("gpu-suite:")
    report.main([str(doc), "--environment"])
    assert re.search(r"environment:begin -->\nMeasured \d{4}-\d\d-\d\d at commit \w+ on ", doc.read_text())


def test_test_time_prints_the_slowest_tests_and_the_total_per_architecture(
    bench, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # the inner run is not an xdist worker
    suite = tmp_path / "suite" / "test_tiny.py"
    suite.parent.mkdir()
    suite.write_text(
        "import pytest\n\n\n@pytest.mark.parametrize('contract', ['wan', 'flux'])\n"
        "def test_per_architecture(contract):\n    sum(range(10**6))\n\n\ndef test_other():\n    pass\n"
    )
    records = tmp_path / "records"
    argv = ["--records", str(records), "-q", "-p", "no:randomly", "-p", "no:cacheprovider", str(suite)]
    assert bench("test_time").main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"suite: \d+ s wall, \d+ CPU-s", out), out
    slowest = out.split("slowest 25 tests")[1].split("per architecture")[0]
    assert slowest.count("test_tiny.py::") == 3
    per_architecture = out.split("per architecture")[1].split("per file")[0]
    assert {line.split()[-1] for line in per_architecture.splitlines()[1:] if line.strip()} == {
        "wan", "flux", "(none)"
    }  # fmt: skip
    assert len((records / "main.jsonl").read_text().splitlines()) == 3
