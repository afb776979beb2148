"""Pipeline parallelism: the transformer's blocks split into stages, one per process, each batch flowing
through them in micro-batches (`distributed.strategy = "pipeline"`).

For models whose frozen weights do not fit one card even in fp8. The blocks are cut into as many
contiguous runs as there are processes, of about equal parameter count (`tuner.archs.stages`);
process r places only its run on its device. The embeddings before the blocks are the first stage's;
the small output layers after them stay on every process.

A diffusers transformer's forward is one function, so each architecture says how it comes apart
(`ArchitectureModel.pipeline_parts` → `PipelineParts`): a prologue (x_t, t, cond → the tensors the blocks
take), the blocks in order, how one block is called, and an epilogue (the last block's tensors → the
prediction `predict` returns). Only tensors pass from stage to stage.

One step, with torch.distributed.pipelining (a `PipelineStage` per process around a hand-built stage
module, and a schedule):

* every process reads the same batch (the stages split the model, not the data) and draws the same
  noise and timesteps from the step's seeded generator;
* the first stage is given the micro-batches' sample indices; its module runs the prologue on those
  samples and its blocks, and sends the carried tensors (and the indices) on; the middle stages run their
  blocks; the last runs its blocks, the epilogue and each micro-batch's loss, weighted by its share of
  the batch, so the gradients equal one process's on the whole batch;
* the schedule runs the micro-batches' forwards and backwards interleaved: 1F1B (one forward, one
  backward; at most as many micro-batches' activations as stages) when there are at least as many
  micro-batches as stages, else GPipe (all forwards, then all backwards);
* the loss goes from the last stage to every process (the progress bar shows it), the gradient norm is
  summed over stages before clipping, and each process steps its own adapters.

Adapters: every process builds the whole adapter (it is small), so its initial weights are a
one-process run's; each trains only the adapters of the blocks it holds (the others get no gradient and
no optimizer state). Before a save, the owners' adapter weights and optimizer state are gathered into
the main process, which writes the same adapter and state files as one process: resume (on any number of
processes), `tuner lora ...` and generation take them unchanged.

Memory: loading still reads the whole model on every process (host memory); the blocks of other stages
(and, after the first stage, the embeddings before the blocks) are never placed on the device and are
freed (moved to the meta device) as soon as the adapter exists.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tuner.archs.model import pipeline_unavailable
from tuner.archs.stages import Carried, PipelineParts, balanced_stages
from tuner.distributed import Strategy
from tuner.errors import ConfigError


def _refusals(trainer, cfg) -> list[tuple[str, str]]:
    """(key, why) for every setting of `cfg` pipeline stages cannot train with."""
    sc = cfg.sample
    wanted = [
        (cfg.memory.blocks_to_swap != 0, "memory.blocks_to_swap",
         "each stage keeps its own blocks on its device; spread the model over more processes instead"),
        (cfg.memory.activation_offload, "memory.activation_offload",
         "not combined with the stages' schedule yet; use train.gradient_checkpointing"),
        (cfg.train.fused_backward, "train.fused_backward",
         "the schedule runs the backward; gradients are clipped over all stages before any step"),
        (cfg.network.type == "full", "network.type",
         "stages train adapters; a full fine-tune splits with strategy = \"fsdp\" or \"deepspeed\""),
        (cfg.train.ema_decay, "train.ema_decay", "the EMA would follow only one stage's adapters"),
        (cfg.train.mixed_precision == "fp16", "train.mixed_precision",
         "fp16's gradient scaler does not scale the schedule's backward; use bf16"),
        (cfg.model.expert == "both", "model.expert",
         f"{trainer.architecture} trains two experts; stages split one transformer (train one expert)"),
        (bool(sc.prompts) and bool(sc.every_n_steps or sc.at_start), "sample.every_n_steps",
         "drawing samples needs the whole model on one process; draw them after training with tuner generate"),
        (any(spec.validation for spec in cfg.datasets), "a dataset's validation = true",
         "the validation loss is not computed through the stages yet; remove validation = true"),
    ]  # fmt: skip
    return [(key, why) for refused, key, why in wanted if refused]


@dataclass
class _Batch:
    """One batch as every stage holds it while the schedule runs."""

    trainer: object
    x0: torch.Tensor
    noise: torch.Tensor
    cond: dict  # with the loss's entries (loss_mask, loss_weight)
    noisy: torch.Tensor  # x_t, t and cond as `predict` is given them (`trainer.noised_inputs`)
    t: torch.Tensor
    inputs: dict
    group: int  # batches in this accumulation group


class _HeldElsewhere(nn.Module):
    """Stands in for a block another stage holds while the model is placed on the device."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this block is held by another pipeline stage")


