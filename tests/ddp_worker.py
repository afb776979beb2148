"""Run by tests/test_ddp.py under torchrun: train, and dump each rank's trained weights."""

import os
import sys

import torch

from tuner.config import load_config
from tuner.trainers import checkpoints
from tuner.trainers.wan import WanTrainer

config, out = sys.argv[1], sys.argv[2]
original = checkpoints.Checkpoints.save


def save_and_dump(self, network, pos, *args, **kwargs):
    weights = {k: v.detach().clone() for k, v in self.accelerator.unwrap_model(network).state_dict().items()}
    torch.save(weights, f"{out}/rank{self.accelerator.process_index}.pt")
    return original(self, network, pos, *args, **kwargs)


checkpoints.Checkpoints.save = save_and_dump
cfg = load_config(config, ["log.tensorboard=false", f"save.output_dir='{out}'", "train.max_steps=3"])
trainer = WanTrainer(cfg)
trainer.train()
torch.save(trainer.history, f"{out}/history{os.environ['RANK']}.pt")
