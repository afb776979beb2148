"""What a one-process `tuner train` holds when it logs step 1: nothing that run does not use. DeepSpeed
(about 425 modules; accelerate's `unwrap_model` imports it wherever it is installed), the web UI and
its server, and the video decoder of a run that trains from the cache stay out. One subprocess, since
this test process has long imported everything. peft, bitsandbytes, transformers and torch._dynamo are not
on the list: importing any diffusers model imports them wherever they are installed (`benchmarks/startup.py`
prints what that and the rest cost)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from project import make_project, tuner

FORBIDDEN = ("deepspeed", "tuner.ui", "fastapi", "uvicorn", "starlette", "av", "tensorboard")

PROBE = """
import json, sys
from tuner.trainers.base import NetworkTrainer
log_step = NetworkTrainer._log_step
def first_step(self, run):
    if not hasattr(first_step, "seen"):
        first_step.seen = sorted({m.split(".")[0] if m.split(".")[0] != "tuner" else m for m in sys.modules})
        print("MODULES " + json.dumps(first_step.seen), flush=True)
    log_step(self, run)
NetworkTrainer._log_step = first_step
from tuner.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_one_process_train_imports_nothing_it_does_not_use(tmp_path, wan_model):
    config = make_project(tmp_path / "project", wan_model)
    # Files written a moment ago are probed again each run (their stamp may not have settled: the memo's
    # racy window); a user's data set is older than that.
    old = time.time() - 60
    for path in (tmp_path / "project").rglob("*"):
        os.utime(path, (old, old))
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    assert tuner(["cache", "text", "--config", str(config)]) == 0
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "train", "--config", str(config), "--set", "train.max_steps=1",
         "--set", "log.tensorboard=false", "--set", f"save.output_dir='{tmp_path / 'out'}'"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.split("MODULES ", 1)[1].splitlines()[0])
    held = [m for m in seen if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert held == []
