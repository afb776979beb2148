"""`benchmarks/startup.py --smoke` keeps running and prints its ratios (no timing is judged here)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_startup_benchmark_smoke_prints_its_ratios():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    # its own process group: the benchmark starts interpreters of its own (train_overhead.py, tuner train),
    # and a timeout must end them too, not leave them running after the test
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "startup.py"), "--smoke"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        lines, err = process.communicate(timeout=1500)  # about 190 s on an idle 2-core machine
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 0, err[-3000:]
    for what in ("at step 1 of tuner train, \\[dev\\] install", "at step 1 of tuner train, user install",
                 "of a no-op tuner cache latents"):  # fmt: skip
        assert re.search(rf"\(a\) imports {what}.*: [0-9,]+ modules, .* ratio +[0-9.]+ ", lines), lines
    assert (
        len(re.findall(r"forced by importing diffusers\.\S+ .*\n +torch\._dynamo +[0-9.]+ s", lines)) == 2
    ), lines
    for what in ("no-op cache latents", "time to first step"):
        assert re.search(rf"\(b\) {what} .* -?[0-9.]+ s per 1,000 items", lines), lines
    # the ratio, or why train_overhead.py could not measure it
    assert re.search(r"\(c\) loop overhead, num_workers = \d+: .*(ratio +[0-9.]+|not measured)", lines), lines
