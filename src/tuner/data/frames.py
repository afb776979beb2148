"""Which frames of a video become training clips.

A video model trains on clips of a fixed frame count (`target_frames`, e.g. 33). A source video is
usually longer, so we cut *windows* out of it, each a tuple of source frame indices:

    n_frames = 10, target 4
    head     [0 1 2 3]                         the start of the clip, once per target
    chunk    [0 1 2 3] [4 5 6 7]               back to back, no overlap; the 2-frame tail is unused
    slide    stride 3: [0..3] [3..6] [6..9]    a window every `stride` frames
    uniform  sample 3: [0..3] [3..6] [6..9]    `sample` windows with evenly spaced starts
    full     max 8, rule 4N+1: [0..4]          as many frames as allowed, trimmed to a valid count

Most video VAEs compress time in steps, so a model accepts only some frame counts: Wan's VAE keeps the
first frame and packs the rest in fours, so a clip has 4N+1 frames. `FrameRule(4, 1)` says that.

Clips are also brought to the model's frame rate first: a 30 fps source for a 16 fps model keeps about
8 of every 15 frames (`resample_indices`), and the windows are taken over that thinned list, so one
window spans the same time it would at 16 fps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Mode = Literal["head", "chunk", "slide", "uniform", "full"]
Window = tuple[int, ...]


@dataclass(frozen=True)
class FrameRule:
    """Frame counts a model accepts: n % multiple == remainder (Wan: multiple=4, remainder=1 → 4N+1)."""

    multiple: int = 1
    remainder: int = 0

    def __call__(self, n: int) -> bool:
        return n >= 1 and n % self.multiple == self.remainder % self.multiple

    def __str__(self) -> str:
        return "any count" if self.multiple == 1 else f"{self.multiple}N+{self.remainder}"


ANY_COUNT = FrameRule()


def largest_valid(n: int, valid_count: Callable[[int], bool]) -> int:
    """The largest count <= n that the model accepts, or 0 if none."""
    while n >= 1 and not valid_count(n):
        n -= 1
    return max(n, 0)


def resample_indices(n_src: int, src_fps: float | None, target_fps: float | None) -> list[int]:
    """Source frame indices that play the clip at target_fps, by dropping frames (never duplicating).

    Output frame k is shown at time k / target_fps; we take the source frame nearest that time. A
    source already at or below the target rate, or with either rate unknown, is kept whole.
    """
    if not src_fps or not target_fps or target_fps >= src_fps:
        return list(range(n_src))
    ratio = src_fps / target_fps
    out = []
    k = 0
    while (i := int(k * ratio + 0.5)) < n_src:  # + 0.5: round half up (Python's round() goes to even)
        out.append(i)
        k += 1
    return out


def _windows_of(n: int, length: int, starts) -> list[Window]:
    return [tuple(range(s, s + length)) for s in starts if s + length <= n]


def frame_windows(
    n_frames: int,
    target_frames: tuple[int, ...],
    mode: Mode,
    stride: int = 1,
    sample: int = 1,
    max_frames: int = 129,
    valid_count: Callable[[int], bool] = ANY_COUNT,
) -> list[Window]:
    """Windows (tuples of positions 0..n_frames-1) per the extraction mode; see the module docstring.

    A target longer than the clip gives no window for that target (`short_targets` names them). In
    `full` mode target_frames is not used: the one window is the first min(n_frames, max_frames)
    frames, trimmed down to the largest count `valid_count` accepts.
    """
    if mode == "full":
        count = largest_valid(min(n_frames, max_frames), valid_count)
        return [tuple(range(count))] if count else []
    windows: list[Window] = []
    for t in target_frames:
        if t > n_frames:
            continue
        last_start = n_frames - t
        if mode == "head":
            starts = [0]
        elif mode == "chunk":
            starts = range(0, last_start + 1, t)
        elif mode == "slide":
            starts = range(0, last_start + 1, stride)
        elif mode == "uniform":
            if sample == 1:
                starts = [0]
            else:  # evenly spaced from the first to the last possible start; duplicates when the clip is short
                starts = sorted({int(j * last_start / (sample - 1) + 0.5) for j in range(sample)})
        else:
            raise ValueError(f"unknown frame_extraction mode {mode!r}")
        windows += _windows_of(n_frames, t, starts)
    return windows


def short_targets(
    n_frames: int,
    target_frames: tuple[int, ...],
    mode: Mode,
    valid_count: Callable[[int], bool] = ANY_COUNT,
) -> list[int]:
    """Targets that give no window because the clip is too short (in full mode: the smallest valid count)."""
    if mode == "full":
        if largest_valid(n_frames, valid_count):
            return []
        return [next(n for n in range(n_frames + 1, n_frames + 10_000) if valid_count(n))]
    return [t for t in target_frames if t > n_frames]


def video_windows(
    n_src: int,
    src_fps: float | None,
    model_fps: float | None,
    target_frames: tuple[int, ...],
    mode: Mode,
    stride: int = 1,
    sample: int = 1,
    max_frames: int = 129,
    valid_count: Callable[[int], bool] = ANY_COUNT,
) -> tuple[list[Window], list[int]]:
    """Windows of *source* frame indices after resampling to model_fps, and the targets that did not fit.

    Returns (windows, short): `short` lists the target counts longer than the resampled clip.
    """
    kept = resample_indices(n_src, src_fps, model_fps)
    positions = frame_windows(len(kept), target_frames, mode, stride, sample, max_frames, valid_count)
    windows = [tuple(kept[p] for p in w) for w in positions]
    return windows, short_targets(len(kept), target_frames, mode, valid_count)
