"""Run by tests/test_stop.py under torchrun: train two processes; rank 1 alone gets SIGTERM during step 3.
Each rank writes how its run ended to rank<N>.txt."""

import os
import signal
import sys

from tuner.config import load_config
from tuner.errors import TrainingStopped
from tuner.trainers import trainer_class

WanTrainer = trainer_class("wan")

config, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
original = WanTrainer._log_step


def log_step(self, run):
    if rank == 1 and run.pos.step == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # as from `kill`: the handler runs between two bytecodes
    return original(self, run)


WanTrainer._log_step = log_step
overrides = [
    "log.tensorboard=false",
    f"save.output_dir='{out}'",
    "train.max_steps=20",
    "save.every_n_epochs=0",
]
trainer = WanTrainer(load_config(config, overrides))
try:
    trainer.train(log=lambda s: None)
    outcome = "finished"
except TrainingStopped:
    outcome = f"stopped at {len(trainer.history)}"
with open(f"{out}/rank{rank}.txt", "w") as f:
    f.write(f"{rank} {outcome}")
