"""Pipeline parallelism: the transformer's blocks split into stages, one per process, each batch flowing
through them in micro-batches (`distributed.strategy = "pipeline"`).

For models whose frozen weights do not fit one card even in fp8. The blocks are cut into as many
contiguous runs as there are stages (`distributed.pipeline_stages`, by default one per process), of about
equal parameter count (`tuner.archs.stages`); stage s places only its run on its device. The embeddings
before the blocks are the first stage's; the small output layers after them stay on every process.

Pipeline × data parallel: with fewer stages than processes, the processes form `Grid`s of stages ×
replicas, laid out as DeepSpeed's pipeline engine lays them out (rank = stage · replicas + replica). Each
replica is a whole pipeline that reads its share of the batches, as DDP's processes do; after the
backward the replicas of a stage average its gradients, so the step equals one process accumulating the
replicas' batches.

A diffusers transformer's forward is one function, so each architecture says how it comes apart
(`ArchitectureModel.pipeline_parts` → `PipelineParts`): a prologue (x_t, t, cond → the tensors the blocks
take), the blocks in order, how one block is called, and an epilogue (the last block's tensors → the
prediction `predict` returns). Only tensors pass from stage to stage.

One step, with torch.distributed.pipelining (a `PipelineStage` per process around a hand-built stage
module, and a schedule):

* the stages of a replica read the same batch (the stages split the model, not the data) and draw the
  same noise and timesteps from the batch's seeded generator;
* the first stage is given the micro-batches' sample indices; its module runs the prologue on those
  samples and its blocks, and sends the carried tensors (and the indices) on; the middle stages run their
  blocks; the last runs its blocks, the epilogue and each micro-batch's loss, weighted by its share of
  the batch, so the gradients equal one process's on the whole batch;
* the schedule runs the micro-batches' forwards and backwards interleaved: 1F1B (one forward, one
  backward; at most as many micro-batches' activations as stages) when there are at least as many
  micro-batches as stages, else GPipe (all forwards, then all backwards);
* the loss goes from the last stage to every stage of its replica and is averaged over the replicas
  (the progress bar shows it); the gradients are averaged over a stage's replicas, their norm summed over
  stages before clipping, and each process steps its own adapters.

Block swap inside a stage (`memory.blocks_to_swap` counts the stage's own blocks: `BlockSwap` skips the
stand-ins for other stages' blocks) is told each micro-batch's forward begins, since the model itself is
never called. Validation runs the held-out batches' forward alone through the stages (`held_out_loss`).

Adapters: every process builds the whole adapter (it is small), so its initial weights are a
one-process run's; each trains only the adapters of the blocks it holds (the others get no gradient and
no optimizer state). Before a save, the owners' adapter weights and optimizer state are gathered into
the main process, which writes the same adapter and state files as one process: resume (on any number of
processes), `tuner lora ...` and generation take them unchanged.

Memory: no process holds the whole model. Each loads only its stage's tensors (`loading`: the shared
diffusers loaders of `tuner.models.loading` build the model on the meta device and fill only the modules
this stage runs; a diffusers folder's safetensors files give only those tensors' bytes, a single file is
mapped and converted, and the tensors of other stages are dropped before the model exists). The blocks of
other stages (and, after the first stage, the embeddings before the blocks) stay on the meta device; their
adapters are built on the host (every process holds the whole adapter). An architecture whose loader
does not go through those loaders loads whole, and the modules of other stages are freed (moved to the
meta device) as soon as the adapter exists.
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
from tuner.archs.stages import Carried, PipelineParts, cut_stages
from tuner.distributed import Strategy
from tuner.errors import ConfigError
from tuner.offload.blockswap import BlockSwap


def _refusals(trainer, cfg) -> list[tuple[str, str]]:
    """(key, why) for every setting of `cfg` pipeline stages cannot train with."""
    sc = cfg.sample
    wanted = [
        (cfg.memory.activation_offload, "memory.activation_offload",
         "not combined with the stages' schedule yet; use train.gradient_checkpointing"),
        (cfg.train.fused_backward, "train.fused_backward",
         "the schedule runs the backward; gradients are clipped over all stages before any step"),
        (cfg.network.type == "full", "network.type",
         "stages train adapters inside their blocks; a full fine-tune also trains the layers outside them and "
         "saves the whole model from one process: split it with strategy = \"fsdp\" or \"deepspeed\""),
        (cfg.train.ema_decay, "train.ema_decay", "the EMA would follow only one stage's adapters"),
        (cfg.train.mixed_precision == "fp16", "train.mixed_precision",
         "fp16's gradient scaler does not scale the schedule's backward; use bf16"),
        (cfg.model.expert == "both", "model.expert",
         f"{trainer.architecture} trains two experts; stages split one transformer (train one expert)"),
        (bool(sc.prompts) and bool(sc.every_n_steps or sc.at_start), "sample.every_n_steps",
         "drawing samples needs the whole model on one process; draw them after training with tuner generate"),
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
        self.first = pipeline.stage == 0

    def forward(self, *carried: torch.Tensor) -> Carried:
        pipeline = self.pipeline[0]
        parts = pipeline.parts
        for swap in pipeline.swaps:  # block swap inside the stage: a micro-batch's forward begins
            swap.forward_starts()
        if self.first:
            carried = parts.prologue(*pipeline.rows(carried[0]))
        for i in self.blocks:
            carried = parts.run_block(parts.blocks[i], tuple(carried))
        return tuple(carried)


@dataclass(frozen=True)
class Grid:
    """The processes as stages × replicas, laid out as DeepSpeed's pipeline engine lays them out
    (`PipeDataParallelTopology` in deepspeed/runtime/pipe/topology.py: axes pipe then data, row-major, so
    the replicas of one stage are adjacent ranks): rank = stage · replicas + replica. Each replica is a
    whole pipeline reading its share of the batches; the replicas of a stage average its gradients."""

    stages: int
    replicas: int

    @classmethod
    def of(cls, processes: int, stages: int) -> Grid:
        """The grid of `processes` with `stages` stages (0: one per process), or a ConfigError."""
        stages = stages or processes
        if stages < 2 or processes % stages:
            raise ConfigError(
                f"key 'distributed.pipeline_stages': {stages} stages do not divide {processes} processes into "
                "replicas of at least two stages; set a divisor of the process count above 1 (0: one stage per "
                "process)."
            )
        return cls(stages, processes // stages)

    def stage(self, rank: int) -> int:
        return rank // self.replicas

    def replica(self, rank: int) -> int:
        return rank % self.replicas

    def rank(self, stage: int, replica: int) -> int:
        return stage * self.replicas + replica

    def pipeline(self, replica: int) -> list[int]:
        """The ranks of one replica's stages, in stage order (they send each other activations)."""
        return [self.rank(s, replica) for s in range(self.stages)]

    def replicas_of(self, stage: int) -> list[int]:
        """The ranks holding one stage (they average its gradients)."""
        return [self.rank(stage, r) for r in range(self.replicas)]