class _StageModule(nn.Module):
    """One process's part of the forward: the first stage is given a micro-batch's sample indices and
    runs the prologue on those samples; every stage runs its blocks on the carried tensors. (The last
    stage's epilogue runs in the loss function, which is given the indices too: the schedule sizes the
    stages' inputs by a forward on placeholder tensors, so nothing but the first stage's input may index.)"""

    def __init__(self, pipeline: PipelineStrategy, blocks: range, adapters: list[nn.Module]):
        super().__init__()
        self.trained = nn.ModuleList(adapters)  # what the schedule sees as this stage's parameters
        self.pipeline, self.blocks = (pipeline,), blocks  # a tuple: not a submodule
        self.first = pipeline.rank == 0

    def forward(self, *carried: torch.Tensor) -> Carried:
        pipeline = self.pipeline[0]
        parts = pipeline.parts
        if self.first:
            carried = parts.prologue(*pipeline.rows(carried[0]))
        for i in self.blocks:
            carried = parts.run_block(parts.blocks[i], tuple(carried))
        return tuple(carried)


class PipelineStrategy(Strategy):
    name = "pipeline"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.rank = self.world = 0
        self.stages: list[range] = []  # the blocks each stage holds
        self.parts: PipelineParts | None = None
        self.stage_params: list[list[nn.Parameter]] = []  # per stage: its adapters' parameters
        self.module: _StageModule | None = None
        self.device: torch.device | None = None
        self._schedules: dict = {}  # (micro-batches, input shapes) -> schedule
        self._batch: _Batch | None = None  # the batch the schedule is running
        self._drop_foreign_state = True  # a resumed or gathered optimizer holds other stages' state

    # ---- before step 1 ----
    def accelerator_kwargs(self) -> dict:
        # accelerate steps a scheduler tied to the optimizer once per process (it assumes each process
        # adds a batch); the stages share one batch, so the schedule moves one step per optimizer step
        return {"step_scheduler_with_optimizer": False}

    def check(self, trainer, world_size: int) -> None:
        from tuner.archs.model import ArchitectureModel

        if type(trainer).pipeline_parts is ArchitectureModel.pipeline_parts:
            raise ConfigError(pipeline_unavailable(trainer.architecture))
        if refused := _refusals(trainer, self.cfg):
            key, why = refused[0]
            raise ConfigError(f"key 'distributed.strategy': \"pipeline\" cannot combine with {key}: {why}.")

    def data_share(self, accelerator) -> tuple[int, int]:
        return 0, 1  # every stage reads every batch

    @contextlib.contextmanager
    def placing(self, trainer, model) -> Iterator[None]:
        """Cut the blocks into stages; place only this stage's (the others, and after the first stage the
        prologue's modules, wait on the host until the adapter exists, then `prepare` frees them)."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        parts = trainer.pipeline_parts(model)
        blocks = parts.blocks
        if len(blocks) < self.world:
            raise ConfigError(
                f"key 'distributed.strategy': {trainer.architecture} has {len(blocks)} blocks, fewer than the "
                f"{self.world} pipeline stages (processes); start at most {len(blocks)} processes."
            )
        sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
        sizes[0] += sum(
            p.numel() for m in parts.prologue_modules for p in m.parameters()
        )  # the first stage's
        self.stages = balanced_stages(sizes, self.world)
        others = self._elsewhere(parts)
        slots = _slots(model, others)
        for (parent, key), _ in zip(slots, others, strict=True):
            parent._modules[key] = _HeldElsewhere()
        try:
            yield
        finally:
            for (parent, key), block in zip(slots, others, strict=True):
                parent._modules[key] = block

    def prepare(self, trainer, accelerator, model, trained, optimizer):
        self.parts = trainer.pipeline_parts(model)
        names = _names(model, self.parts.blocks)
        owners = {}  # adapter name -> its stage
        for stage, run in enumerate(self.stages):
            for i in run:
                owners.update({a.name: stage for a in trained if a.name.startswith(names[i] + ".")})
        if outside := [a.name for a in trained if a.name not in owners]:
            raise ConfigError(
                f"key 'network.include': pipeline stages train adapters inside the blocks only, and {outside[0]} "
                f"(and {len(outside) - 1} more) is outside them; exclude it (network.exclude)."
            )
        self.stage_params = [[p for a in trained if owners[a.name] == s for p in a.parameters()]
                             for s in range(self.world)]  # fmt: skip
        if empty := [s for s, params in enumerate(self.stage_params) if not params]:
            raise ConfigError(
                f"key 'network.include': pipeline stage {empty[0]} (blocks {_span(self.stages[empty[0]])}) holds "
                "no trained weights; adapt modules in every block or start fewer processes."
            )
        for module in self._elsewhere(self.parts):
            module.to("meta")  # frees its weights; a block's adapters stay, replicated, for the saves
        mine = [a for a in trained if owners[a.name] == self.rank]
        self.module = _StageModule(self, self.stages[self.rank], mine)
        self.device = accelerator.device
        self.optimizer = optimizer
        return model, trained, optimizer

    def _elsewhere(self, parts: PipelineParts) -> list[nn.Module]:
        """The modules this process does not run: the other stages' blocks, and the prologue's modules on
        every stage but the first."""
        others = [b for i, b in enumerate(parts.blocks) if i not in self.stages[self.rank]]
        return others if self.rank == 0 else others + list(parts.prologue_modules)

    # ---- one batch ----
    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The step's x_t, t and model cond for the samples `index` (a micro-batch)."""
        b = self._batch
        return b.noisy[index], b.t[index], {k: v[index] for k, v in b.inputs.items()}

    def loss(self, trainer, run, x0, noise, t, cond):
        """Forward and backward through the stages, one batch; returns its loss (from the last stage) on
        every process. The backward is scaled for the accumulation group, as `backward` would."""
        if self._drop_foreign_state:
            self._drop_foreign_optimizer_state(run.optimizer)
        start, end = run.groups[run.pos.batch]
        noisy, t, inputs = trainer.noised_inputs(x0, noise, t, cond)
        self._batch = _Batch(trainer, x0, noise, cond, noisy, t, inputs, end - start)
        losses = []  # the last stage's micro-batch losses, as `_microbatch_loss` returned them
        n = x0.shape[0]
        micro = min(self.cfg.distributed.pipeline_microbatches or self.world, n)
        index = torch.arange(n, device=x0.device)
        schedule = self._schedule(micro, (noisy, *inputs.values()))
        with run.accelerator.autocast():
            if self.rank == 0:
                schedule.step(index)
            elif self.rank == self.world - 1:
                schedule.step(target=index, losses=losses)
            else:
                schedule.step()
        self._batch = None
        total = torch.zeros((), device=x0.device)
        if losses:
            total = torch.stack([loss.detach() for loss in losses]).sum() * (end - start)
        dist.broadcast(total, src=self.world - 1)
        return total

    def _microbatch_loss(self, carried: Carried, index: torch.Tensor) -> torch.Tensor:
        """The last stage's epilogue and loss of the micro-batch `index`, weighted by its share of the
        batch (per-sample losses are averaged over the batch) and, for the backward only, by 1 / the
        accumulation group's size."""
        b = self._batch
        pred = self.parts.epilogue(carried, *self.rows(index))
        rows = {k: v[index] for k, v in b.cond.items()}
        loss = b.trainer.prediction_loss(pred, b.x0[index], b.noise[index], b.t[index], rows)
        return loss * (index.numel() / b.x0.shape[0] / b.group)

    def _schedule(self, micro: int, inputs: tuple[torch.Tensor, ...]):
        """The schedule for this many micro-batches of inputs of these shapes (the stages' receive
        buffers are sized by the first micro-batch, so each new shape gets its own)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        key = (micro, *(tuple(x.shape) for x in inputs))
        if key not in self._schedules:
            stage = PipelineStage(self.module, self.rank, self.world, self.device)
            kind = Schedule1F1B if micro >= self.world else ScheduleGPipe
            # scale_grads=False: `_microbatch_loss` weights each micro-batch by its share already
            self._schedules[key] = kind(stage, micro, loss_fn=self._microbatch_loss, scale_grads=False)
        return self._schedules[key]

    def backward(self, run, loss) -> None:
        pass  # the schedule ran it inside `loss`

    def reduce_gradients(self, run) -> None:
        """Clip by the norm of all stages' gradients together (each stage holds a part of them); a
        non-finite norm anywhere makes every stage's gradient non-finite, so they all skip the step."""
        grads = [p.grad for p in self.stage_params[self.rank] if p.grad is not None]
        squares = sum((g.float().square().sum() for g in grads), torch.zeros((), device=self.device))
        dist.all_reduce(squares)
        norm = squares.sqrt()
        if not torch.isfinite(norm):
            for g in grads:
                g.fill_(math.nan)
            return
        max_norm = self.cfg.train.max_grad_norm
        if max_norm > 0:  # the formula of torch.nn.utils.clip_grad_norm_, on the whole norm
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))

    # ---- saving ----
    @contextlib.contextmanager
    def whole_state(self, trained) -> Iterator[None]:
        """Around a save (and a resume, harmlessly): every stage's adapter weights to every process, so the
        replicated adapter is whole, and its optimizer state to the main process (dropped again before the
        next step)."""
        self._gather()
        yield

    @torch.no_grad()
    def _gather(self) -> None:
        for stage, params in enumerate(self.stage_params):
            for p in params:
                dist.broadcast(p.data, src=stage)
        if not self.cfg.save.save_state:
            return  # only the adapter file is written
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        order = [p for group in inner.param_groups for p in group["params"]]
        position = {id(p): i for i, p in enumerate(order)}
        mine = {position[id(p)]: {k: (v.cpu(), v.device.type == "cpu") if torch.is_tensor(v) else (v, None)
                                  for k, v in inner.state[p].items()}
                for p in self.stage_params[self.rank] if p in inner.state}  # fmt: skip
        states = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, states, dst=0)
        if self.rank == 0:
            for state in states[1:]:
                for i, entries in state.items():
                    p = order[i]
                    inner.state[p] = {k: v if on_host is None else v.to("cpu" if on_host else p.device)
                                      for k, (v, on_host) in entries.items()}  # fmt: skip
            self._drop_foreign_state = True

    def _drop_foreign_optimizer_state(self, optimizer) -> None:
        """Forget the optimizer state of other stages' adapters (a resumed state holds all of it)."""
        inner = getattr(optimizer, "optimizer", optimizer)
        for stage, params in enumerate(self.stage_params):
            if stage != self.rank:
                for p in params:
                    inner.state.pop(p, None)
        self._drop_foreign_state = False

    # ---- what it plans ----
    def plan(self, trainer, accelerator, model, trained, optimizer) -> str:
        """Every stage's blocks and bytes (gathered, so the main process prints them all)."""
        blocks = self.parts.blocks
        mine = stage_memory(model, self.stage_params[self.rank], optimizer, planned=True)
        mine["parameters"] = sum(p.numel() for i in self.stages[self.rank] for p in blocks[i].parameters())
        every = [None] * self.world
        dist.all_gather_object(every, mine)
        micro = self.cfg.distributed.pipeline_microbatches or self.world
        total = sum(f["parameters"] for f in every)
        lines = [
            f"distributed: pipeline, {self.world} stages over {len(blocks)} blocks ({total / 1e6:.2f}M "
            f"parameters), {micro} micro-batches per batch ({'1F1B' if micro >= self.world else 'GPipe'})"
        ]
        for stage, f in enumerate(every):
            mb = {k: v / 2**20 for k, v in f.items()}
            lines.append(
                f"  stage {stage}: blocks {_span(self.stages[stage])} ({f['parameters'] / 1e6:.2f}M); model "
                f"weights {mb['frozen']:.2f} MB, trained {mb['trained']:.3f} MB, gradients "
                f"{mb['gradients']:.3f} MB, optimizer state {mb['optimizer']:.3f} MB"
            )
        lines.append(
            "  (each process also keeps the other stages' adapters, untrained, for the saves; loading reads "
            "the whole model into host memory before the blocks of other stages are freed)"
        )
        return "\n".join(lines)


