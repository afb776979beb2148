"""Run by tests/test_shared_swap_ddp.py as two ranks: train with block swap on the fake transfer device
(the CPU has no copy engine) twice, into OUT/private with a host copy per process and then into OUT/shared
with the copy shared (one process group, one start-up), and dump each run's trained weights and how each
rank holds the swapped weights.

    shared_swap_worker.py CONFIG OUT [OVERRIDE ...]
"""

import json
import os
import sys

import torch
from accelerate.state import PartialState

from tuner import memory
from tuner.config import load_config
from tuner.offload import FakeTransfer
from tuner.offload.shared import mapped_segments, proportional_set_size
from tuner.trainers import checkpoints, trainer_class

config, root, *extra = sys.argv[1:]
rank = os.environ["RANK"]
memory.transfer_for = lambda device: FakeTransfer()
swaps = []  # one per transformer (two-expert models: two)
original_swap, original_save = memory.BlockSwap, checkpoints.Checkpoints.save


def recorded_swap(*args, **kwargs):
    swaps.append(original_swap(*args, **kwargs))
    return swaps[-1]


def save_and_dump(self, network, pos, *args, **kwargs):
    """At the final save (every block has been copied from its host master by now): the weights, and for
    each block swap the swapped weights' bytes, plus the shared segments mapped and the process's PSS."""
    weights = {k: v.detach().clone() for k, v in self.accelerator.unwrap_model(network).state_dict().items()}
    torch.save(weights, f"{out}/rank{rank}.pt")
    report = {
        "swapped_bytes": [
            sum(m.numel() * m.element_size() for b in s.swapped for m in b.masters) for s in swaps
        ],
        "segments": [s.__dict__ for s in mapped_segments()],
        "pss": proportional_set_size(),
    }
    with open(f"{out}/memory{rank}.json", "w") as f:
        json.dump(report, f)
    return original_save(self, network, pos, *args, **kwargs)


memory.BlockSwap = recorded_swap
checkpoints.Checkpoints.save = save_and_dump
# the process group outlives the first run's `end_training` (which would destroy it): closed after the last
PartialState.destroy_process_group = lambda self, group=None: None
for out, share in ((f"{root}/private", "false"), (f"{root}/shared", "true")):
    os.makedirs(out, exist_ok=True)
    swaps.clear()
    overrides = ["log.tensorboard=false", f"save.output_dir='{out}'", "train.max_steps=3",
                 "memory.blocks_to_swap=2", f"memory.share_swapped_weights={share}", *extra]  # fmt: skip
    cfg = load_config(config, overrides)
    trainer_class(cfg.model.architecture)(cfg).train()
torch.distributed.barrier()
torch.distributed.destroy_process_group()
