"""What `NetworkTrainer.train` sets up before its first step, in named steps, and the `Run` it hands on.

`setup` reads top to bottom; each step is a function of what the ones before made:

    _accelerator   the strategy (how processes share the work) and accelerate's Accelerator; the seed
    _open_data     the cached batches (stops, naming the command to run, if the cache is stale)
    _load_model    the base model: merged adapters, frozen, checkpointed, placed (fp8, block swap)
    _build_trained the adapter (or the weights of a full fine-tune), its optimizer and schedule
    _checkpoints   where states and adapters are saved (with the EMA, part of the run's identity), and
                   the settings and data order a resume names the changes of
    _resume        the position of a saved state, or a refusal to overwrite one
    then the summary and the `Run`.

The order is the one a resumed run relies on: everything that draws from the global generator (the
adapter's initialization) draws in the same order in every run.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from tuner.dtypes import DTYPES
from tuner.errors import CheckpointError, TrainingError
from tuner.optimizers.build import schedule_free
from tuner.trainers import board, report
from tuner.trainers.metrics import MetricsFile


@dataclass
class Position:
    """Where training stands; saved with every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch (0-based)
    batch: int = 0  # batches of the current epoch already consumed


@dataclass
class Run:
    """What one call of `train` set up, handed from step to step."""

    accelerator: Any
    model: nn.Module
    trained: Any  # the adapter network, or the model itself for a full fine-tune
    optimizer: Any
    scheduler: Any
    data: Any
    held_out: Any
    sampler: Any
    checkpoints: Any
    samples: Any
    metadata: dict
    total_steps: int
    groups: list[tuple[int, int]]  # per batch index: its accumulation group [start, end)
    pos: Position
    log: Callable[[str], None]
    progress: Any = None
    recent: list[float] = field(default_factory=list)  # loss of every batch so far
    skipped: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    last_step_end: float = field(default_factory=time.perf_counter)
    ema: Any = None  # `tuner.trainers.ema.WeightEMA` with train.ema_decay
    fused: Any = None  # `tuner.optimizers.fused_backward.FusedBackward` with train.fused_backward
    strategy: Any = None  # `tuner.distributed.Strategy`: how processes share the work
    metrics: Any = None  # `tuner.trainers.metrics.MetricsFile`: logs/metrics.jsonl
    watch: Any = None  # `tuner.distributed.failures.PeerWatch` over the other processes, if any
    # `trained`'s parameters in its order, listed once: walking the modules costs ~0.5 ms a step
    trained_params: list = field(default_factory=list)
    optimizer_step: Any = None  # `_optimizer_step`: what steps the optimizer


@dataclass
class _Trained:
    """What `_build_trained` makes."""

    trained: Any
    optimizer: Any
    scheduler: Any
    fused: Any
    total_steps: int
    steps_per_epoch: int
    batches_per_epoch: int


