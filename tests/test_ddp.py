"""Two processes on the CPU (gloo): data is sharded, gradients are averaged, weights stay identical."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from project import make_project
from tuner.cli import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(workdir: Path, runs: list[dict], processes: int = 2, timeout: int = 600) -> None:
    """Train `runs` (see tests/ddp_worker.py) in `processes` CPU processes under torchrun."""
    spec = workdir / "runs.json"
    spec.write_text(json.dumps(runs))
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).parent / "torchrun"
    worker = Path(__file__).parent / "ddp_worker.py"
    cmd = [str(torchrun), "--nproc_per_node", str(processes), "--master_port", str(_free_port()), str(worker),
           str(spec)]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
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
