"""Caching with two processes (tests/launch.py, gloo on the CPU) writes what one process writes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from cli_runs_worker import outputs
from launch import launch
from project import make_project, run, summary
from tuner.cache.store import CacheStore

WORKER = Path(__file__).parent / "cli_runs_worker.py"


@pytest.mark.slow
def test_two_processes_cache_the_same_entries_as_one(tmp_path, wan_model, capsys):
    one = make_project(tmp_path / "one", wan_model)
    two = tmp_path / "two"
    shutil.copytree(one.parent, two)
    kinds = ("latents", "text")
    expected = []
    for kind in kinds:
        code, out = run(capsys, "cache", kind, "--config", one, "--batch-size", "1")
        assert code == 0, out
        expected.append(summary(out))
    # one launch of two processes: each kind, then latents again
    commands = [["cache", kind, "--config", str(two / one.name), "--batch-size", "1"] for kind in kinds]
    commands.append(["cache", "latents", "--config", str(two / one.name)])
    result = launch([str(WORKER), *map(json.dumps, commands)],
                    env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    *cached, again = outputs(result.stdout, len(commands))
    for want, out in zip(expected, cached):
        assert out.count("encoded ") == 1, out  # one summary, from process 0, counting both processes' work
        assert summary(out) == want
    want, got = CacheStore(one.parent / "cache", readonly=True), CacheStore(two / "cache", readonly=True)
    assert sorted(got.keys()) == sorted(want.keys()) and len(want.keys()) > 4
    for key in want.keys():
        a, b = want.get(key), got.get(key)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), want.describe(key)
    # each process wrote shards of its own, into one index
    assert len(list((two / "cache" / "shards").glob("*.safetensors"))) >= 4  # 2 kinds × 2 processes
    # a second run with two processes finds everything cached
    assert summary(again)[0] == 0, again
