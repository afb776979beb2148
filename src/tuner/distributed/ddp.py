"""DDP: every process holds the whole model and trains on its own share of each global batch; torch's
`DistributedDataParallel` averages the trained gradients while backward still runs.

How it overlaps. DDP groups the trained parameters into buckets (25 MiB each, in roughly the reverse
order backward reaches them). As soon as every gradient of a bucket is computed, an asynchronous
all-reduce of that bucket starts, and backward goes on with the next blocks; by the time backward ends,
most of the communication is done. The hand-written alternative (one all-reduce of every gradient after
backward) waits for all of it at the end.

What DDP wraps. Not the model: an architecture's `predict` reads attributes of the model it is given
(`model.config`, a two-expert model's `activate`), which a DDP wrapper would hide. DDP wraps `_Loss`, a
small module whose forward is the trainer's own loss of one batch (`ArchitectureModel.loss`, or an
architecture's override) and whose only registered child is what trains: the adapter network, or for a
full fine-tune `FullNetwork` (the model itself). The frozen base model is held outside the module tree,
so its weights are none of DDP's parameters or buffers: never broadcast at start, never reduced, and
block swap may move its blocks between devices as it likes. The adapters are called from inside the
base model's forward (hooks on its linear layers); DDP only needs their gradients to appear during
backward, which they do.

Settings:
- `find_unused_parameters=True`: a step may leave some trained weights without a gradient (module
  dropout skips whole adapters, a two-expert batch may reach one expert only, a full fine-tune holds
  layers the model's forward never calls). A weight unused on one process is reduced as a zero
  gradient there (as one process with the whole batch would see it: those samples add nothing); one
  unused on every process keeps no gradient, as in a one-process run. The cost is one walk over the
  autograd graph per step.
- Gradient checkpointing: diffusers checkpoints with `use_reentrant=False`, under which DDP's hooks
  fire once per parameter as usual; no `static_graph` is needed (and module dropout would break it).
- `gradient_as_bucket_view=True`: the gradients are views into DDP's buckets, not a second copy.
- Accumulation: the batches of a group before its last run under `no_sync`, so gradients add up
  locally and are reduced once, with the group's last backward.
- The starting weights: an adapter is broadcast from process 0 (small; it also checks that every
  process built the same shapes); a full fine-tune's weights are not (every process loaded the same
  file, and broadcasting a 14B model would take longer than loading it).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn

from tuner.distributed import Strategy
from tuner.errors import ConfigError


class _Loss(nn.Module):
    """The loss of one batch as a module: what trains is its only registered child; the model, the
    trainer and the accelerator are held in a tuple, outside the module tree DDP walks."""

    def __init__(self, trainer, model: nn.Module, trained: nn.Module, accelerator):
        super().__init__()
        self.trained = trained
        self._context = (trainer, model, accelerator)

    def forward(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        trainer, model, accelerator = self._context
        return trainer.loss(model, x0, noise, t, cond, accelerator)


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.ddp: nn.parallel.DistributedDataParallel | None = None

    def check(self, trainer, world_size: int) -> None:
        if self.cfg.train.fused_backward:
            raise ConfigError(
                "key 'train.fused_backward' with distributed.strategy = 'ddp' on "
                f"{world_size} processes: each parameter would step inside backward before DDP has "
                "averaged its gradient over the processes. Turn train.fused_backward off, or train in one "
                "process."
            )

    def prepare(self, trainer, accelerator, model, trained, optimizer):
        ddp = nn.parallel.DistributedDataParallel
        accepts = inspect.signature(ddp).parameters
        options = {}
        # no buffer is broadcast before each forward: what trains holds no running statistics (torch 2.13
        # renamed the switch; the old name still works there, with a warning)
        options["forward_sync_buffers" if "forward_sync_buffers" in accepts else "broadcast_buffers"] = False
        if "init_sync" in accepts:  # torch >= 2.6; before, a full fine-tune's weights are broadcast too
            options["init_sync"] = self.cfg.network.type != "full"
        self.ddp = ddp(
            _Loss(trainer, model, trained, accelerator),
            device_ids=None,  # the inputs are on the device already; the module may span devices
            find_unused_parameters=True,
            gradient_as_bucket_view=True,
            **options,
        )
        return model, trained, optimizer

    def loss(self, trainer, run, x0, noise, t, cond) -> torch.Tensor:
        return self.ddp(x0, noise, t, cond)

    @contextlib.contextmanager
    def accumulating(self, run, last: bool) -> Iterator[None]:
        with contextlib.nullcontext() if last else self.ddp.no_sync():
            yield

    def plan(self, trainer, accelerator, model, trained, optimizer) -> str:
        return super().plan(trainer, accelerator, model, trained, optimizer) + (
            "; the whole model on every process, gradients averaged in 25 MiB buckets while backward runs"
        )
