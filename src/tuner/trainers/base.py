"""NetworkTrainer: the one training loop every architecture shares.

An architecture is a record in `tuner.registry` plus an `ArchitectureModel` subclass (`tuner.archs.model`)
that says what it computes (which checkpoints to load, how to encode a batch for the cache, how to call
its model) and never touches the loop; `tuner.trainers.trainer_class` combines the two. The loop reads top to
bottom:

    setup      (trainers/setup.py) accelerator, seed, cached batches (checked for staleness), model,
               adapter, optimizer; resume: saved state, checked against its manifest (checkpoints.py)
    loop       _step: noise, t (+ draw_conditions) → x_t → predict → the objective's loss (loss_mask)
               → backward (accumulate) → clip → step
               then _log_step (+ logs/metrics.jsonl), _maybe_sample, _maybe_validate, _maybe_save, and a
               stop on SIGTERM / Ctrl-C (trainers/stop.py: all processes stop after the same step, saved)
               with several processes, one that fails or dies stops the others within seconds, naming it
               (distributed/failures.py)
    finish     the final adapter (and state)

Everything random in a step (noise, timesteps, caption dropout, batch order) comes from generators
seeded by the config seed and the step's position, not from global RNG state. That is what makes a
resumed run identical to an uninterrupted one; the saved global RNG states cover the rest (dropout).
A step whose loss or gradient is NaN or infinite is not applied, and stops the run (`_nonfinite_step`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from tuner.config import Config
from tuner.distributed.failures import watching
from tuner.errors import TrainingError
from tuner.optimizers.build import averaged_weights
from tuner.trainers import board
from tuner.trainers.checkpoints import first_nonfinite
from tuner.trainers.setup import Run, end_run, setup
from tuner.trainers.stop import StopRequest


class NetworkTrainer:
    """The training loop, over a family's `ArchitectureModel` (`tuner.trainers.trainer_class` combines the two:
    `class WanModel(NetworkTrainer, WanModel)`); everything it computes per architecture is the model's."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)  # the family's `ArchitectureModel`: cfg, record, layout
        self.history: list[float] = []  # each optimizer step's loss (mean over processes), for callers
        self.step_seconds: list[float] = []  # wall time of each optimizer step (data wait included)
        self.val_history: list[tuple[int, float]] = []  # (step, validation loss)

    # --- the loop --------------------------------------------------------------------------------
    def train(self, resume: str | None = None, log: Callable[[str], None] = print) -> Path:
        """Train and return the path of the final adapter file."""
        with (
            _gc_frozen_while_training(),
            StopRequest() as stop,
            watching() as watch,
            contextlib.ExitStack() as cleanup,
        ):
            run = setup(self, resume, log)
            run.watch = watch  # another process failing or dying stops this one (distributed/failures.py)
            cleanup.callback(run.progress.close)  # a run ended by an error too: an open bar redraws at exit
            stop.arm()  # from here SIGTERM / Ctrl-C end the run after its current step (trainers/stop.py)
            while run.pos.step < run.total_steps:
                for batch in run.data.epoch(run.pos.epoch, start=run.pos.batch):
                    if not self._step(run, batch):
                        continue  # gradients accumulate until the group's last batch
                    self._log_step(run)
                    self._maybe_sample(run)
                    self._maybe_validate(run)
                    if run.pos.step >= run.total_steps:
                        break
                    stop.check(self, run, saved=self._maybe_save(run))  # saves and raises if asked to stop
                else:  # the epoch ran out
                    run.pos.epoch, run.pos.batch = run.pos.epoch + 1, 0
                    self._maybe_save(run, epoch_end=True)
            run.progress.close()
            final = self._save(run, final=True)
            end_run(run)
            run.log(f"saved {', '.join(map(str, run.checkpoints.written))}")
            return final

    def _step(self, run: Run, batch: dict) -> bool:
        """Forward and backward one batch; at the end of its accumulation group, average the gradients
        over processes, clip, and step the optimizer. Returns whether an optimizer step was taken."""
        pos, tc = run.pos, self.cfg.train
        start, end = run.groups[pos.batch]
        # seeded by the batch's place in the epoch's shared plan (this process's n-th batch is the plan's
        # n·world + rank-th): N processes draw what one process accumulating N batches draws
        gen = torch.Generator().manual_seed(
            _mix(tc.seed, pos.epoch, pos.batch * run.data.world + run.data.rank)
        )
        x0, cond = self._inputs(batch, run.accelerator.device)
        noise = torch.randn(x0.shape, generator=gen).to(x0)
        t = run.sampler.sample(x0.shape[0], generator=gen, seq_len=self.seq_len(x0)).to(x0.device)
        if self.cfg.log.tensorboard and pos.step == 0 and pos.batch == 0:
            board.log_timesteps(run.accelerator, run.sampler, self.seq_len(x0))
        if self.cfg.timesteps.noise_offset:  # drawn after t, so runs without it draw what they always did
            from tuner.diffusion.ddpm import offset_noise

            noise = offset_noise(noise, self.cfg.timesteps.noise_offset, gen)
        cond = self.draw_conditions(x0, cond, gen)
        with run.strategy.accumulating(run, last=pos.batch + 1 == end):
            loss = run.strategy.loss(self, run, x0, noise, t, cond)
            if run.fused is None:
                run.strategy.backward(run, loss / (end - start))
                run.recent.append(loss.item())  # the one sync per batch, for logging and the finite check
            else:  # backward steps the optimizer: check the loss first, as no update can be taken back
                run.recent.append(loss.item())
                if math.isfinite(run.recent[-1]):
                    run.strategy.backward(run, loss)
        pos.batch += 1
        if pos.batch != end:
            return False
        run.strategy.reduce_gradients(run)
        grad_norm = run.strategy.grad_norm(run, tc.max_grad_norm)
        # the mean over the processes (each read its own share of the global batch): what one process with
        # the whole batch computes, so every process logs it and agrees on skipping a non-finite step
        step_loss = run.strategy.mean_loss(run, sum(run.recent[-(end - start) :]) / (end - start))
        if math.isfinite(step_loss) and (grad_norm is None or math.isfinite(grad_norm)):
            if run.fused is None:  # fused: every parameter has stepped inside backward
                run.optimizer_step()
            if run.ema:
                run.ema.update()
        else:  # the update is skipped; the schedule and the data move on as if it had been taken
            self._nonfinite_step(run, step_loss, grad_norm)
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        pos.step += 1
        self.history.append(step_loss)
        return True

    def _nonfinite_step(self, run: Run, step_loss: float, grad_norm: float | None) -> None:
        """Count a step whose loss or gradient is NaN or infinite (its update is skipped); past the allowed
        count, stop the run without saving anything (the last save, if any, stays the newest)."""
        tc, step = self.cfg.train, run.pos.step + 1
        run.skipped += 1
        what = f"loss {step_loss}" if not math.isfinite(step_loss) else f"gradient norm {grad_norm}"
        if run.skipped <= tc.max_nonfinite_steps:
            run.log(
                f"step {step}: {what}; update skipped ({run.skipped} of {tc.max_nonfinite_steps} allowed)"
            )
            return
        finite = [(i + 1, v) for i, v in enumerate(self.history) if math.isfinite(v)]
        last = (
            f"the last finite loss was {finite[-1][1]:.4f} at step {finite[-1][0]}"
            if finite
            else "no step had a finite loss"
        )
        states = run.checkpoints.complete_states()
        saved = f"the last saved state is {states[-1]}" if states else "no state was saved"
        nc = self.cfg.network
        # a pass over the whole base model, made only now that training stops
        if base := first_nonfinite(run.model, frozen_only=True):
            raise TrainingError(f"step {step}: {what}; training stopped: the base model's weights hold NaN or "
                                f"infinity (first: {base}; model.transformer = {self.cfg.model.transformer}). The "
                                "checkpoint is damaged: download it again or use another copy.")  # fmt: skip
        raise TrainingError(
            f"step {step}: {what}; training stopped ({last}; {saved}). Likely causes: a learning rate too "
            f"high for {tc.optimizer} (train.learning_rate = {tc.learning_rate:g}), a large adapter scale "
            f"(network.alpha / rank = {nc.alpha:g} / {nc.rank}), fp16 overflow (use bf16), or damaged cached "
            "latents. Set train.max_nonfinite_steps to skip a few such steps instead of stopping."
        )

    def _log_step(self, run: Run) -> None:
        now = time.perf_counter()
        self.step_seconds.append(now - run.last_step_end)
        run.last_step_end = now
        step_loss, lr = self.history[-1], run.scheduler.get_last_lr()[0]
        inner = getattr(run.optimizer, "optimizer", run.optimizer)
        if hasattr(
            inner, "mean_lr"
        ):  # per-element rates (Automagic): their mean, the schedule's scale included
            lr = inner.mean_lr() * lr / inner.param_groups[0]["start_lr"]
        run.progress.update(1)
        # refresh=False: the bar redraws on its own clock (mininterval), not on every step
        finite = [v for v in self.history if math.isfinite(v)]  # skipped NaN steps must not poison the mean
        avg = sum(finite) / max(1, len(finite))
        run.progress.set_postfix(loss=f"{step_loss:.4f}", avg=f"{avg:.4f}", lr=f"{lr:.2e}", refresh=False)
        run.metrics.step(run.pos.step, run.pos.epoch, run.total_steps, step_loss, avg, lr, self.step_seconds)
        if self.cfg.log.tensorboard and run.pos.step % self.cfg.log.every_n_steps == 0:
            metrics = {"loss": step_loss, "lr": lr, "step_seconds": self.step_seconds[-1]}
            run.accelerator.log(metrics, step=run.pos.step)

    def _maybe_sample(self, run: Run) -> None:
        sc = self.cfg.sample
        if sc.every_n_steps and run.pos.step % sc.every_n_steps == 0 and sc.prompts:
            if run.samples:  # the main process draws; the others wait for it
                ema = run.ema.applied() if run.ema and sc.use_ema else contextlib.nullcontext()
                with averaged_weights(run.optimizer), ema:
                    written = run.samples.draw(run.model, run.trained, run.pos.step, run.log)
                    board.log_samples(run.accelerator, written, run.pos.step)
                    run.metrics.samples(run.pos.step, written, sc.prompts)
            run.accelerator.wait_for_everyone()

    def _maybe_validate(self, run: Run) -> None:
        every, step = self.cfg.train.validate_every_n_steps, run.pos.step
        if run.held_out and ((every and step % every == 0) or step >= run.total_steps):
            with averaged_weights(run.optimizer):
                val_loss = self.validation_loss(run)
            self.val_history.append((step, val_loss))
            run.log(f"step {step}: validation loss {val_loss:.4f}")
            run.metrics.validation(step, val_loss)
            if self.cfg.log.tensorboard:
                run.accelerator.log({"val_loss": val_loss}, step=step)

    def _maybe_save(self, run: Run, epoch_end: bool = False) -> bool:
        """Save every N steps, or every N epochs at an epoch's end (the final save is `train`'s); return
        whether it saved."""
        sc, pos = self.cfg.save, run.pos
        due = (sc.every_n_epochs and pos.epoch % sc.every_n_epochs == 0 and pos.step < run.total_steps
               if epoch_end else sc.every_n_steps and pos.step % sc.every_n_steps == 0)  # fmt: skip
        if due:
            self._save(run)
        return bool(due)

    def _save(self, run: Run, final: bool = False) -> Path:
        """Save the state and the adapter at the current position, with every process's share of the
        trained weights and optimizer state gathered first (sharding and pipeline strategies)."""
        with run.strategy.whole_state(run.trained):
            return run.checkpoints.save(run.trained, run.pos, run.metadata, self.export_layout(), final=final)

    def validation_loss(self, run: Run) -> float:
        """Mean loss on the held-out batches at fixed timesteps with fixed noise, so values
        at different steps compare. Draws nothing from the global random state."""
        cfg, trained = self.cfg, run.trained
        trained.eval()
        losses = []
        with torch.no_grad():
            for i, batch in enumerate(run.held_out.epoch(0)):
                x0, cond = self._inputs(batch, run.accelerator.device)
                for j, t_value in enumerate(cfg.train.validation_timesteps):
                    gen = torch.Generator().manual_seed(_mix(cfg.train.seed, i, j))
                    noise = torch.randn(x0.shape, generator=gen).to(x0)
                    t = torch.full((x0.shape[0],), t_value, device=x0.device)
                    drawn = self.draw_conditions(x0, cond, gen)
                    losses.append(run.strategy.held_out_loss(self, run, x0, noise, t, drawn).item())
        trained.train()
        return sum(losses) / len(losses)

    def _inputs(self, batch: dict, device) -> tuple[torch.Tensor, dict]:
        """A cached batch as model inputs on `device`: clean latents, and cond (text + extra latents)."""
        cond = {**self.collate_text(batch["text"]), **batch["extra"]}
        # non_blocking: a pinned batch (see TrainingData) is copied while the host goes on; a no-op elsewhere
        return batch["latents"].to(device, non_blocking=True), {
            k: v.to(device, non_blocking=True) for k, v in cond.items()
        }


@contextlib.contextmanager
def _gc_frozen_while_training() -> Iterator[None]:
    import gc

    try:
        yield
    finally:
        gc.unfreeze()  # what was frozen and is garbage now (a caller's second run) is collected again


def _mix(*values: int) -> int:
    """A 63-bit seed from several integers (so nearby positions get unrelated streams)."""
    h = 1469598103934665603
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h
