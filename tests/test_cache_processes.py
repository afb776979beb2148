"""Caching with two processes (tests/launch.py, gloo on the CPU) writes what one process writes."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from launch import launch
from project import make_project, run, summary
from tuner.cache.store import CacheStore


def _two_processes(*argv: str) -> subprocess.CompletedProcess:
    return launch(["-m", "tuner", *argv], env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                  timeout=300)  # fmt: skip


@pytest.mark.slow
def test_two_processes_cache_the_same_entries_as_one(tmp_path, wan_model, capsys):
    one = make_project(tmp_path / "one", wan_model)
    two = tmp_path / "two"
    shutil.copytree(one.parent, two)
    for kind in ("latents", "text"):
        code, out = run(capsys, "cache", kind, "--config", one, "--batch-size", "1")
        assert code == 0, out
        result = _two_processes("cache", kind, "--config", str(two / one.name), "--batch-size", "1")
        assert result.returncode == 0, result.stderr[-3000:]
        # one summary, from process 0, counting both processes' work
        assert result.stdout.count("encoded ") == 1
        assert summary(result.stdout) == summary(out)
    want, got = CacheStore(one.parent / "cache", readonly=True), CacheStore(two / "cache", readonly=True)
    assert sorted(got.keys()) == sorted(want.keys()) and len(want.keys()) > 4
    for key in want.keys():
        a, b = want.get(key), got.get(key)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), want.describe(key)
    # each process wrote shards of its own, into one index
    assert len(list((two / "cache" / "shards").glob("*.safetensors"))) >= 4  # 2 kinds × 2 processes
    # a second run with two processes finds everything cached
    result = _two_processes("cache", "latents", "--config", str(two / one.name))
    assert result.returncode == 0 and summary(result.stdout)[0] == 0, result.stderr[-2000:]
