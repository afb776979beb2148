"""Two processes on the CPU (gloo): data is sharded, gradients are averaged, weights stay identical."""

import json
import os
from pathlib import Path

import pytest
import torch

from launch import launch as launch_ranks
from project import make_project
from tuner.cli import main


def launch(workdir: Path, runs: list[dict], processes: int = 2, timeout: int = 600) -> None:
    """Train `runs` (see tests/ddp_worker.py) in `processes` CPU processes (tests/launch.py)."""
    spec = workdir / "runs.json"
    spec.write_text(json.dumps(runs))
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).parent / "ddp_worker.py"
    result = launch_ranks([str(worker), str(spec)], processes, env, timeout)
    assert result.returncode == 0, result.stderr[-3000:]


def rank_weights(out: Path) -> tuple[dict, dict]:
    return torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")


@pytest.mark.slow
def test_two_processes_train_in_sync(tmp_path, wan_model):
    config = make_project(tmp_path / "p", wan_model)
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    out = tmp_path / "out"
    launch(tmp_path, [{"config": str(config), "out": str(out), "overrides": ["train.max_steps=3"]}])
    a, b = rank_weights(out)
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), f"ranks diverged at {key}: gradients are not synchronized"
    # the two ranks trained on different batches (their losses differ), yet ended with equal weights
    h0, h1 = torch.load(out / "history0.pt"), torch.load(out / "history1.pt")
    assert h0 != h1
    assert (out / "demo_lora.safetensors").is_file()
    # the final state holds each process's random generators and checks out against its manifest
    from tuner.trainers.state import verify

    (final_state,) = (out / "state").iterdir()
    verify(final_state)
    assert {p.name for p in final_state.glob("rng_*.json")} == {"rng_0.json", "rng_1.json"}
