"""The job queue behind `tuner ui` (`tuner.ui.jobs`): real runner processes, real `tuner` stages on the demo
project, and a stand-in launcher (a sleeping Python) where only the queue's own bookkeeping is tested."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tuner.demo import prepare
from tuner.ui.jobs import JobError, JobQueue, UnknownJob, tail
from tuner.ui.runner import runner_alive

TUNER = [sys.executable, "-m", "tuner"]
# stands in for `accelerate launch -m tuner`: says which stage and GPU it is, then sleeps; on SIGTERM it
# leaves a file `stopped` in its working folder (the run folder)
SLEEPER = [sys.executable, "-c", "import os, signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: "
           "(open('stopped', 'w').close(), sys.exit(1))); print('stage', *sys.argv[1:3], 'gpu', "
           "os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True); time.sleep(float(os.environ['SLEEP']))"]  # fmt: skip
SAMPLES = """
[sample]
prompts = ["a red circle"]
every_n_steps = {every}
steps = 2
width = 64
height = 48
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory, wan_model) -> Path:
    """The demo project (its data and dataset TOML); jobs get its training config as text."""
    root = tmp_path_factory.mktemp("ui_jobs_demo")
    prepare(root, steps=6, model=wan_model)
    return root


def demo_config(demo: Path, steps: int, sample_every: int) -> str:
    """The demo's training TOML with its dataset named by absolute path (the job runs in its own folder)."""
    text = (demo / "train.toml").read_text()
    text = text.replace('dataset_config = "dataset.toml"', f'dataset_config = "{demo / "dataset.toml"}"')
    text = text.replace("max_steps = 6", f"max_steps = {steps}").replace(
        "every_n_steps = 25", "every_n_steps = 0"
    )
    return text + SAMPLES.format(every=sample_every) + "\n[log]\ntensorboard = false\n"


def wait_for(queue: JobQueue, job_id: int, *states: str, timeout: float = 300, poll: bool = True):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if poll:
            queue.poll()
        job = queue.get(job_id)
        if job.state in states:
            _runner_ended(job, deadline)
            return job
        time.sleep(0.1)
    raise AssertionError(
        f"job {job_id} still {queue.get(job_id).state}; log:\n" + "\n".join(queue.log_tail(job_id))
    )


def _runner_ended(job, deadline: float) -> None:
    """Until a job that reached its state has no runner left: the runner records the outcome, then exits
    (a test that returned in between would leave it running)."""
    if job.state in ("queued", "running", "stopping") or job.pid is None:
        return
    while runner_alive(job.pid, job.id):
        assert time.monotonic() < deadline, f"job {job.id} is {job.state} but its runner still runs"
        time.sleep(0.05)


def wait_for_sleeper(queue: JobQueue, job_id: int) -> None:
    """Until the stand-in launcher of the job's first stage has said which it is."""
    deadline = time.monotonic() + 60
    while not queue.log_tail(job_id) or not queue.log_tail(job_id)[-1].startswith("stage"):
        assert time.monotonic() < deadline, queue.log_tail(job_id)
        time.sleep(0.1)


@pytest.mark.slow
def test_jobs_run_one_after_the_other_to_done_or_failed(demo, tmp_path):
    queue = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=TUNER, gpus=[])
    good = queue.submit("demo", demo_config(demo, steps=4, sample_every=2))
    bad = queue.submit("bad key", demo_config(demo, steps=4, sample_every=2).replace("rank = 8", "rnak = 8"))
    assert [j.state for j in queue.list()] == ["queued", "queued"]
    queue.run_in_background(interval=0.2)
    try:
        job = wait_for(queue, good, "done", "failed", poll=False)
        failed = wait_for(queue, bad, "done", "failed", poll=False)
    finally:
        queue.close()
    assert job.state == "done", job.error
    assert failed.state == "failed" and failed.started >= job.finished
    assert (
        failed.stage == "cache latents" and "rnak" in failed.error and "Did you mean 'rank'" in failed.error
    ), failed.error

    log = queue.log_tail(good, 1000)
    assert [line.split(":")[0] for line in log if line.startswith("== ")] == ["== cache latents", "== cache text",
                                                                             "== train"]  # fmt: skip
    assert [m["step"] for m in queue.metrics(good) if "loss" in m] == [1, 2, 3, 4]
    assert all(
        {"lr", "avg_loss", "eta_seconds", "step_seconds", "epoch"} <= m.keys() for m in queue.metrics(good)
    )
    samples = queue.samples(good)
    assert [(s["step"], s["prompt"]) for s in samples] == [(2, "a red circle"), (4, "a red circle")]
    assert all(s["path"].is_file() and s["path"].is_relative_to(job.output_dir) for s in samples)
    assert [p.name for p in queue.adapters(good)] == ["demo_lora.safetensors"]

    queue.delete(bad)
    assert not failed.run_dir.exists() and [j.id for j in queue.list()] == [good]


