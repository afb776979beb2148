"""Run by tests/test_distributed_fsdp.py as two ranks: each training run of a JSON list in turn, with two
processes (one process group, one start-up).

argv: the project config, and a JSON file holding the runs: [{"out": folder, "overrides": [...],
"resume": state folder or null, "copy": state folder or null}]; with `copy`, process 0 first copies that
state to `resume` (a resumed run's folder holds the state it started from). Each process writes
`<out>/memory_<rank>.json`: what it held (`tuner.distributed.fsdp.process_memory`) after the last
backward of the run, before the optimizer step, and `<out>/history_<rank>.json`: its losses and
validation losses; process 0 writes the run's log to `<out>/log.txt`.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from accelerate.state import PartialState

from tuner.config import load_config
from tuner.distributed import fsdp
from tuner.trainers import trainer_class

WanTrainer = trainer_class("wan")

config, runs = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

measured: dict[str, int] = {}


def measure_after(reduce_gradients):
    def reduce_and_measure(self, run):
        reduce_gradients(self, run)
        measured.update(fsdp.process_memory(run.model, run.trained, run.optimizer))

    return reduce_and_measure


fsdp.FSDPStrategy.reduce_gradients = measure_after(fsdp.FSDPStrategy.reduce_gradients)
# the process group outlives each run's `end_training` (which would destroy it): closed after the last
PartialState.destroy_process_group = lambda self, group=None: None

for spec in runs:
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    if spec.get("copy"):
        assert torch.distributed.is_initialized(), "a run that copies a state comes after the one saving it"
        if rank == 0:
            shutil.copytree(spec["copy"], spec["resume"])
        torch.distributed.barrier()
    measured.clear()
    lines: list[str] = []
    cfg = load_config(config, ["log.tensorboard=false", f"save.output_dir='{out}'", *spec["overrides"]])
    trainer = WanTrainer(cfg)
    trainer.train(resume=spec.get("resume"), log=lines.append)
    (out / f"memory_{rank}.json").write_text(json.dumps(measured))
    (out / f"history_{rank}.json").write_text(
        json.dumps({"loss": trainer.history, "validation": trainer.val_history})
    )
    if rank == 0:
        (out / "log.txt").write_text("\n".join(lines) + "\n")
torch.distributed.barrier()  # close the gloo group together (a group left to exit can abort)
torch.distributed.destroy_process_group()
