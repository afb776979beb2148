"""Two processes on the CPU (gloo): data is sharded, gradients are averaged, weights stay identical."""

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


@pytest.mark.slow
def test_two_processes_train_in_sync(tmp_path, wan_model):
    config = make_project(tmp_path / "p", wan_model)
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).parent / "torchrun"
    worker = Path(__file__).parent / "ddp_worker.py"
    cmd = [
        str(torchrun),
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        str(worker),
        str(config),
        str(out),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
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
