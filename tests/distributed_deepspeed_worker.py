"""Run by tests/test_distributed_deepspeed.py, as two ranks (DeepSpeed) or alone (the one-process
reference): train the Wan project, write the log and (DeepSpeed) each process's measured memory.

    python distributed_deepspeed_worker.py CONFIG OUT [--resume STATE] [key=value ...]

"""

import json
import os
import sys

import torch

from tuner.config import load_config
from tuner.trainers import trainer_class

WanTrainer = trainer_class("wan")

config, out, *rest = sys.argv[1:]
resume = None
if rest[:1] == ["--resume"]:
    resume, rest = rest[1], rest[2:]
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
strategies = []
if world > 1:
    import deepspeed.ops

    from tuner.distributed.deepspeed import DeepSpeedStrategy

    # DeepSpeed's CPU all-reduce kernel is compiled on first use into ~/.cache/torch_extensions: a minute
    # of each fresh machine's test time, and the lock a killed build leaves there hangs every later run.
    # gloo's all-reduce computes the same sums.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

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
