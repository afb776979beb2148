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

from project import make_cached_project
from test_ddp import _free_port
from tuner.fixtures import write_fixture
from tuner.offload.shared import PREFIX, SHM

ROOT = Path(__file__).resolve().parent.parent


def train_two(config: Path, out: Path, share: bool, *overrides: str) -> tuple[list[dict], list[dict], str]:
    """Train `config` in two processes; each rank's weights and memory report, and the run's output."""
    out.mkdir()
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).parent / "torchrun"
    worker = Path(__file__).parent / "shared_swap_worker.py"
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(_free_port()), str(worker), str(config),
           str(out), "true" if share else "false", *overrides]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    weights = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    reports = [json.loads((out / f"memory{r}.json").read_text()) for r in (0, 1)]
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
    private, private_reports, _ = train_two(config, tmp_path / "private", False, *overrides)
    shared, reports, output = train_two(config, tmp_path / "shared", True, *overrides)

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