def stage_memory(
    model: nn.Module, trained: list[nn.Parameter], optimizer, planned: bool = False
) -> dict[str, int]:
    """This process's bytes: the model weights it holds (the other stages' blocks are on the meta device),
    its stage's trained weights, their gradients (what a backward allocates) and the optimizer state of
    those weights: the tensors the optimizer holds, or with `planned` (before step 1, when it holds none)
    what one step of the same optimizer allocates per weight, measured on a probe."""
    inner = getattr(optimizer, "optimizer", optimizer)
    weights = sum(p.numel() * p.element_size() for p in trained)
    if planned:
        state = sum(p.numel() for p in trained) * _state_bytes_per_weight(inner, trained[0])
    else:
        state = sum(v.numel() * v.element_size() for p in trained for v in inner.state.get(p, {}).values()
                    if torch.is_tensor(v))  # fmt: skip
    return {
        "frozen": sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta),
        "trained": weights,
        "gradients": weights,
        "optimizer": int(state),
    }


def _state_bytes_per_weight(optimizer, like: nn.Parameter, probe: int = 1 << 16) -> float:
    """Optimizer-state bytes per trained weight: one step of a fresh optimizer of the same class and
    settings on a probe of `probe` weights like `like` (large enough for 8-bit optimizers' blocks)."""
    weight = nn.Parameter(torch.zeros(probe, dtype=like.dtype, device=like.device))
    weight.grad = torch.full_like(weight, 1e-3)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    fresh = type(optimizer)([weight], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    fresh.step()
    held = sum(v.numel() * v.element_size() for v in fresh.state[weight].values() if torch.is_tensor(v))
    return held / probe


def _names(model: nn.Module, modules: list[nn.Module]) -> list[str]:
    """The module names of `modules` inside `model`."""
    by_id = {id(m): name for name, m in model.named_modules()}
    return [by_id[id(m)] for m in modules]


def _slots(model: nn.Module, modules: list[nn.Module]) -> list[tuple[nn.Module, str]]:
    """(parent, key) where each of `modules` sits in `model`."""
    slots = []
    for name in _names(model, modules):
        parent, _, key = name.rpartition(".")
        slots.append((model.get_submodule(parent), key))
    return slots


def _span(run: range) -> str:
    return f"{run.start}-{run.stop - 1}" if len(run) > 1 else str(run.start)
