"""Run by tests/test_stop.py as the ranks of a two-process `tuner train` (under torchrun, or tests/launch.py):
rank 1 alone gets SIGNAL (TERM or KILL) during step 3. Each rank that exits on its own writes its exit
code and the steps it logged to rank<N>.txt.

    stop_worker.py TRAIN.toml OUT SIGNAL
"""

import os
import signal
import sys

from tuner.cli import main
from tuner.trainers.base import NetworkTrainer

config, out, sig = sys.argv[1], sys.argv[2], signal.Signals[f"SIG{sys.argv[3]}"]
rank = int(os.environ["RANK"])
original = NetworkTrainer._log_step
logged = []


def log_step(self, run):
    logged.append(run.pos.step)
    if rank == 1 and run.pos.step == 3:
        os.kill(os.getpid(), sig)  # as from `kill`: SIGTERM's handler runs between two bytecodes
    return original(self, run)


NetworkTrainer._log_step = log_step
overrides = [
    "log.tensorboard=false",
    f"save.output_dir='{out}'",
    "train.max_steps=20",
    "save.every_n_epochs=0",
]
code = main(["train", "--config", config, *(a for o in overrides for a in ("--set", o))])
with open(f"{out}/rank{rank}.txt", "w") as f:
    f.write(f"{rank} exit {code} after {len(logged)}")
sys.exit(code)
