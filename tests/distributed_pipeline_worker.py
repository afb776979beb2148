"""Run by tests/test_distributed_pipeline.py under torchrun: train the project with pipeline stages.

argv: config, output folder, max_steps, then either "-" or the state to resume from, then config
overrides. Each rank writes its loss history (`history<rank>.pt`) and the plan line it logged."""

import os
import sys

import torch

from tuner.config import load_config
from tuner.trainers.wan import WanTrainer

config, out, steps, resume, *overrides = sys.argv[1:]
cfg = load_config(config, ["log.tensorboard=false", f"save.output_dir='{out}'", f"train.max_steps={steps}",
                           'distributed.strategy="pipeline"', *overrides])  # fmt: skip
trainer = WanTrainer(cfg)
lines = []
trainer.train(resume=None if resume == "-" else resume, log=lines.append)
rank = os.environ["RANK"]
torch.save(trainer.history, f"{out}/history{rank}.pt")
with open(f"{out}/log{rank}.txt", "w") as f:
    f.write("\n".join(lines))