@pytest.mark.slow
def test_a_stopped_job_saves_its_state_and_resumes_to_done(demo, tmp_path):
    queue = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=TUNER, gpus=[])
    job_id = queue.submit("stop me", demo_config(demo, steps=8, sample_every=1))  # a sample per step: slow
    queue.poll()
    deadline = time.monotonic() + 300
    while len([m for m in queue.metrics(job_id) if "loss" in m]) < 2 and time.monotonic() < deadline:
        queue.poll()
        assert queue.get(job_id).state == "running", queue.log_tail(job_id)
        time.sleep(0.05)
    queue.stop(job_id)
    assert queue.get(job_id).state == "stopping"
    job = wait_for(queue, job_id, "stopped", "failed", "done")
    assert job.state == "stopped" and job.stage == "train", job.error
    stopped = [line for line in queue.log_tail(job_id) if line.startswith("stopped on SIGTERM")]
    assert len(stopped) == 1 and "--resume latest" in stopped[0], queue.log_tail(job_id)
    step = max(m["step"] for m in queue.metrics(job_id))
    assert step < 8 and (job.output_dir / "state" / f"step{step:06d}").is_dir()
    assert [p.name for p in queue.adapters(job_id)] == [f"demo_lora-step{step:06d}.safetensors"]

    queue.resume(job_id)
    job = wait_for(queue, job_id, "done", "failed")
    assert job.state == "done", job.error
    assert any(
        "--resume latest" in line for line in queue.log_tail(job_id, 1000) if line.startswith("== train")
    )
    assert [m["step"] for m in queue.metrics(job_id) if "loss" in m] == list(
        range(1, 9)
    )  # one run, no repeats
    assert [s["step"] for s in queue.samples(job_id)] == list(range(1, 9))


@pytest.mark.slow
def test_a_two_process_job_runs_every_stage_as_two_cpu_ranks_to_done(demo, tmp_path):
    queue = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=TUNER, gpus=[])
    job_id = queue.submit("two", demo_config(demo, steps=2, sample_every=0), processes=2)
    job = wait_for(queue, job_id, "done", "failed")
    assert job.state == "done", job.error
    assert job.processes == 2 and [(r["rank"], r["state"], r["code"]) for r in job.ranks] == [
        (0, "exited", 0),
        (1, "exited", 0),
    ]
    assert len({r["pid"] for r in job.ranks}) == 2
    heads = [line for line in queue.log_tail(job_id, 2000) if line.startswith("== ")]
    assert len(heads) == 3 and all("(2 processes;" in line for line in heads), heads
    assert (job.run_dir / "job.rank1.log").stat().st_size > 0  # rank 1 wrote its own log
    assert [m["step"] for m in queue.metrics(job_id) if "loss" in m] == [1, 2]
    assert [p.name for p in queue.adapters(job_id)] == ["demo_lora.safetensors"]


# rank 1 fails at once; rank 0 sleeps as if waiting on rank 1 in a collective, and ignores SIGTERM
BREAKS = [sys.executable, "-c", "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "rank = os.environ['RANK']; print('rank', rank, os.environ['WORLD_SIZE'], flush=True); "
          "sys.exit('rank 1 breaks') if rank == '1' else time.sleep(120)"]  # fmt: skip


