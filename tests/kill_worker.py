"""Run by tests/test_faults.py as a subprocess: train, and SIGKILL this process at the n-th file write,
after half of that file is on disk (so nothing of Python's clean-up runs, as in a real crash)."""

import contextlib
import os
import signal
import sys

import tuner.io
from tuner.config import load_config
from tuner.trainers import trainer_class

WanTrainer = trainer_class("wan")

config, out, kill_at, resume, *overrides = sys.argv[1:]
real = tuner.io.atomic_path
writes = 0


@contextlib.contextmanager
def killing(path):
    global writes
    writes += 1
    with real(path) as tmp:
        yield tmp
        if writes == int(kill_at):
            data = tmp.read_bytes()
            tmp.write_bytes(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)


tuner.io.atomic_path = killing
cfg = load_config(config, ["log.tensorboard=false", f"save.output_dir='{out}'", *overrides])
WanTrainer(cfg).train(resume=resume or None, log=lambda s: None)