def setup(trainer, resume: str | None, log: Callable[[str], None]) -> Run:
    """Everything `trainer.train` needs before its first step (see the module docstring)."""
    cfg, tc, sc = trainer.cfg, trainer.cfg.train, trainer.cfg.sample
    out = Path(cfg.save.output_dir)
    strategy, accelerator = _accelerator(trainer, out)
    if not accelerator.is_main_process:  # one summary and one "saved" line, not one per process
        log = silent
    data, held_out = _open_data(trainer, strategy, accelerator, log)
    model, memory = _load_model(trainer, strategy, accelerator)
    t = _build_trained(trainer, model, accelerator, data)
    model, trained, optimizer = strategy.prepare(trainer, accelerator, model, t.trained, t.optimizer)
    optimizer, scheduler = accelerator.prepare(optimizer, t.scheduler)
    checkpoints, parts = _checkpoints(trainer, out, accelerator, strategy, trained, optimizer, scheduler,
                                      t.total_steps, data)  # fmt: skip
    if accelerator.is_main_process and (note := checkpoints.space_note(trained)):
        log(f"warning: {note}")
    samples = None
    if sc.prompts and (sc.every_n_steps or sc.at_start) and accelerator.is_main_process:
        from tuner.trainers.samples import TrainingSamples

        samples = TrainingSamples(trainer, cfg, accelerator.device, out / "samples")
    pos = _resume(out, resume, checkpoints, strategy, trained, log)

    log(
        report.summary(
            trainer, trained, data, t.total_steps, t.steps_per_epoch, accelerator, memory.summary()
        )
    )
    if plan := strategy.plan(trainer, accelerator, model, trained, optimizer):
        log(plan)
    for note in data.warnings():  # short buckets train as smaller batches; say so once
        log(f"note: {note}")
    if cfg.log.tensorboard:
        accelerator.init_trackers("tuner", config=report.flat_scalars(cfg))
        board.start(accelerator, out / "logs", log)
    run = Run(
        accelerator, model, trained, optimizer, scheduler, data, held_out, trainer.timestep_sampler(),
        checkpoints, samples, report.adapter_metadata(trainer, data), t.total_steps,
        accumulation_groups(t.batches_per_epoch, tc.gradient_accumulation_steps), pos, log,
    )  # fmt: skip
    if sf := schedule_free(optimizer):
        sf.train()  # schedule-free optimizers take their steps in train mode
    run.metrics = MetricsFile(
        out, cfg.log.every_n_steps, pos.step if resume else None, accelerator.is_main_process
    )
    if samples and sc.at_start and pos.step == 0:
        written = samples.draw(model, trained, 0, log)
        board.log_samples(accelerator, written, 0)
        run.metrics.samples(0, written, sc.prompts)
    run.ema, run.fused, run.strategy = parts.get("ema"), t.fused, strategy
    run.trained_params, run.optimizer_step = (
        list(trained.parameters()),
        _optimizer_step(accelerator, optimizer),
    )
    run.progress = _progress(t.total_steps, pos.step, accelerator.is_main_process)
    freeze_gc()  # the model, data plan and optimizer: long-lived, never garbage
    return run


def _optimizer_step(accelerator, optimizer) -> Callable[[], Any]:
    """`optimizer.step`, or the step of the optimizer it wraps where accelerate's wrapper would only call
    that: no gradient scaler, not XLA, no other wrapper (DeepSpeed's steps in its engine), and gradients
    always in sync (the loop accumulates by itself). `AcceleratedOptimizer.step` looks for the lomo_optim
    package on the file system twice a call, about 0.5 ms a step."""
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType

    if (
        type(optimizer) is AcceleratedOptimizer
        and accelerator.scaler is None
        and accelerator.distributed_type != DistributedType.XLA
    ):
        return optimizer.optimizer.step
    return optimizer.step


