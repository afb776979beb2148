"""`<save.output_dir>/logs/metrics.jsonl`: what a run logs, one JSON object per line, for programs to read
(`tuner ui`'s charts and samples gallery) while the run goes on. Written always, TensorBoard or not.

    {"step": 12, "epoch": 1, "loss": 0.41, "avg_loss": 0.44, "lr": 0.0001, "step_seconds": 0.8,
     "eta_seconds": 70.4, "time": 1796069469.5}                               every log.every_n_steps
    {"step": 20, "val_loss": 0.39, "time": ...}                                each validation
    {"step": 20, "prompt": "a red circle", "path": "samples/lora-step000020-00.png", "time": ...}
                                                                                each sample drawn

`epoch` counts from 1, as the log does; `loss` is the step's loss averaged over every process (what one
process with the whole global batch computes); `avg_loss` is the mean of this run's step losses so far
(the progress bar's `avg`); `eta_seconds` is the remaining steps times the mean of the last 20 step
times; a sample's `path` is relative to the output folder. Each line is appended and flushed on its own,
so a reader sees whole lines only (a line still being written has no newline yet). A resumed run first
drops the lines past the step it resumes from (they belong to the part of the run it repeats), so the
file reads as one run. Only the main process writes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

from tuner.io import write_text

FILE = "metrics.jsonl"
ETA_WINDOW = 20  # step times averaged for the ETA


class MetricsFile:
    """The metrics file of a run in `output_dir`; a no-op on processes other than the main one."""

    def __init__(self, output_dir: Path, every_n_steps: int, resumed_step: int | None, enabled: bool = True):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / "logs" / FILE if enabled else None
        self.every = every_n_steps
        if self.path is not None:
            kept = _lines_up_to(self.path, resumed_step) if resumed_step is not None else []
            write_text(self.path, "".join(line + "\n" for line in kept))

    def step(self, step: int, epoch: int, total_steps: int, loss: float, avg_loss: float, lr: float,
             step_seconds: Sequence[float]) -> None:  # fmt: skip
        """One optimizer step (written every `log.every_n_steps`); `epoch` is 0-based, as `Position`'s."""
        if step % self.every:
            return
        recent = step_seconds[-ETA_WINDOW:]
        eta = (total_steps - step) * sum(recent) / len(recent) if recent else None
        self._write({"step": step, "epoch": epoch + 1, "loss": loss, "avg_loss": avg_loss, "lr": lr,
                     "step_seconds": step_seconds[-1] if step_seconds else None, "eta_seconds": eta})  # fmt: skip

    def validation(self, step: int, val_loss: float) -> None:
        self._write({"step": step, "val_loss": val_loss})

    def samples(self, step: int, files: Sequence[Path], prompts: Sequence[str]) -> None:
        """The sample files drawn at `step`, one per prompt, in the prompts' order."""
        for path, prompt in zip(files, prompts):
            path = Path(path)
            if path.is_relative_to(self.output_dir):
                path = path.relative_to(self.output_dir)
            self._write({"step": step, "prompt": prompt, "path": str(path)})

    def _write(self, row: dict) -> None:
        if self.path is None:
            return
        row["time"] = time.time()
        # NaN is not JSON: a skipped step's loss is written as null
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")


def _lines_up_to(path: Path, step: int) -> list[str]:
    """The whole lines of an existing metrics file whose step is at most `step`."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short when the earlier run was killed
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line)
    return kept
