"""Stopping `tuner train` on request (SIGTERM / SIGINT) and the metrics file every run writes.

A real `tuner train` process gets SIGTERM mid-run: it finishes the step, saves a complete state and that
step's adapter, says how to continue and exits with 75; `--resume latest` then ends with the weights of an
uninterrupted run. With two processes the signal reaches one of them and both stop after the same step.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch import free_port, launch
from project import cfg, make_cached_project, run, train_wan
from tuner.errors import TrainingStopped
from tuner.trainers import state, trainer_class
from tuner.trainers.checkpoints import Checkpoints
from tuner.trainers.metrics import MetricsFile

STEPS = 10
# samples at every step slow the run down enough to signal it mid-run on a busy machine; they draw nothing
# from the random state the training uses, so the weights match a run without them
SAMPLES = ("sample.prompts=['a red circle']", "sample.every_n_steps=1", "sample.steps=2", "sample.width=64",
           "sample.height=48")  # fmt: skip
RUN = (f"train.max_steps={STEPS}", "save.every_n_steps=0", "save.every_n_epochs=0", "network.dropout=0.1",
       "log.tensorboard=false", "data.num_workers=2")  # fmt: skip


@pytest.fixture(scope="module")
def project(tmp_path_factory, wan_model):
    return make_cached_project(tmp_path_factory.mktemp("stop_project"), wan_model)


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}


def _metric_steps(out: Path) -> list[int]:
    path = out / "logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_sigterm_saves_a_complete_state_and_resume_equals_a_straight_run(project, tmp_path, capsys):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "tuner", "train", "--config", str(project),
               *_sets(f"save.output_dir='{out}'", *RUN, *SAMPLES)]  # fmt: skip
    process = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 240
    while len(_metric_steps(out)) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGTERM)  # as `kill` of a launcher's group: the data workers get it too
    log = process.communicate(timeout=240)[0]
    assert process.returncode == TrainingStopped.exit_code, log[-3000:]
    stopped = [line for line in log.splitlines() if line.startswith("stopped on SIGTERM")]
    assert len(stopped) == 1, log[-3000:]
    (folder,) = (out / "state").iterdir()
    step = int(folder.name.removeprefix("step"))
    assert 2 <= step < STEPS
    assert (
        str(folder) in stopped[0]
        and "--resume latest" in stopped[0]
        and f"after step {step} of" in stopped[0]
    )
    state.verify(folder)  # complete: every file its manifest lists, byte for byte
    assert (out / f"demo_lora-step{step:06d}.safetensors").is_file()
    assert _metric_steps(out) == list(range(1, step + 1))

    code, resumed_log = run(capsys, "train", "--config", project, "--resume", "latest",
                            *_sets(f"save.output_dir='{out}'", *RUN, *SAMPLES))  # fmt: skip
    assert code == 0, resumed_log
    straight = tmp_path / "straight"
    train_wan(project, straight, *RUN)
    a, b = load_file(out / "demo_lora.safetensors"), load_file(straight / "demo_lora.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # the metrics file reads as one run: every step once, a sample (with its prompt) at every step
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))
    samples = [r for r in rows if "path" in r]
    assert [r["step"] for r in samples] == list(range(1, STEPS + 1))
    assert all(r["prompt"] == "a red circle" and (out / r["path"]).is_file() for r in samples)


def test_the_metrics_file_keeps_whole_lines_up_to_the_resumed_step(tmp_path):
    out = tmp_path / "out"
    metrics = MetricsFile(out, every_n_steps=1, resumed_step=None)
    for step in (1, 2, 3):
        metrics.step(
            step, 0, 4, loss=0.5 if step != 2 else math.nan, avg_loss=0.5, lr=1e-4, step_seconds=[1.0, 3.0]
        )
    metrics.validation(2, 0.25)
    metrics.samples(2, [out / "samples" / "a.png", tmp_path / "elsewhere.png"], ["a cat", "a dog"])
    path = out / "logs" / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 4, "loss"')  # a line cut short by a kill
    rows = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    assert rows[0]["eta_seconds"] == 3 * 2.0 and rows[0]["epoch"] == 1 and rows[0]["step_seconds"] == 3.0
    assert rows[1]["loss"] is None  # NaN is written as null: the file stays JSON
    assert rows[4:] == [{"step": 2, "prompt": "a cat", "path": "samples/a.png", "time": rows[4]["time"]},
                        {"step": 2, "prompt": "a dog", "path": str(tmp_path / "elsewhere.png"), "time": rows[5]["time"]}]  # fmt: skip

    MetricsFile(out, every_n_steps=1, resumed_step=2)  # resuming from step 2 drops step 3 and the cut line
    assert [(r["step"], sorted(r)[0]) for r in map(json.loads, path.read_text().splitlines())] == [
        (1, "avg_loss"), (2, "avg_loss"), (2, "step"), (2, "path"), (2, "path")]  # fmt: skip
    MetricsFile(out, every_n_steps=1, resumed_step=None)  # a new run starts a new file
    assert path.read_text() == ""


@pytest.mark.slow
def test_with_two_processes_a_signal_to_one_stops_both_after_the_same_step(project, tmp_path):
    """Under torchrun: both `tuner train` processes stop after step 3 and exit with 75; torchrun itself
    exits with 1 whenever a worker exits non-zero, and names the 75 in its report (docs/distributed.md)."""
    out = tmp_path / "out"
    out.mkdir()
    worker = Path(__file__).parent / "stop_worker.py"
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), str(worker),
               str(project), str(out), "TERM"]  # fmt: skip
    done = subprocess.run(command, env={**_env(), "ACCELERATE_USE_CPU": "true"}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    outcomes = sorted((out / f"rank{r}.txt").read_text() for r in (0, 1) if (out / f"rank{r}.txt").is_file())
    assert outcomes == ["0 exit 75 after 3", "1 exit 75 after 3"], done.stderr[-3000:]
    assert done.returncode == 1 and "exitcode  : 75" in done.stderr, done.stderr[-3000:]
    (folder,) = (out / "state").iterdir()
    assert folder.name == "step000003"
    state.verify(folder)
    assert {p.name for p in folder.glob("rng_*.json")} == {"rng_0.json", "rng_1.json"}


@pytest.mark.slow
def test_with_two_processes_a_killed_one_stops_the_other_within_seconds_naming_it(project, tmp_path):
    """Rank 1 is SIGKILLed during step 3: rank 0 ends by itself (within its watch's beat and grace, about 4 s;
    the launch kills it 30 s after rank 1 died, a margin for a loaded machine) with exit 2 and one line
    naming rank 1 and how it ended, no traceback."""
    out = tmp_path / "out"
    out.mkdir()
    worker = Path(__file__).parent / "stop_worker.py"
    done = launch(
        [str(worker), str(project), str(out), "KILL"],
        2,
        {**_env(), "ACCELERATE_USE_CPU": "true"},
        300,
        grace=30,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error: ")]
    assert re.fullmatch(r"error: process 1 \(pid \d+\) died without an error of its own \(killed by a signal: "
                        r"SIGKILL, the out-of-memory killer\?\); process 0 stops too", line), line  # fmt: skip


def test_the_metrics_file_holds_the_logged_steps_and_validation_losses(project, tmp_path):
    dataset = project.parent / "dataset_val.toml"
    text = (project.parent / "dataset.toml").read_text()
    dataset.write_text(
        text.replace('video_directory = "data/videos"', 'video_directory = "data/videos"\nvalidation = true')
    )
    out = tmp_path / "out"
    trainer = train_wan(project, out, f"data.dataset_config='{dataset}'", "train.max_steps=4",
                        "train.validate_every_n_steps=2", "log.every_n_steps=2")  # fmt: skip
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows if "loss" in r] == [
        (2, trainer.history[1]),
        (4, trainer.history[3]),
    ]
    assert [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r] == trainer.val_history
    assert rows[-1]["val_loss"] and rows[-2]["eta_seconds"] == 0  # the last step: nothing left


@pytest.mark.parametrize(
    "sig, every", [(signal.SIGINT, 0), (signal.SIGTERM, 2)], ids=["SIGINT", "SIGTERM-at-a-save"]
)
def test_a_signal_in_process_stops_after_the_step_and_saves_once(project, tmp_path, monkeypatch, sig, every):
    """SIGINT (Ctrl-C) too; a stop at a step `save.every_n_steps` has just saved saves nothing twice. The
    handlers are put back afterwards."""
    from tuner.trainers.base import NetworkTrainer

    log_step = NetworkTrainer._log_step

    def signalled_at_step_2(self, run_):
        if run_.pos.step == 2:
            os.kill(os.getpid(), sig)
        return log_step(self, run_)

    monkeypatch.setattr(NetworkTrainer, "_log_step", signalled_at_step_2)
    saves = []
    monkeypatch.setattr(Checkpoints, "_save_state", lambda self, network, pos, real=Checkpoints._save_state: (
        saves.append(pos.step), real(self, network, pos)))  # fmt: skip
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    lines = []
    with pytest.raises(TrainingStopped) as stopped:
        trainer_class("wan")(
            cfg(project, f"save.output_dir='{tmp_path / 'out'}'", *RUN, f"save.every_n_steps={every}")
        ).train(log=lines.append)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert saves == [2]
    assert str(stopped.value) == lines[-1] and lines[-1].startswith(
        f"stopped on {sig.name} after step 2 of 10"
    )
    state.verify(tmp_path / "out" / "state" / "step000002")
    assert f"(adapter {tmp_path / 'out' / 'demo_lora-step000002.safetensors'})" in lines[-1]