def _accelerator(trainer, out: Path):
    """The strategy and accelerate's `Accelerator`, the strategy checked against the process count; the
    global seed set."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from tuner.distributed import launched_processes, strategy_for
    from tuner.trainers.checkpoints import check_output_dir

    cfg, tc = trainer.cfg, trainer.cfg.train
    check_output_dir(out)  # a file or a read-only folder is named now, not at the first save
    strategy = strategy_for(cfg, launched_processes())
    accelerator = Accelerator(
        mixed_precision=tc.mixed_precision,
        log_with="tensorboard" if cfg.log.tensorboard else None,
        project_dir=str(out / "logs"),
        # the schedule counts optimizer steps: accelerate otherwise steps it once per process per step
        # (it assumes its own loaders grew the batch N-fold; tuner shards the batches itself)
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        **strategy.accelerator_kwargs(),
    )
    strategy.check(trainer, accelerator.num_processes)
    set_seed(tc.seed)
    freeze_gc()  # the modules imported so far
    return strategy, accelerator


def _open_data(trainer, strategy, accelerator, log):
    """The training batches (this process's share) and the held-out ones, if any dataset has them."""
    from tuner.cache.plan import open_training_data

    cfg = trainer.cfg
    # stops here, naming the command to run, if the cache is missing anything or stale
    pin = accelerator.device.type == "cuda"  # batches stacked into pinned memory, copied non-blocking
    data = open_training_data(trainer, cfg, log, *strategy.data_share(accelerator), pin_memory=pin)
    held_out = None
    if any(spec.validation for spec in cfg.datasets):
        held_out = open_training_data(trainer, cfg, log, validation=True, pin_memory=pin)
    return data, held_out


def _load_model(trainer, strategy, accelerator):
    """The frozen base model placed on the device, and the handle of its memory settings."""
    cfg, tc = trainer.cfg, trainer.cfg.train
    with strategy.loading(trainer):  # pipeline stages load only their own blocks
        model = trainer.load_transformer(DTYPES[cfg.model.dtype])
    trainer.merge_base_adapters(model)
    model.requires_grad_(False)
    if tc.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    # diffusers checkpoints only in train mode; these models have no dropout to switch on
    model.train(tc.gradient_checkpointing)
    # fp8 storage, attention backend, activation offload and block swap attach here and place the
    # model on the device; the adapter comes after, so it is never quantized or swapped
    with strategy.placing(trainer, model):  # pipeline stages place only their own blocks
        memory = trainer.apply_memory(model, cfg.memory, accelerator.device, tc.gradient_accumulation_steps)
    return model, memory


def _build_trained(trainer, model, accelerator, data) -> _Trained:
    """The adapter (LoRA / LoHa / LoKr, optionally DoRA) or, for a full fine-tune, the weights themselves;
    its optimizer and learning-rate schedule."""
    from tuner.optimizers.build import build_optimizer, build_scheduler

    tc, nc = trainer.cfg.train, trainer.cfg.network
    trained = trainer.build_trained(model)
    trained.to(accelerator.device)
    if nc.network_weights:
        trained.load_weights(nc.network_weights, trainer.layout.inverse)
    optimizer = trained.prepare_optimizer(
        build_optimizer(
            tc.optimizer, trained.param_groups(tc.learning_rate, nc.loraplus_lr_ratio), tc.learning_rate,
            tc.optimizer_args,
        )
    )  # fmt: skip
    batches_per_epoch = data.batches_per_epoch()
    steps_per_epoch = math.ceil(batches_per_epoch / tc.gradient_accumulation_steps)
    total_steps = tc.max_steps or tc.epochs * steps_per_epoch
    scheduler = build_scheduler(
        tc.lr_scheduler, optimizer, tc.lr_warmup_steps, total_steps, num_cycles=tc.lr_num_cycles
    )
    fused = None
    if tc.fused_backward:  # each parameter steps inside backward (tuner.optimizers.fused_backward)
        if accelerator.num_processes > 1:
            raise TrainingError(
                "train.fused_backward runs in one process: gradients are not averaged "
                "across processes before each parameter steps. Turn it off or use one GPU."
            )
        from tuner.optimizers.fused_backward import FusedBackward

        fused = FusedBackward(optimizer, trained.parameters())
    return _Trained(trained, optimizer, scheduler, fused, total_steps, steps_per_epoch, batches_per_epoch)


def _checkpoints(trainer, out, accelerator, strategy, trained, optimizer, scheduler, total_steps, data):
    """Where the run saves, with the parts of its state, the identity a resume must match and the
    settings and data order a resume names the changes of."""
    from tuner.trainers.checkpoints import Checkpoints

    tc, nc = trainer.cfg.train, trainer.cfg.network
    identity = {"architecture": trainer.architecture, **{f"network.{k}": v for k, v in asdict(nc).items()
                                                          if k != "network_weights"}}  # fmt: skip
    schedule = {"total_steps": total_steps, "train.learning_rate": tc.learning_rate,
                "train.lr_scheduler": tc.lr_scheduler, "train.lr_warmup_steps": tc.lr_warmup_steps,
                "train.lr_num_cycles": tc.lr_num_cycles}  # fmt: skip
    parts = {"network": trained, "optimizer": optimizer, "scheduler": scheduler}
    if tc.ema_decay:  # part of the state, exported beside each adapter, and in the run's identity
        from tuner.trainers.ema import WeightEMA

        parts["ema"] = WeightEMA(trained.parameters(), tc.ema_decay, tc.ema_warmup, tc.ema_on_host)
        identity["train.ema_decay"] = tc.ema_decay
    settings = {k: v for k, v in run_settings(trainer.cfg).items() if k not in identity and k not in schedule}
    checkpoints = Checkpoints(out, trainer.cfg.save, accelerator, identity, parts, schedule, strategy, settings,
                              data_order(data))  # fmt: skip
    return checkpoints, parts


# settings of the train section that change how a run goes on, not what its steps compute (or that
# are named elsewhere on resume: max_steps and epochs are the schedule's)
_NOT_RESULTS = {"max_steps", "epochs", "validate_every_n_steps", "validation_timesteps", "gradient_checkpointing",
                "compile", "ema_on_host", "max_nonfinite_steps"}  # fmt: skip


def run_settings(cfg) -> dict:
    """The settings that change a run's results (train and timesteps sections, the base model's dtype),
    as `section.key` -> value: a state records them and a resume names each one that changed."""
    values = {f"train.{k}": v for k, v in asdict(cfg.train).items() if k not in _NOT_RESULTS}
    values |= {f"timesteps.{k}": v for k, v in asdict(cfg.timesteps).items()}
    return values | {"model.dtype": cfg.model.dtype}


def data_order(data) -> Callable[[int], str]:
    """epoch -> a hash of the order of that epoch's batches (which cache entries, in which order)."""

    def digest(epoch: int) -> str:
        keys = [[entry[1:] for entry in batch] for batch in data.plan_epoch(epoch)]
        return hashlib.sha256(json.dumps(keys).encode()).hexdigest()

    return digest


def _resume(out, resume, checkpoints, strategy, trained, log) -> Position:
    """The position of the state `resume` names (its weights loaded), or the start; a folder that holds
    a run is not started over."""
    if not resume and checkpoints.states():
        raise CheckpointError(
            f"{out} already holds a training run (saved states up to "
            f"{checkpoints.states()[-1].name}); starting over would mix with and then delete them. "
            "Continue it with --resume latest, or set another save.output_dir."
        )
    if not resume:
        return Position()
    with strategy.whole_state(trained):
        pos = Position(**checkpoints.load(resume))
    path = checkpoints.resolve(resume)
    log(f"resumed from {path} at step {pos.step}, epoch {pos.epoch + 1}")
    if changes := checkpoints.schedule_changes(path):
        log(f"note: the schedule changed since this state was saved ({'; '.join(changes)}); the "
            f"learning rate continues from step {pos.step} on the new schedule.")  # fmt: skip
    for change in checkpoints.settings_changes(path, pos.step):
        log(f"warning: {change}")
    return pos


def end_run(run: Run) -> None:
    """Close the trackers and the process group, all processes together: a process that tears its gloo
    connections down while another still reads them makes that one abort ("terminate called without an
    active exception") after the run's work is done."""
    if run.watch is not None:  # before the barrier: past it, the other processes end when they like
        run.watch.close()
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()


def freeze_gc() -> None:
    """Move every object alive now out of the garbage collector's reach. torch, diffusers and a loaded
    model are millions of long-lived objects; without this, each full collection (set off by the
    per-item allocations of opening a large dataset: 0.17 s per 1,000 items before the first step,
    measured with benchmarks/startup.py; and now and then by a training step) walks all of them again.
    They are given back to the collector when training ends (`base._gc_frozen_while_training`)."""
    import gc

    gc.freeze()


def silent(_: str) -> None:
    pass


def accumulation_groups(n_batches: int, accum: int) -> list[tuple[int, int]]:
    """For each batch index, the [start, end) range of its accumulation group; the last may be short."""
    groups = []
    for start in range(0, n_batches, accum):
        end = min(start + accum, n_batches)
        groups += [(start, end)] * (end - start)
    return groups


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="steps", dynamic_ncols=True,
                smoothing=0.1, mininterval=0.5)  # fmt: skip
