"""Two processes on the CPU (gloo) swapping the same blocks share one host copy of them (one per expert
for Wan 2.2), and train exactly as with a copy each; and the benchmark that measures it runs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import launch
from project import make_cached_project
from tuner.fixtures import write_fixture
from tuner.offload.shared import PREFIX, SHM

ROOT = Path(__file__).resolve().parent.parent


def train_two(config: Path, out: Path, *overrides: str) -> tuple[dict, dict, str]:
    """Train `config` in two processes, with a host copy each and then sharing one (one launch, see
    tests/shared_swap_worker.py); by "private" and "shared": each rank's weights and memory report; and
    the two runs' output."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).parent / "shared_swap_worker.py"
    result = launch([str(worker), str(config), str(out), *overrides], env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = ("private", "shared")
    weights = {run: [torch.load(out / run / f"rank{r}.pt") for r in (0, 1)] for run in runs}
    reports = {run: [json.loads((out / run / f"memory{r}.json").read_text()) for r in (0, 1)] for run in runs}
    return weights, reports, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [("wan", ()), ("wan22_t2v", ("model.expert='both'", "model.boundary=0.5", "memory.fp8_base=true"))],
    ids=["wan", "wan22-both-experts-fp8"],
)
def test_two_processes_share_one_host_copy_and_train_the_same(tmp_path, architecture, overrides):
    write_fixture(architecture, tmp_path / "model")
    config = make_cached_project(tmp_path / "p", tmp_path / "model", architecture=architecture)
    before = set(SHM.glob(PREFIX + "*"))
    weights, reports, output = train_two(config, tmp_path / "out", *overrides)
    (private, shared), (private_reports, reports) = weights.values(), reports.values()

    for rank in (0, 1):
        assert private[rank].keys() == shared[rank].keys() and shared[rank]
        for key in shared[rank]:
            assert torch.equal(shared[rank][key], private[rank][key]), f"rank {rank} differs at {key}"
    assert all(r["segments"] == [] for r in private_reports)
    # both processes map the same files (one per transformer, by inode), unlinked once both had them, and
    # each process is charged half of each: its proportional set size is 1/2 of the copy's
    swapped = reports[0]["swapped_bytes"]
    a, b = (sorted(r["segments"], key=lambda m: m["inode"]) for r in reports)
    assert len(a) == len(b) == len(swapped) == (2 if architecture == "wan22_t2v" else 1)
    assert {m["size"] - n for m, n in zip(a, sorted(swapped))} <= set(
        range(0, 3 * 4096)
    )  # + header, alignment
    for x, y in zip(a, b):
        assert x["inode"] == y["inode"] and x["path"] == y["path"] and x["path"].endswith("(deleted)")
        for m in (x, y):
            assert m["rss"] == m["size"] and abs(2 * m["pss"] - m["rss"]) <= 4096
    assert output.count("host copy shared by 2 processes") == len(swapped)
    assert set(SHM.glob(PREFIX + "*")) == before  # nothing left in /dev/shm
    print(f"{architecture}: swapped weights {swapped} bytes; per segment Rss / Pss per process: "
          f"{[(x['rss'], x['pss'], y['pss']) for x, y in zip(a, b)]}")  # fmt: skip


@pytest.mark.slow
def test_benchmark_smoke():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "shared_swap.py"), "--blocks", "2", "--block-mib", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"\| a copy each \| 2 \| 2\.0 MiB \|", result.stdout)
    assert re.search(r"\| shared \| 2 \| 2\.0 MiB \|", result.stdout)
    assert re.search(r"ratio [0-9.]+ \(1/2 = 0\.500\)", result.stdout)
