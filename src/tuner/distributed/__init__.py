"""Training on several processes: how they share the model, the gradients and the optimizer.

`[distributed] strategy` picks one `Strategy`; the training loop (`trainers/base.py`) talks to it at a
few named points and never branches on the strategy itself:

    accelerator_kwargs()      what `Accelerator(...)` is built with (an FSDP or DeepSpeed plugin)
    check(...)                refusals of settings the strategy cannot combine with, before step 1
    data_share(accelerator)   which share of the batches this process reads (rank, of how many)
    placing(trainer, model)   the context the model is placed on the device in (pipeline: its stage only)
    prepare(...)              wrap the model / trained weights / optimizer once they exist
    accumulating(run, last)   the context one batch's forward and backward run in (no gradient sync
                              on batches that are not the last of their accumulation group)
    loss(trainer, run, ...)   one batch's loss (pipeline: forward and backward through the stages)
    backward(run, loss)       backpropagate one batch's loss
    reduce_gradients(run)     after a group's last backward: gradients equal on every process
    gather(run)               before a save: the main process holds every process's trained weights
    plan(...)                 one line: the strategy and the per-process memory it plans

One process (or `strategy = "ddp"` with a single process) does nothing extra. Each strategy lives in its
own module (`ddp.py`, `fsdp.py`, `deepspeed.py`, `pipeline.py`), imported only when picked.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from tuner.errors import ConfigError

# strategy name -> "module:Class" (imported when picked, so a DeepSpeed-less install trains with DDP)
STRATEGIES = {
    "ddp": "tuner.distributed.ddp:DDPStrategy",
    "pipeline": "tuner.distributed.pipeline:PipelineStrategy",
}


class Strategy:
    """What every strategy answers; the defaults are one process's behaviour."""

    name = "single"

    def __init__(self, cfg):
        self.cfg = cfg

    def accelerator_kwargs(self) -> dict[str, Any]:
        return {}

    def check(self, trainer, world_size: int) -> None:
        """Raise a ConfigError naming both settings when this strategy cannot run with the config."""

    def data_share(self, accelerator) -> tuple[int, int]:
        """(this process's index, how many processes) that `open_training_data` shards batches over."""
        return accelerator.process_index, accelerator.num_processes

    @contextlib.contextmanager
    def placing(self, trainer, model) -> Iterator[None]:
        """The context `apply_memory` places the loaded model on the device in."""
        yield

    def prepare(self, trainer, accelerator, model, trained, optimizer):
        """Return (model, trained, optimizer), wrapped as the strategy needs."""
        return model, trained, optimizer

    @contextlib.contextmanager
    def accumulating(self, run, last: bool) -> Iterator[None]:
        yield

    def loss(self, trainer, run, x0, noise, t, cond):
        """One batch's loss (a tensor; `backward` is given it)."""
        return trainer.loss(run.model, x0, noise, t, cond, run.accelerator)

    def backward(self, run, loss) -> None:
        run.accelerator.backward(loss)

    def reduce_gradients(self, run) -> None:
        pass

    def gather(self, run) -> None:
        """Before a save: make the main process's trained weights and optimizer state the whole run's."""

    def plan(self, trainer, accelerator, model, trained, optimizer) -> str:
        return ""


def strategy_for(cfg, num_processes: int) -> Strategy:
    """The configured strategy, or the plain one-process behaviour when there is one process."""
    name = cfg.distributed.strategy
    if num_processes == 1:
        return Strategy(cfg)
    if name not in STRATEGIES:
        raise ConfigError(
            f"key 'distributed.strategy': unknown strategy {name!r}; one of {sorted(STRATEGIES)}."
        )
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)(cfg)
