"""Run as ranks by the multi-process tests: train each run of a JSON list in turn (one process group,
one start-up), and dump each rank's trained weights, loss history, the gradient buckets DDP reduced
and (rank 0) the log lines.

    torchrun --nproc_per_node 2 tests/ddp_worker.py RUNS.json

RUNS.json: [{"config": TRAIN.toml, "out": DIR, "overrides": ["train.max_steps=3", ...], "resume": null,
"fake_device": false, "full_disk": false}]; with `fake_device`, block swap moves blocks through
`FakeTransfer` (the CPU stand-in for a GPU that tests/test_blockswap.py uses); with `full_disk`, the main
process's disk is full when it writes a state's manifest.
A run that fails writes `error<rank>.txt` (the exception's type and message) in its `out`, and the next
one starts.
"""

import errno
import json
import os
import sys

import torch
from accelerate.state import PartialState
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from tuner import memory
from tuner.config import load_config
from tuner.distributed.ddp import DDPStrategy
from tuner.offload import FakeTransfer
from tuner.trainers import checkpoints, state, trainer_class

original = checkpoints.Checkpoints.save


def save_and_dump(self, network, pos, *args, **kwargs):
    """Each save also dumps this rank's trained weights (the last save's stay)."""
    weights = {k: v.detach().clone() for k, v in self.accelerator.unwrap_model(network).state_dict().items()}
    torch.save(weights, self.out / f"rank{self.accelerator.process_index}.pt")
    return original(self, network, pos, *args, **kwargs)


checkpoints.Checkpoints.save = save_and_dump
reductions = []  # gradient buckets all-reduced in the current run (DDP's communication hook)
prepare = DDPStrategy.prepare


def prepare_and_count(self, *args):
    """DDP as the strategy builds it, with a communication hook that counts the buckets it reduces."""
    prepared = prepare(self, *args)

    def counted(state, bucket):
        reductions.append(bucket.index())
        return allreduce_hook(state, bucket)

    self.ddp.register_comm_hook(None, counted)
    return prepared


DDPStrategy.prepare = prepare_and_count
# the process group outlives each run's `end_training` (which would destroy it): closed after the last
PartialState.destroy_process_group = lambda self, group=None: None
transfer_for = memory.transfer_for
write_manifest = state.write_manifest


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


rank = os.environ["RANK"]
for run in json.loads(open(sys.argv[1]).read()):
    out = run["out"]
    os.makedirs(out, exist_ok=True)
    overrides = ["log.tensorboard=false", f"save.output_dir='{out}'", *run["overrides"]]
    cfg = load_config(run["config"], overrides)
    trainer = trainer_class(cfg.model.architecture)(cfg)
    lines = []
    reductions.clear()
    memory.transfer_for = (lambda device: FakeTransfer()) if run.get("fake_device") else transfer_for
    state.write_manifest = full_disk if run.get("full_disk") and rank == "0" else write_manifest
    try:
        trainer.train(resume=run.get("resume"), log=lines.append)
    except Exception as e:  # noqa: BLE001 (the test reads what failed)
        with open(f"{out}/error{rank}.txt", "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        continue
    torch.save(trainer.history, f"{out}/history{rank}.pt")
    torch.save(len(reductions), f"{out}/reductions{rank}.pt")
    if rank == "0":
        with open(f"{out}/log.txt", "w") as f:
            f.write("\n".join(lines))
torch.distributed.barrier()
torch.distributed.destroy_process_group()
