"""Stopping a run on request: SIGTERM or SIGINT (Ctrl-C) ends training at the next step boundary, with a
resumable state saved.

A signal only sets a flag; the step in flight finishes untouched. After each optimizer step, once its
logging, samples, validation and scheduled save are done (where `_maybe_save` saves), the loop asks
`StopRequest.agreed`. With several processes the flag is summed over all of them at that point, so every
rank stops after the same step even when the signal reached only one of them, and none is left waiting
in a collective the others skipped. The run then saves what `_maybe_save` saves (the state, then that
step's adapter), unless that step was just saved, and ends with `TrainingStopped`, whose message names
the state and the command that continues the run. `tuner train` prints it and exits with
`TrainingStopped.exit_code` (75).

The handlers are in place for the loop only. A signal during set-up (loading the model, opening the
cache) ends the process as usual, as there is nothing to save yet. A launcher that forwards the signal
to its workers (`accelerate launch`, torchrun) may send a second one: it changes nothing. torchrun kills
workers that have not exited 30 s after it forwarded the signal, which a large state save can exceed.
"""

from __future__ import annotations

import signal
import threading

import torch

from tuner.errors import TrainingStopped

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """A context manager: once `arm()`ed inside it, SIGTERM and SIGINT request a stop instead of ending the
    process; leaving it puts the previous handlers back."""

    def __init__(self) -> None:
        self.signal_name: str | None = None  # the first signal received
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        return self

    def arm(self) -> None:
        if threading.current_thread() is threading.main_thread():  # Python handles signals there only
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    def agreed(self, accelerator) -> bool:
        """Whether any process was asked to stop. Every process must call this at the same step."""
        if accelerator.num_processes == 1:
            return self.signal_name is not None
        flag = torch.tensor([0 if self.signal_name is None else 1], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item())

    def check(self, trainer, run, saved: bool) -> None:
        """At a step boundary, on every process: stop here if any process was asked to (`stop`)."""
        if self.agreed(run.accelerator):
            self.stop(trainer, run, saved)

    def stop(self, trainer, run, saved: bool) -> None:
        """Save the state and adapter of the step just taken (unless `saved` says `_maybe_save` did), close
        the run, log where it stands and how to continue, and raise `TrainingStopped`."""
        from tuner.trainers.checkpoints import STATE_DIR

        pos, checkpoints = run.pos, run.checkpoints
        if saved:
            adapter = checkpoints.written[0]
        else:
            adapter = trainer._save(run)  # gathered first where a strategy shards the weights
        run.progress.close()
        from tuner.trainers.setup import end_run

        end_run(run)
        why = f"on {self.signal_name}" if self.signal_name else "on another process's request"
        if trainer.cfg.save.save_state:
            state = checkpoints.out / STATE_DIR / f"step{pos.step:06d}"
            message = (f"stopped {why} after step {pos.step} of {run.total_steps}: state saved in {state} "
                       f"(adapter {adapter}); continue with: {trainer.cfg.command('train')} --resume latest")  # fmt: skip
        else:
            message = (f"stopped {why} after step {pos.step} of {run.total_steps}: adapter saved in {adapter}; "
                       "no state was saved (save.save_state = false), so the run cannot be resumed")  # fmt: skip
        run.log(message)
        raise TrainingStopped(message)