def test_a_failing_rank_is_named_and_the_other_ranks_are_ended(tmp_path):
    queue = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=BREAKS, gpus=[])
    job_id = queue.submit("breaks", "[train]\nmax_steps = 1\n", processes=2)
    job = wait_for(queue, job_id, "failed", "done", timeout=60)
    assert job.state == "failed" and job.stage == "cache latents"
    assert job.error.startswith("cache latents: rank 1 of 2 processes exited with code 1"), job.error
    assert "rank 1 breaks" in job.error
    log = queue.log_tail(job_id)
    assert "rank 1 breaks" in log and any(line.startswith("== cache latents: rank 1 of 2") for line in log)
    assert [(r["rank"], r["code"]) for r in job.ranks] == [(0, -signal.SIGKILL), (1, 1)]
    for r in job.ranks:  # nothing left of either process
        with pytest.raises(ProcessLookupError):
            os.kill(r["pid"], 0)


def test_stopping_a_two_process_job_signals_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEEP", "60")
    queue = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=SLEEPER, gpus=[])
    job_id = queue.submit("two sleepers", "[train]\nmax_steps = 1\n", processes=2)
    queue.poll()
    wait_for_sleeper(queue, job_id)
    running = queue.get(job_id)
    assert [(r["rank"], r["state"]) for r in running.ranks] == [(0, "running"), (1, "running")]
    deadline = time.monotonic() + 60
    while not (running.run_dir / "job.rank1.log").read_text().startswith("stage"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    queue.stop(job_id)
    job = wait_for(queue, job_id, "stopped", "failed", "done", timeout=60)
    assert job.state == "stopped", job.error
    assert [(r["rank"], r["code"]) for r in job.ranks] == [
        (0, 1),
        (1, 1),
    ]  # each ended by its SIGTERM handler


def test_process_counts_are_checked_against_the_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEEP", "0")
    cpu = JobQueue(tmp_path / "cpu.sqlite", tmp_path / "runs", launcher=SLEEPER, gpus=[])
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(JobError, match="not a whole number"):
            cpu.submit("bad", "", processes=bad)
    with pytest.raises(JobError, match="CPU processes on a machine of"):
        cpu.submit("too many", "", processes=(os.cpu_count() or 1) + 1)
    gpus = JobQueue(tmp_path / "gpus.sqlite", tmp_path / "runs", launcher=SLEEPER, gpus=["0", "1"])
    with pytest.raises(JobError, match="one process per GPU"):
        gpus.submit("three", "", processes=3)
    assert [j.id for j in gpus.list()] == []
    both, one = gpus.submit("both GPUs", "", processes=2), gpus.submit("one GPU", "")
    gpus.poll()
    assert [gpus.get(i).state for i in (both, one)] == ["running", "queued"]
    with pytest.raises(JobError, match="needs 1 GPU"):
        gpus.start(one)
    wait_for(gpus, both, "done", timeout=60)
    told = {line for line in gpus.log_tail(both) if line.startswith("stage")}
    assert told and all(line.endswith("gpu 0,1") for line in told), told
    wait_for(gpus, one, "done", timeout=60)


def test_a_database_of_an_earlier_tuner_gets_the_new_columns(tmp_path):
    import sqlite3

    old = sqlite3.connect(tmp_path / "jobs.sqlite")
    old.execute(
        "CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, state TEXT NOT NULL, "
        "stage TEXT, pid INTEGER, created REAL NOT NULL, started REAL, finished REAL, run_dir TEXT NOT NULL, "
        "output_dir TEXT NOT NULL, error TEXT, resume INTEGER NOT NULL DEFAULT 0, slot TEXT, stage_pid INTEGER)"
    )
    old.execute(
        "INSERT INTO jobs (name, state, created, run_dir, output_dir) VALUES ('old', 'done', 0, 'r', 'o')"
    )
    old.commit()
    old.close()
    queue = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=SLEEPER, gpus=[])
    (job,) = queue.list()
    assert (job.name, job.processes, job.ranks) == ("old", 1, [])


