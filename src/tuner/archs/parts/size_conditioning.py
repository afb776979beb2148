"""Size conditioning: the model is told how each training picture was sized (SDXL's `time_ids`).

A record with `size_conditioning` set has caching store, in each item's latent entry, `time_ids`: the
source's (height, width), where the bucket's crop starts in the resized image (top, left) and the crop's
(height, width), as SDXL was trained. The family's `predict` reads `cond["time_ids"]`; generation, which
has no source, gives (H, W, 0, 0, H, W).
"""

from __future__ import annotations

import torch


def size_conditions(job) -> dict[str, torch.Tensor]:
    """The latent-entry tensors of one item (`tuner.data.jobs.LatentJob`: its source and crop)."""
    from tuner.data.media import probe_image

    width, height = probe_image(job.source)
    left, top, right, bottom = job.crop.box
    sizes = (height, width, top, left, bottom - top, right - left)
    return {"time_ids": torch.tensor(sizes, dtype=torch.float32)}
