"""Loss masks: a per-pixel weight on the training loss, from mask images or an image's alpha channel.

A mask says which part of a picture the adapter should learn (a face, a product) and which it may
ignore (a background it must not memorize). It comes from a `mask_directory` holding one greyscale
image per item, paired by file stem like control images (`cat.png` → `masks/cat.png`), or with
`alpha_mask` from the item's own alpha channel. White (opaque) is weight 1, black (transparent)
`mask_min_weight`, grey in between. A video's mask is an image (the same for every frame) or a video
of the same size, whose frames are taken at the item's frame indices.

The mask goes through the item's own plan: resized and cropped with its bucket's crop, then reduced
to the latent grid the VAE produced by averaging (each latent element covers spatial_step/patch
pixels a side, and for video VAEs like Wan's the first frame alone, then groups of frames). It is
cached beside the latents as `loss_mask` (so it enters the latent key: the mask file's contents and
`mask_min_weight`), and `ArchitectureModel.loss` multiplies the squared error by it, each sample's error
being its weighted mean (`tuner.diffusion.timesteps.weighted_mse`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from tuner.config.dataset import DatasetSpec
from tuner.data.buckets import Crop
from tuner.data.items import Item, describe, is_frame_folder, media_stem
from tuner.data.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, open_image, read_video_frames
from tuner.errors import DataError

ALPHA = "alpha"  # `LatentJob.mask` of an item whose mask is its own alpha channel


def pair_masks(spec: DatasetSpec, items: list[Item], problems: list[str]) -> list[Item]:
    """Items with `mask_path` set from `spec.mask_directory` (by stem). A mask without an item is an
    error naming it (a typo in a name would otherwise train that item unmasked); an item without a
    mask trains with weight 1 everywhere, and is named."""
    import dataclasses

    folder = Path(spec.mask_directory)
    exts = IMAGE_EXTENSIONS + (VIDEO_EXTENSIONS if spec.kind == "video" else ())
    masks = {
        media_stem(p): p
        for p in sorted(folder.iterdir())
        if (p.is_file() and p.suffix.lower() in exts) or (spec.kind == "video" and is_frame_folder(p))
    }
    stems = {media_stem(Path(item.path)) for item in items}
    orphans = sorted(stem for stem in masks if stem not in stems)
    if orphans:
        raise DataError(
            f"{masks[orphans[0]]}: a mask for a missing item (no {spec.kind} named {orphans[0]}.* in "
            f"{describe(spec)})"
            + (f", and {len(orphans) - 1} more" if len(orphans) > 1 else "")
            + ". Rename it to its item's file name or remove it."
        )
    out = []
    for item in items:
        mask = masks.get(media_stem(Path(item.path)))
        if mask is None:
            problems.append(f"{item.path}: no mask in {folder}; it trains with weight 1 everywhere.")
        out.append(dataclasses.replace(item, mask_path=str(mask) if mask else None))
    return out


def check_mask_size(
    mask_path: str, mask_size: tuple[int, int], item_path: str, item_size: tuple[int, int]
) -> None:
    if mask_size != item_size:
        raise DataError(
            f"{mask_path}: mask is {mask_size[0]}x{mask_size[1]} but its item {Path(item_path).name} is "
            f"{item_size[0]}x{item_size[1]}; a mask must have its item's size."
        )


# ---------------------------------------------------------------- pixels


def _crop_grey(img: Image.Image, crop: Crop) -> np.ndarray:
    """A greyscale mask resized and cut as the item's pixels were; float [H, W] in [0, 1]. Bilinear,
    not Lanczos: a weight must stay within [0, 1] (Lanczos rings past the edges)."""
    if img.size != crop.resized:
        img = img.resize(crop.resized, Image.Resampling.BILINEAR)
    return np.asarray(img.crop(crop.box), dtype=np.float32) / 255.0


def _alpha(path: str) -> Image.Image:
    img = ImageOps.exif_transpose(open_image(path))
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        return img.convert("RGBA").getchannel("A")
    return Image.new("L", img.size, 255)  # no alpha channel: everything counts


def load_job_mask(job) -> torch.Tensor:
    """The job's mask in pixels, cropped as its source was: float32 [1, F, H, W] in [0, 1] (F is 1
    for a mask image, whatever the item's frame count)."""
    if job.mask == ALPHA:
        return torch.from_numpy(_crop_grey(_alpha(job.source), job.crop))[None, None]
    path = Path(job.mask)
    if job.kind == "video" and (path.suffix.lower() in VIDEO_EXTENSIONS or path.is_dir()):
        frames = read_video_frames(path, job.frame_indices)
        grey = [_crop_grey(Image.fromarray(f).convert("L"), job.crop) for f in frames]
        return torch.from_numpy(np.stack(grey))[None]
    img = ImageOps.exif_transpose(open_image(path)).convert("L")
    return torch.from_numpy(_crop_grey(img, job.crop))[None, None]


def to_latent_grid(mask: torch.Tensor, grid: tuple[int, ...], min_weight: float) -> torch.Tensor:
    """Average a pixel mask [1, F, H, W] onto a latent grid (F', H', W') or (H', W'), then raise its
    floor to `min_weight`: [1, *grid], float32.

    Time first: F' == F keeps frames; a causal video VAE's F' = 1 + (F - 1)/k keeps the first frame
    alone and averages each following group of k (Wan: k = 4); any other ratio is averaged evenly.
    An image model's 2-D grid averages the frames away."""
    m = mask.float()
    frames = m.shape[1]
    if len(grid) == 2:
        m = m.mean(dim=1)
        m = F.adaptive_avg_pool2d(m[None], grid)[0]
    else:
        f_lat = grid[0]
        if frames == 1 and f_lat > 1:
            m = m.expand(1, f_lat, *m.shape[2:])
        elif f_lat > 1 and (frames - 1) % (f_lat - 1) == 0 and frames != f_lat:
            k = (frames - 1) // (f_lat - 1)
            rest = m[:, 1:].reshape(1, f_lat - 1, k, *m.shape[2:]).mean(dim=2)
            m = torch.cat([m[:, :1], rest], dim=1)
        elif frames != f_lat:
            m = F.adaptive_avg_pool3d(m[None], (f_lat, *m.shape[2:]))[0]
        m = F.adaptive_avg_pool2d(m, grid[1:])
    return (min_weight + (1.0 - min_weight) * m).contiguous()
