"""Run by tests/test_distributed_pipeline.py as two ranks (four for the stages × replicas run): train each
run of a JSON list in turn with pipeline stages (one process group, one start-up).

argv: a JSON file holding the runs: [{"config": TRAIN.toml, "out": folder, "steps": max_steps, "resume":
state folder or null, "overrides": [...]}]. Each rank writes its loss history (`history<rank>.pt`), its
validation losses (`validation<rank>.pt`), what it logged (`log<rank>.txt`) and its stage's bytes
measured at the last save (`memory<rank>.json`) into the run's `out`. Block swap streams through
`FakeTransfer` (the CPU stand-in for a GPU: a block's released device copy is poisoned, so a block used
while not resident gives NaN)."""

import json
import os
import sys

import torch
from accelerate.state import PartialState

from tuner import memory
from tuner.config import load_config
from tuner.distributed import pipeline
from tuner.offload import FakeTransfer
from tuner.trainers import base, trainer_class

save = base.NetworkTrainer._save
out = None  # the current run's folder


def measure_and_save(self, run, final=False):
    """Each stage's figures just before a save gathers the stages' adapters and optimizer state."""
    strategy = run.strategy
    params = strategy.stage_params[strategy.stage]
    figures = pipeline.stage_memory(run.model, params, run.optimizer)
    figures["planned_optimizer"] = pipeline.stage_memory(run.model, params, run.optimizer, planned=True)[
        "optimizer"
    ]
    with open(f"{out}/memory{os.environ['RANK']}.json", "w") as f:
        json.dump(figures, f)
    return save(self, run, final)


base.NetworkTrainer._save = measure_and_save
memory.transfer_for = lambda device: FakeTransfer()
# the process group outlives each run's `end_training` (which would destroy it): closed after the last
PartialState.destroy_process_group = lambda self, group=None: None
rank = os.environ["RANK"]
for spec in json.loads(open(sys.argv[1]).read()):
    out = spec["out"]
    cfg = load_config(spec["config"], ["log.tensorboard=false", f"save.output_dir='{out}'",
                                       f"train.max_steps={spec['steps']}", 'distributed.strategy="pipeline"',
                                       *spec["overrides"]])  # fmt: skip
    trainer = trainer_class(cfg.model.architecture)(cfg)
    lines = []
    trainer.train(resume=spec.get("resume"), log=lines.append)
    torch.save(trainer.history, f"{out}/history{rank}.pt")
    torch.save(trainer.val_history, f"{out}/validation{rank}.pt")
    with open(f"{out}/log{rank}.txt", "w") as f:
        f.write("\n".join(lines))
    torch.distributed.barrier()  # the next run may resume from what this one saved
torch.distributed.destroy_process_group()
