"""What a run shows in TensorBoard besides its scalars (loss, lr, step time, validation loss): the
distribution the training timesteps are drawn from, and the samples drawn while training, as images
(a video as a strip of up to 8 of its frames, evenly spaced). The scalar `lr` is the schedule, step by step.

All of it goes to the TensorBoard tracker accelerate opened (`<output_dir>/logs`); with `log.tensorboard
= false` nothing here runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

STRIP_FRAMES = 8


def _writer(accelerator):
    """accelerate's TensorBoard `SummaryWriter`, or None when TensorBoard logging is off."""
    try:
        writer = accelerator.get_tracker("tensorboard", unwrap=True)
    except (ValueError, KeyError, AttributeError):
        return None
    return writer if hasattr(writer, "add_image") else None  # accelerate's no-op stand-in when it is off


def start(accelerator, sampler, logdir: Path, log: Callable[[str], None]) -> None:
    """Log the timestep distribution once, and say how to watch the run."""
    writer = _writer(accelerator)
    if writer is None or not accelerator.is_main_process:
        return
    draws = sampler.sample(100_000, generator=torch.Generator().manual_seed(0))
    writer.add_histogram("timesteps", draws.float(), 0)
    log(f"  tensorboard           tensorboard --logdir {logdir}")


def log_samples(accelerator, paths: Sequence[Path], step: int) -> None:
    """Show the sample files written at `step` as images."""
    writer = _writer(accelerator)
    if writer is None:
        return
    for i, path in enumerate(paths):
        writer.add_image(f"samples/{i:02d}", frame_strip(path), step, dataformats="HWC")
    writer.flush()


def frame_strip(path: str | Path) -> np.ndarray:
    """An image file as an HxWx3 uint8 array; a video as up to `STRIP_FRAMES` of its frames side by side."""
    from tuner.caption import read_frames  # the frames a captioning model is shown, the same way

    return np.concatenate([np.asarray(frame) for frame in read_frames(Path(path), STRIP_FRAMES)], axis=1)
