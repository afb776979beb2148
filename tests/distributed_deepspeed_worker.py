"""Run by tests/test_distributed_deepspeed.py as two ranks: each DeepSpeed training run of a JSON list in
turn, in one launch (one process group and one start-up of two processes that import DeepSpeed, instead
of one per run).

argv: the project config, and a JSON file holding the runs: [{"out": folder, "overrides": [...],
"resume": state folder or null, "copy": state folder or null, "env": {name: value}, "fails": bool}];
with `copy`, process 0 first copies that state to `resume`; `env` is set for that run alone. Each process
writes `<out>/log<rank>.txt` (the run's log) and `<out>/memory<rank>.json` (DeepSpeed's partitions it
held after the steps); a run that `fails` writes the error it ended with to `<out>/error<rank>.txt`
instead (one that does not fail ends the launch with an error).

Between runs accelerate forgets its state, as a fresh process starts (it refuses a second
`Accelerator` with a DeepSpeed plugin in one process otherwise, and the last run's distributed type
would stay), and transformers its weak reference to the last run's DeepSpeed config; the process group
stays up until the last run is done (accelerate's `end_training` would destroy it after each; its
`PartialState` finds it initialized and takes it).
"""

import json
import os
import shutil
import sys
from pathlib import Path

import deepspeed.ops
import torch
from accelerate.state import AcceleratorState, PartialState
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from tuner.config import load_config
from tuner.distributed.deepspeed import DeepSpeedStrategy
from tuner.trainers import trainer_class

WanTrainer = trainer_class("wan")

config, runs = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
rank = int(os.environ["RANK"])

# DeepSpeed's CPU all-reduce kernel is compiled on first use into ~/.cache/torch_extensions: a minute of
# each fresh machine's test time, and the lock a killed build leaves there hangs every later run. gloo's
# all-reduce computes the same sums.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

strategies: list[DeepSpeedStrategy] = []
plan = DeepSpeedStrategy.plan


def plan_and_keep(self, *args):
    strategies.append(self)
    return plan(self, *args)


DeepSpeedStrategy.plan = plan_and_keep
PartialState.destroy_process_group = lambda self, group=None: None

for spec in runs:
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    if spec.get("copy"):
        if rank == 0:
            shutil.copytree(spec["copy"], spec["resume"])
        torch.distributed.barrier()
    AcceleratorState._reset_state(reset_partial_state=True)  # the process group stays
    unset_hf_deepspeed_config()
    strategies.clear()
    saved_env = {name: os.environ.get(name) for name in spec.get("env", {})}
    os.environ.update(spec.get("env", {}))
    cfg = load_config(config, ["log.tensorboard=false", f"save.output_dir='{out}'", *spec["overrides"]])
    lines: list[str] = []
    try:
        WanTrainer(cfg).train(resume=spec.get("resume"), log=lines.append)
    except Exception as e:
        if not spec.get("fails"):
            raise
        (out / f"error{rank}.txt").write_text(f"{type(e).__name__}: {e}\n")
    else:
        assert not spec.get("fails"), f"the run into {out} was to fail, and trained"
        (out / f"memory{rank}.json").write_text(json.dumps(strategies[0].memory()))
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    (out / f"log{rank}.txt").write_text("\n".join(lines) + "\n")
torch.distributed.barrier()  # close the gloo group together (a group left to exit can abort)
torch.distributed.destroy_process_group()
