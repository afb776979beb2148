"""Run by tests/test_distributed_fsdp.py under torchrun: one training run with two processes.

argv: the project config, and a JSON file holding the run: {"out": folder, "overrides": [...],
"resume": state folder or null}. Each process writes
`<out>/memory_<rank>.json`: what it held (`tuner.distributed.fsdp.process_memory`) after the last
backward of the run, before the optimizer step, and `<out>/history_<rank>.json`: its losses and validation losses.
"""

import json
import os
import sys
from pathlib import Path

from tuner.config import load_config
from tuner.distributed import fsdp
from tuner.trainers import trainer_class

WanTrainer = trainer_class("wan")

config, spec = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

measured: dict[str, int] = {}


def measure_after(reduce_gradients):
    def reduce_and_measure(self, run):
        reduce_gradients(self, run)
        measured.update(fsdp.process_memory(run.model, run.trained, run.optimizer))

    return reduce_and_measure


fsdp.FSDPStrategy.reduce_gradients = measure_after(fsdp.FSDPStrategy.reduce_gradients)

out = Path(spec["out"])
cfg = load_config(config, ["log.tensorboard=false", f"save.output_dir='{out}'", *spec["overrides"]])
trainer = WanTrainer(cfg)
trainer.train(resume=spec.get("resume"), log=print if rank == 0 else lambda s: None)
(out / f"memory_{rank}.json").write_text(json.dumps(measured))
(out / f"history_{rank}.json").write_text(
    json.dumps({"loss": trainer.history, "validation": trainer.val_history})
)
