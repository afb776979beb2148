"""Run by tests/test_distributed_deepspeed.py, under torchrun (DeepSpeed) or alone (the one-process
reference): train the Wan project, write the log and (DeepSpeed) each process's measured memory.

    python distributed_deepspeed_worker.py CONFIG OUT [--resume STATE] [key=value ...]

A batch's noise and timesteps are drawn from a generator seeded by its position. With several processes
that position is the process's own batch count; here it is mapped to the batch's place in the shared plan
(process r's i-th batch is the plan's batch i * world + r), so a sample gets the same noise as in the
one-process run that accumulates the same global batch, and the two runs can be compared weight for weight.
"""

import json
import os
import sys

import torch

from tuner.config import load_config
from tuner.trainers import base
from tuner.trainers.wan import WanTrainer

config, out, *rest = sys.argv[1:]
resume = None
if rest[:1] == ["--resume"]:
    resume, rest = rest[1], rest[2:]
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
position_seed, step = base._mix, base.NetworkTrainer._step


def step_at_plan_place(self, run, batch):
    base._mix = lambda seed, epoch, i: position_seed(seed, epoch, i * world + rank)
    try:
        return step(self, run, batch)
    finally:
        base._mix = position_seed  # validation's draws stay as they are


base.NetworkTrainer._step = step_at_plan_place

strategies = []
if world > 1:
    from tuner.distributed.deepspeed import DeepSpeedStrategy

    plan = DeepSpeedStrategy.plan

    def plan_and_keep(self, *args):
        strategies.append(self)
        return plan(self, *args)

    DeepSpeedStrategy.plan = plan_and_keep

cfg = load_config(config, ["log.tensorboard=false", f"save.output_dir='{out}'", *rest])
lines = []
WanTrainer(cfg).train(resume=resume, log=lines.append)
with open(f"{out}/log{rank}.txt", "a") as f:
    f.write("\n".join(lines) + "\n")
if strategies:  # after the steps: the optimizer's moments exist and are measured, not estimated
    with open(f"{out}/memory{rank}.json", "w") as f:
        json.dump(strategies[0].memory(), f)
if torch.distributed.is_initialized():  # close the gloo group together (a group left to exit can abort)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
