"""Run by tests/test_distributed_pipeline.py as two ranks: train the project with pipeline stages.

argv: config, output folder, max_steps, "-" or the state to resume from, then config overrides. Each
rank writes its loss history (`history<rank>.pt`), what it logged (`log<rank>.txt`) and its stage's
bytes measured at the last save (`memory<rank>.json`)."""

import json
import os
import sys

import torch

from tuner.config import load_config
from tuner.distributed import pipeline
from tuner.trainers import base, trainer_class

config, out, steps, resume, *overrides = sys.argv[1:]
save = base.NetworkTrainer._save


def measure_and_save(self, run, final=False):
    """Each stage's figures just before a save gathers the stages' adapters and optimizer state."""
    strategy = run.strategy
    params = strategy.stage_params[strategy.rank]
    figures = pipeline.stage_memory(run.model, params, run.optimizer)
    figures["planned_optimizer"] = pipeline.stage_memory(run.model, params, run.optimizer, planned=True)[
        "optimizer"
    ]
    with open(f"{out}/memory{strategy.rank}.json", "w") as f:
        json.dump(figures, f)
    return save(self, run, final)


base.NetworkTrainer._save = measure_and_save
cfg = load_config(config, ["log.tensorboard=false", f"save.output_dir='{out}'", f"train.max_steps={steps}",
                           'distributed.strategy="pipeline"', *overrides])  # fmt: skip
trainer = trainer_class(cfg.model.architecture)(cfg)
lines = []
trainer.train(resume=None if resume == "-" else resume, log=lines.append)
rank = os.environ["RANK"]
torch.save(trainer.history, f"{out}/history{rank}.pt")
with open(f"{out}/log{rank}.txt", "w") as f:
    f.write("\n".join(lines))
