"""Run by tests/test_distributed_fsdp.py under torchrun: one training run with two processes.

argv: the project config, and a JSON file holding the run: {"out": folder, "overrides": [...],
"resume": state folder or null}. Each process writes
`<out>/memory_<rank>.json`: what it held (`tuner.distributed.fsdp.process_memory`) after the last
backward of the run, before the optimizer step, and `<out>/history_<rank>.json`: its losses and validation losses.

A one-process run with gradient accumulation draws the noise and timesteps of the batch at global index
i from a generator seeded with i; a process of a multi-process run seeds with its own batch counter.
So that the two runs see the same draws (and the test can compare weights), this worker seeds process
r's local batch j with its global index j * world + r, the batch the shared plan gives it.
"""

import json
import os
import sys
from pathlib import Path

from tuner.config import load_config
from tuner.distributed import fsdp
from tuner.trainers import base
from tuner.trainers.wan import WanTrainer

config, spec = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

draw_seed = base._mix


def global_batch_seed(seed: int, epoch: int, batch: int) -> int:
    if sys._getframe(1).f_code.co_name != "_step":  # validation's draws are the same on every process
        return draw_seed(seed, epoch, batch)
    return draw_seed(seed, epoch, batch * world + rank)


base._mix = global_batch_seed

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
