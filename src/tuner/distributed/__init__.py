"""Training on several processes: how they share the model, the gradients and the optimizer.

`[distributed] strategy` picks one `Strategy`; the training loop (`trainers/base.py`) talks to it at a
few named points and never branches on the strategy itself:

    accelerator_kwargs()      what `Accelerator(...)` is built with (an FSDP or DeepSpeed plugin)
    check(...)                refusals of settings the strategy cannot combine with, before step 1
    data_share(accelerator)   which share of the batches this process reads (rank, of how many)
    loading(trainer)          the context the model is loaded in (pipeline: its stage's tensors only)
    placing(trainer, model)   the context the model is placed on the device in (pipeline: its stage only)
    prepare(...)              wrap the model / trained weights / optimizer once they exist
    loss(trainer, run, ...)   one batch's training loss (`trainer.loss`; DDP runs it inside its wrapper)
    accumulating(run, last)   the context one batch's forward and backward run in (no gradient sync
                              on batches that are not the last of their accumulation group)
    loss(trainer, run, ...)   one batch's loss (pipeline: forward and backward through the stages)
    held_out_loss(...)        one held-out batch's loss, without gradients (validation)
    backward(run, loss)       backpropagate one batch's loss
    reduce_gradients(run)     after a group's last backward: gradients equal on every process
    mean_loss(run, value)     a step's loss averaged over the processes that share the batches (logged)
    grad_norm(run, max_norm)  clip the gradients and return their norm (None: the engine owns it)
    whole_state(trained)      the context a save or a resume runs in (sharded or staged weights gathered)
    plan(...)                 one line: the strategy and the per-process memory it plans
    full_state_dict(part)     a state part (network, optimizer, ...) as a one-process run saves it
    load_full_state_dict(...) such a saved state back into the part (on every process)
    full_weights(network)     while open, the main process's network holds its whole weights (export)

One process (or `strategy = "ddp"` with a single process) does nothing extra. Each strategy lives in its
own module (`ddp.py`, `fsdp.py`, `deepspeed.py`, `pipeline.py`), imported only when picked.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tuner.errors import ConfigError

# strategy name -> "module:Class" (imported when picked, so a DeepSpeed-less install trains with DDP)
STRATEGIES = {
    "ddp": "tuner.distributed.ddp:DDPStrategy",
    "fsdp": "tuner.distributed.fsdp:FSDPStrategy",
    "deepspeed": "tuner.distributed.deepspeed:DeepSpeedStrategy",
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
    def loading(self, trainer) -> Iterator[None]:
        """The context `trainer.load_transformer` runs in."""
        yield

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
        """One training batch's loss: the trainer's own (`ArchitectureModel.loss` or an architecture's
        override) on the model. A strategy that must see the forward (DDP) runs the same call inside its
        wrapper."""
        return trainer.loss(run.model, x0, noise, t, cond, run.accelerator)

    def held_out_loss(self, trainer, run, x0, noise, t, cond):
        """One held-out batch's loss (no gradients), on every process."""
        return trainer.loss(run.model, x0, noise, t, cond, run.accelerator)

    def backward(self, run, loss) -> None:
        run.accelerator.backward(loss)

    def reduce_gradients(self, run) -> None:
        pass

    def mean_loss(self, run, value: float) -> float:
        """This process's step loss averaged over the processes that read shares of the global batch: the
        loss one process with the whole batch has (a pipeline's stages all compute that one already). Every
        process calls it once per optimizer step; the sum is taken in float64, as one process sums."""
        shares = self.data_share(run.accelerator)[1]
        if shares == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64, device=run.accelerator.device)
        torch.distributed.all_reduce(total)
        return total.item() / shares

    def grad_norm(self, run, max_norm: float) -> float | None:
        """Clip the trained gradients to `max_norm` (if > 0) and return their total norm; None where an
        engine or a gradient scaler owns the check for non-finite gradients (it skips those steps)."""
        params = [p for p in run.trained_params if p.grad is not None]
        accelerator = run.accelerator
        if max_norm > 0:
            norm = accelerator.clip_grad_norm_(params, max_norm)
        elif accelerator.scaler is None and params:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        else:
            return None
        if accelerator.scaler is not None or norm is None:
            return None  # a gradient scaler (fp16) owns overflow: it skips those steps and lowers its scale
        return float(norm)  # after backward and loss.item(), the device is idle: this sync costs ~nothing

    @contextlib.contextmanager
    def whole_state(self, trained) -> Iterator[None]:
        """The context every process runs a save or a resume in: the trained weights and the optimizer
        state are whole inside it (a sharding strategy gathers them), and what a resume loads into them
        is kept when it closes."""
        yield

    def plan(self, trainer, accelerator, model, trained, optimizer) -> str:
        """The strategy and what each process holds (`accounting.memory_plan`, from the real tensors);
        one process holds everything. Strategies that shard say what share each process keeps."""
        from tuner.distributed.accounting import memory_plan

        n = accelerator.num_processes
        who = "one process:" if n == 1 else f"{self.name} on {n} processes; per process:"
        plan = memory_plan(model, trained, optimizer, accelerator.device)
        return f"  distributed           {who} {plan.describe()}"

    def full_state_dict(self, part) -> Any:
        """Called on every process; the main process's result is what the state files hold."""
        return part.state_dict()

    def load_full_state_dict(self, part, tree) -> None:
        part.load_state_dict(tree)

    @contextlib.contextmanager
    def full_weights(self, network) -> Iterator[None]:
        """Entered by every process around the export of the adapter (or model) file."""
        yield


class PredictModule(nn.Module):
    """The model and what trains on it as one module whose forward is the trainer's `predict`. An engine
    that must own a module and see each forward (DeepSpeed's) wraps this; `ArchitectureModel.loss` calls a
    model marked `runs_predict` with (noisy, t, cond) instead of calling `predict` on it."""

    runs_predict = True

    def __init__(self, trainer, model: nn.Module, trained: nn.Module, autocast=None):
        super().__init__()
        self.model = model
        self.trained = trained  # the adapter's modules run from inside the model's layers
        self.trainer = trainer  # not a module: its parameters are the model's
        self.autocast = autocast or contextlib.nullcontext

    def forward(self, noisy, t, cond):
        with self.autocast():
            return self.trainer.predict(self.model, noisy, t, cond)


def owned_model(model: nn.Module) -> nn.Module:
    """The model itself where an engine owns it through a `PredictModule` (for what runs outside the
    engine, such as samples drawn by the main process), else `model`."""
    owner = getattr(model, "module", None)
    return owner.model if isinstance(owner, PredictModule) else model


def launched_processes() -> int:
    """How many processes the launcher started (accelerate launch / torchrun set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


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