class PipelineStrategy(Strategy):
    name = "pipeline"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.stage = self.num_stages = 0  # this process's stage, of how many
        self.grid = Grid(1, 1)
        self.replica = 0
        self.pipe_group = self.replica_group = None  # this replica's stages; this stage's replicas
        self.stages: list[range] = []  # the blocks each stage holds
        self.parts: PipelineParts | None = None
        self.stage_params: list[list[nn.Parameter]] = []  # per stage: its adapters' parameters
        self.module: _StageModule | None = None
        self.device: torch.device | None = None
        self._schedules: dict = {}  # (micro-batches, input shapes) -> schedule
        self._batch: _Batch | None = None  # the batch the schedule is running
        self._drop_foreign_state = True  # a resumed or gathered optimizer holds other stages' state
        self.loaded_own_blocks = False  # the loader read only this stage's tensors (`loading`)
        self.swaps: list[BlockSwap] = []  # block swap streaming this stage's blocks (memory.blocks_to_swap)

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
        self.grid = Grid.of(world_size, self.cfg.distributed.pipeline_stages)

    def data_share(self, accelerator) -> tuple[int, int]:
        """The stages of a replica read the same batches; the replicas share them out."""
        return self.grid.replica(accelerator.process_index), self.grid.replicas

    def _join_grid(self) -> None:
        """This process's place in the grid and its two process groups (every process creates every
        group, in the same order, as `new_group` requires)."""
        rank, grid = dist.get_rank(), self.grid
        self.stage, self.num_stages, self.replica = grid.stage(rank), grid.stages, grid.replica(rank)
        if grid.replicas == 1:
            return  # the one pipeline is the default group
        pipes = [dist.new_group(grid.pipeline(r)) for r in range(grid.replicas)]
        replicas = [dist.new_group(grid.replicas_of(s)) for s in range(grid.stages)]
        self.pipe_group, self.replica_group = pipes[self.replica], replicas[self.stage]

    def _peer(self, stage: int) -> int:
        """The global rank of `stage` in this process's pipeline."""
        return self.grid.rank(stage, self.replica)

    def mean_loss(self, run, value: float) -> float:
        """The replicas' losses averaged (the stages of a replica all hold its loss already)."""
        if self.grid.replicas == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.replica_group)
        return total.item() / self.grid.replicas

    @contextlib.contextmanager
    def loading(self, trainer) -> Iterator[None]:
        """Load only this stage's tensors: the loaders build the model on the meta device and leave the
        blocks of other stages (and, after the first stage, the prologue's modules) there."""
        from tuner.models.loading import loading_only

        self._join_grid()
        with loading_only(lambda model: self.not_held(trainer, model)):
            yield

    def not_held(self, trainer, model: nn.Module) -> list[nn.Module]:
        """The modules of `model` (built empty by a loader) that this stage does not run; none for a model
        that is not the transformer (an auxiliary model its loader builds, read whole)."""
        try:
            parts = trainer.pipeline_parts(model)
        except AttributeError:
            return []
        self.loaded_own_blocks = True
        return self._elsewhere(self._cut(trainer, parts))

    def _cut(self, trainer, parts: PipelineParts) -> PipelineParts:
        """Cut `parts`' blocks into this run's stages (`self.stages`); return `parts`."""
        if len(parts.blocks) < self.num_stages:
            raise ConfigError(
                f"key 'distributed.pipeline_stages': {trainer.architecture} has {len(parts.blocks)} blocks, fewer "
                f"than the {self.num_stages} pipeline stages; use at most {len(parts.blocks)} stages (fewer "
                "processes, or set distributed.pipeline_stages)."
            )
        self.stages = cut_stages(parts, self.num_stages)
        return parts

    @contextlib.contextmanager
    def placing(self, trainer, model) -> Iterator[None]:
        """Place only this stage's blocks on the device: the others (and after the first stage the
        prologue's modules) were left on the meta device by `loading`, or, where the architecture's loader
        read them whole, wait on the host until the adapter exists and `prepare` frees them."""
        parts = self._cut(trainer, trainer.pipeline_parts(model))
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
                             for s in range(self.num_stages)]  # fmt: skip
        if empty := [s for s, params in enumerate(self.stage_params) if not params]:
            raise ConfigError(
                f"key 'network.include': pipeline stage {empty[0]} (blocks {_span(self.stages[empty[0]])}) holds "
                "no trained weights; adapt modules in every block or start fewer processes."
            )
        for module in self._elsewhere(self.parts):
            module.to("meta")  # frees its weights; a block's adapters stay, replicated, for the saves
        mine = [a for a in trained if owners[a.name] == self.stage]
        swaps = (BlockSwap.streaming(self.parts.blocks[i]) for i in self.stages[self.stage])
        self.swaps = list({id(s): s for s in swaps if s is not None}.values())
        self.module = _StageModule(self, self.stages[self.stage], mine)
        self.device = accelerator.device
        self.optimizer = optimizer
        return model, trained, optimizer

    def _elsewhere(self, parts: PipelineParts) -> list[nn.Module]:
        """The modules this process does not run: the other stages' blocks, and the prologue's modules on
        every stage but the first."""
        others = [b for i, b in enumerate(parts.blocks) if i not in self.stages[self.stage]]
        return others if self.stage == 0 else others + list(parts.prologue_modules)

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
        return self._through_stages(trainer, run, x0, noise, t, cond, end - start, backward=True)

    def held_out_loss(self, trainer, run, x0, noise, t, cond):
        """A held-out batch's loss: the forward alone through the stages (the schedule's `eval`)."""
        return self._through_stages(trainer, run, x0, noise, t, cond, 1, backward=False)

    def _through_stages(self, trainer, run, x0, noise, t, cond, group: int, backward: bool) -> torch.Tensor:
        """Run one batch through the schedule (forward and backward, or the forward alone); its loss, from
        the last stage, on every stage of this pipeline."""
        noisy, t, inputs = trainer.noised_inputs(x0, noise, t, cond)
        self._batch = _Batch(trainer, x0, noise, cond, noisy, t, inputs, group)
        losses = []  # the last stage's micro-batch losses, as `_microbatch_loss` returned them
        n = x0.shape[0]
        micro = min(self.cfg.distributed.pipeline_microbatches or self.num_stages, n)
        index = torch.arange(n, device=x0.device)
        schedule = self._schedule(micro, (noisy, *inputs.values()))
        run_schedule = schedule.step if backward else schedule.eval
        with run.accelerator.autocast():
            if self.stage == 0:
                run_schedule(index)
            elif self.stage == self.num_stages - 1:
                run_schedule(target=index, losses=losses)
            else:
                run_schedule()
        self._batch = None
        total = torch.zeros((), device=x0.device)
        if losses:
            total = torch.stack([loss.detach() for loss in losses]).sum() * group
        dist.broadcast(total, src=self._peer(self.num_stages - 1), group=self.pipe_group)
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
            stage = PipelineStage(
                self.module, self.stage, self.num_stages, self.device, group=self.pipe_group
            )
            kind = Schedule1F1B if micro >= self.num_stages else ScheduleGPipe
            # scale_grads=False: `_microbatch_loss` weights each micro-batch by its share already
            self._schedules[key] = kind(stage, micro, loss_fn=self._microbatch_loss, scale_grads=False)
        return self._schedules[key]

    def backward(self, run, loss) -> None:
        pass  # the schedule ran it inside `loss`

    def reduce_gradients(self, run) -> None:
        """Clip by the norm of all stages' gradients together (each stage holds a part of them); a
        non-finite norm anywhere makes every stage's gradient non-finite, so they all skip the step."""
        grads = [p.grad for p in self.stage_params[self.stage] if p.grad is not None]
        if self.grid.replicas > 1:  # each replica's gradients are its batches': average them, as DDP does
            for g in grads:
                dist.all_reduce(g, group=self.replica_group)
                g.div_(self.grid.replicas)
        squares = sum((g.float().square().sum() for g in grads), torch.zeros((), device=self.device))
        dist.all_reduce(squares, group=self.pipe_group)
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
                dist.broadcast(p.data, src=self._peer(stage), group=self.pipe_group)
        if not self.cfg.save.save_state:
            return  # only the adapter file is written
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        order = [p for group in inner.param_groups for p in group["params"]]
        position = {id(p): i for i, p in enumerate(order)}
        mine = {position[id(p)]: {k: (v.cpu(), v.device.type == "cpu") if torch.is_tensor(v) else (v, None)
                                  for k, v in inner.state[p].items()}
                for p in self.stage_params[self.stage] if p in inner.state}  # fmt: skip
        states = [None] * self.num_stages if self.stage == 0 else None
        dist.gather_object(mine, states, dst=self._peer(0), group=self.pipe_group)
        if self.stage == 0:
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
            if stage != self.stage:
                for p in params:
                    inner.state.pop(p, None)
        self._drop_foreign_state = False

    # ---- what it plans ----
    def plan(self, trainer, accelerator, model, trained, optimizer) -> str:
        """Every stage's blocks and bytes (gathered, so the main process prints them all)."""
        blocks = self.parts.blocks
        mine = stage_memory(model, self.stage_params[self.stage], optimizer, planned=True)
        mine["parameters"] = sum(p.numel() for i in self.stages[self.stage] for p in blocks[i].parameters())
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        every = [everyone[self.grid.rank(stage, 0)] for stage in range(self.num_stages)]  # replica 0's
        micro = self.cfg.distributed.pipeline_microbatches or self.num_stages
        total = sum(f["parameters"] for f in every)
        lines = [
            f"distributed: pipeline, {self.num_stages} stages over {len(blocks)} blocks ({total / 1e6:.2f}M "
            f"parameters), {micro} micro-batches per batch ({'1F1B' if micro >= self.num_stages else 'GPipe'})"
        ]
        if (n := self.grid.replicas) > 1:
            lines.append(
                f"  {n} replicas of the pipeline, each reading 1/{n} of the batches (ranks {n}·s to {n}·s+{n - 1} "
                "hold stage s and average its gradients)"
            )
        for stage, f in enumerate(every):
            mb = {k: v / 2**20 for k, v in f.items()}
            lines.append(
                f"  stage {stage}: blocks {_span(self.stages[stage])} ({f['parameters'] / 1e6:.2f}M); model "
                f"weights {mb['frozen']:.2f} MB, trained {mb['trained']:.3f} MB, gradients "
                f"{mb['gradients']:.3f} MB, optimizer state {mb['optimizer']:.3f} MB"
            )
        loaded = (
            "each stage loaded only its own blocks"
            if self.loaded_own_blocks
            else "loading read the whole model into host memory before the blocks of other stages were freed"
        )
        lines.append(
            f"  (each process also keeps the other stages' adapters, untrained, for the saves; {loaded})"
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