def test_a_restarted_queue_keeps_running_jobs_and_fails_one_whose_process_died(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEEP", "60")
    first = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=SLEEPER, gpus=[])
    job_id = first.submit("sleeper", "[train]\nmax_steps = 1\n")
    first.poll()
    wait_for_sleeper(first, job_id)
    runner = first.get(job_id).pid
    first.close()  # the UI goes away; the job does not

    second = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=SLEEPER, gpus=[])
    second.poll()
    assert second.get(job_id).state == "running"
    os.killpg(runner, signal.SIGKILL)  # the job's runner dies (its stage is stopped by the queue)
    job = wait_for(second, job_id, "failed", timeout=30)
    deadline = time.monotonic() + 30
    while not (job.run_dir / "stopped").is_file():  # the orphaned stage was stopped
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert (
        f"pid {runner}" in job.error and "cache latents" in job.error and "stage cache latents" in job.error
    )


def test_one_job_per_gpu_each_told_its_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEEP", "0")
    queue = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=SLEEPER, gpus=["0", "1"])
    ids = [queue.submit(f"job {i}", "[train]\nmax_steps = 1\n") for i in range(3)]
    queue.poll()
    assert [queue.get(i).state for i in ids] == ["running", "running", "queued"]
    for i in ids:
        wait_for(queue, i, "done", timeout=60)
    gpus = [{line.split()[-1] for line in queue.log_tail(i) if line.startswith("stage")} for i in ids]
    assert gpus[0] == {"0"} and gpus[1] == {"1"} and len(gpus[2]) == 1


def test_queue_operations_refuse_what_does_not_apply(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEEP", "60")
    queue = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=SLEEPER, gpus=[])
    with pytest.raises(JobError, match="config.toml: not valid TOML"):
        queue.submit("broken", "[train\n")
    with pytest.raises(UnknownJob):
        queue.get(99)
    first = queue.submit("first", "[save]\noutput_dir = 'elsewhere'\n")
    second = queue.submit("second", "", dataset_text="[general]\n")
    assert queue.get(first).output_dir == queue.get(first).run_dir / "elsewhere"
    assert (queue.get(second).run_dir / "dataset.toml").read_text() == "[general]\n"
    queue.start(second)  # ahead of the first
    with pytest.raises(JobError, match="busy"):
        queue.start(first)
    with pytest.raises(JobError, match="stop it before deleting"):
        queue.delete(second)
    with pytest.raises(JobError, match="only a stopped or failed job"):
        queue.resume(second)
    queue.stop(first)  # queued: taken off the queue
    assert queue.get(first).state == "stopped"
    wait_for_sleeper(queue, second)
    queue.stop(second)
    assert wait_for(queue, second, "stopped", timeout=30).stage == "cache latents"  # not on to the next stage
    queue.delete(second)
    assert [j.id for j in queue.list()] == [first]


def test_tail_shows_the_last_state_of_progress_bars(tmp_path):
    log = tmp_path / "job.log"
    log.write_bytes(b"x" * 100_000 + b"\nfirst\nsteps 1/3\rsteps 2/3\rsteps 3/3\nlast\n")
    assert tail(log, 3) == ["first", "steps 3/3", "last"]
    assert tail(log, 1) == ["last"] and tail(tmp_path / "missing.log", 5) == []
    assert json.loads(json.dumps(tail(log, 200)))[-1] == "last"


def test_a_pid_taken_over_by_another_process_is_not_taken_for_the_runner(tmp_path):
    """After a reboot the pid a job recorded may belong to some other process: the job is still lost."""
    from tuner.ui.jobs import transaction

    queue = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=SLEEPER, gpus=[])
    job_id = queue.submit("from before the reboot", "")
    with transaction(queue.db_path) as conn:
        conn.execute(
            "UPDATE jobs SET state = 'running', slot = 'cpu', pid = ? WHERE id = ?", (os.getppid(), job_id)
        )
    queue.poll()
    job = queue.get(job_id)
    assert job.state == "failed" and f"pid {os.getppid()}" in job.error


def test_a_run_folder_left_by_an_earlier_database_is_kept(tmp_path):
    queue = JobQueue(tmp_path / "jobs.sqlite", tmp_path / "runs", launcher=SLEEPER, gpus=[])
    (tmp_path / "runs" / "0001-demo").mkdir(parents=True)
    (tmp_path / "runs" / "0001-demo" / "mine.txt").write_text("keep")
    job = queue.get(queue.submit("demo", ""))
    assert job.run_dir.name == "0001-demo-2" and (tmp_path / "runs" / "0001-demo" / "mine.txt").is_file()
