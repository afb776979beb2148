"""The data layer used by caching: find items, plan what to encode, and read pixels.

    items, problems = discover_items(spec)                                   # datasets.py
    jobs, more = plan_latent_jobs(spec, items, step=16, valid_frames=FrameRule(4, 1), model_fps=16)
    pixels = load_job_pixels(jobs[0])                                        # [3, F, H, W] in [-1, 1]

`buckets.py` (aspect-ratio buckets, resize/crop, batches), `frames.py` (video frame windows and fps
resampling) and `media.py` (image/video decoding) are the pieces; `jobs.py` puts them together.
"""

from tuner.data.buckets import (
    Batch,
    Crop,
    bucket_sizes,
    choose_bucket,
    dataset_buckets,
    plan_batches,
    plan_crop,
    resize_and_crop,
    short_batch_warnings,
)
from tuner.data.datasets import discover_items
from tuner.data.frames import FrameRule, frame_windows, resample_indices, video_windows
from tuner.data.items import Item
from tuner.data.jobs import (
    LatentJob,
    load_control_pixels,
    load_job_pixels,
    plan_latent_jobs,
)
from tuner.data.media import VideoInfo, probe_image, probe_video, read_image, read_video_frames, to_tensor

__all__ = [
    "Batch",
    "Crop",
    "FrameRule",
    "Item",
    "LatentJob",
    "VideoInfo",
    "bucket_sizes",
    "choose_bucket",
    "dataset_buckets",
    "discover_items",
    "frame_windows",
    "load_control_pixels",
    "load_job_pixels",
    "plan_batches",
    "plan_crop",
    "plan_latent_jobs",
    "probe_image",
    "probe_video",
    "read_image",
    "read_video_frames",
    "resample_indices",
    "resize_and_crop",
    "short_batch_warnings",
    "to_tensor",
    "video_windows",
]
