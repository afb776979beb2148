"""`tuner data check`: what each dataset of a config gives a model, before anything is encoded.

Caching a large dataset takes hours; finding out afterwards that half the clips were too short for
`target_frames`, or that every portrait landed in one odd bucket, costs those hours again. This walks
the datasets exactly as caching plans them (`discover_items`, `plan_latent_jobs`, the model's spatial
step, frame rule and fps) but reads only file headers, and reports per dataset:

    datasets[0] at 832x480 (/data/clips): 120 items → 143 clips
      buckets: 832x480x33 ×97, 480x832x33 ×40, 624x624x33 ×6
      frames per clip: 33 ×143
      dropped 7 items: too short ×5 (a.mp4, b.mp4, ...), undecodable ×2 (c.mp4, d.mp4)
      notes: ...

Problems are collected with `on_error = "skip"` whatever the dataset says, so one bad file does not
hide the rest; nothing is written (no cache store is opened or created).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tuner.config.dataset import DatasetSpec
from tuner.data.datasets import discover_items
from tuner.data.frames import FrameRule
from tuner.data.jobs import LatentJob, plan_latent_jobs
from tuner.errors import ConfigError, DataError

# why an item was left out, by the words of the message that reported it (first match wins)
_REASONS = (
    ("too short", ("too short",)),
    ("undecodable", ("cannot read", "no decodable", "no video stream", "file not found", "truncated")),
    ("no control image", ("no control image", "control video")),
    ("bad mask", ("mask",)),
)


def reason_of(message: str) -> str:
    low = message.lower()
    return next((name for name, words in _REASONS if any(w in low for w in words)), "other")


@dataclass
class DatasetCheck:
    """What one dataset gives: its items, jobs, items dropped (by reason) and notes."""

    spec: DatasetSpec
    items: int = 0
    jobs: list[LatentJob] = field(default_factory=list)
    dropped: dict[str, list[str]] = field(default_factory=dict)  # reason -> item paths
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # the dataset cannot be used at all

    def lines(self) -> list[str]:
        spec = self.spec
        head = f"datasets[{spec.index}] at {spec.resolution[0]}x{spec.resolution[1]} ({spec.source})"
        head += " [validation]" if spec.validation else " [regularization]" if spec.regularization else ""
        if self.error:
            return [f"{head}: unusable: {self.error}"]
        unit = "images" if self.spec.kind == "image" else "clips"
        out = [f"{head}: {self.items} items → {len(self.jobs)} {unit}"]
        buckets = Counter(job.bucket_key for job in self.jobs)
        out.append(
            "  buckets: " + ", ".join(f"{k} ×{n}" for k, n in sorted(buckets.items(), key=lambda kv: -kv[1]))
        )
        if self.spec.kind == "video":
            frames = Counter(job.bucket[2] for job in self.jobs)
            out.append("  frames per clip: " + ", ".join(f"{f} ×{n}" for f, n in sorted(frames.items())))
        if self.dropped:
            count = sum(len(v) for v in self.dropped.values())
            parts = [
                f"{reason} ×{len(paths)} ({', '.join(Path(p).name for p in paths[:3])}"
                + (", ..." if len(paths) > 3 else "")
                + ")"
                for reason, paths in sorted(self.dropped.items())
            ]
            out.append(f"  dropped {count} items: " + ", ".join(parts))
        out += [f"  note: {n}" for n in self.notes]
        return out


def check_dataset(
    spec: DatasetSpec, step: int, rule: FrameRule, model_fps: float | None, probe=None
) -> DatasetCheck:
    """Plan one dataset as caching would (reading headers only) and say what it gives."""
    report = DatasetCheck(spec)
    skip = replace(spec, on_error="skip")
    kwargs = {"probe": probe} if probe else {}
    try:
        items, problems = discover_items(skip)
        report.items = len(items)
        jobs, more = plan_latent_jobs(skip, items, step, rule, model_fps, **kwargs)
    except (DataError, ConfigError) as e:
        report.error = str(e)
        return report
    report.jobs = jobs
    used = {job.source for job in jobs}
    for item in items:
        if item.path not in used:
            why = next((p for p in more if item.path in p), "")
            report.dropped.setdefault(reason_of(why), []).append(item.path)
    for message in problems:
        if message.endswith("item skipped."):  # discovery left it out (no control image)
            report.dropped.setdefault(reason_of(message), []).append(message.split(": ", 1)[0])
    dropped = [p for paths in report.dropped.values() for p in paths]
    report.notes = [m for m in problems + more if not any(p in m for p in dropped)]
    return report


def check_datasets(record, specs, log: Callable[[str], None] = print) -> list[DatasetCheck]:
    """`check_dataset` for each spec with the architecture record's step, frame rule and fps; logs the report."""
    rule = FrameRule(record.frame_multiple, record.frame_remainder)
    reports = []
    for spec in specs:
        report = check_dataset(spec, record.spatial_step, rule, record.model_fps)
        for line in report.lines():
            log(line)
        reports.append(report)
    return reports
