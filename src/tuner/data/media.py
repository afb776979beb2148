"""Reading images and videos into pixels, with errors that name the file.

Images are read with Pillow. The EXIF orientation tag is applied (phones store portraits as rotated
landscapes plus a tag; ignoring it trains on sideways pictures). Transparency is composited on white:
a transparent PNG background is almost always "nothing", and white is what viewers show. (Masks from
an alpha channel, as FramePack's one-frame training uses, would need their own reader.)

Videos are read with PyAV. Decoding is sequential from the start, keeping only wanted frames: seeking
lands on keyframes and is codec-dependent, and training clips are short. Containers that do not record
a frame count (webm, mkv, some avi) are counted by demuxing packets, which reads the file without
decoding it. A *frame folder* (a directory of images sorted by name) is accepted wherever a video is.

Every unreadable, truncated or unsupported file raises `DataError` naming it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps

from tuner.errors import DataError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_EXTENSIONS = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif")


class VideoInfo(NamedTuple):
    n_frames: int
    fps: float | None  # None for a frame folder, whose rate nothing records
    width: int
    height: int


# ---------------------------------------------------------------- images


def open_image(path: str | os.PathLike) -> Image.Image:
    """The image file decoded as it is stored (a truncated file fails here), or `DataError` naming it."""
    try:
        img = Image.open(path)
        img.load()  # open() reads only the header; load() decodes, so a truncated file fails here
    except FileNotFoundError:
        raise DataError(f"{path}: file not found.") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(
            f"{path}: cannot read image ({e}). Re-export it or remove it from the dataset."
        ) from None
    return img


def read_image(path: str | os.PathLike) -> Image.Image:
    """An RGB image, upright per EXIF, transparency composited on white."""
    img = ImageOps.exif_transpose(open_image(path))
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def probe_image(path: str | os.PathLike) -> tuple[int, int]:
    """(width, height) as `read_image` will return it (EXIF rotations swap them), read from the
    file's header without decoding pixels: ~0.1 ms instead of ~12 ms for a 1024² PNG.

    Files that are not images fail here, and so do PNGs cut short (their chunk list ends early); a
    JPEG or WebP damaged after its header fails when it is read for encoding (`read_image`)."""
    try:
        with Image.open(path) as img:
            width, height = img.size
            if img.format == "PNG":
                exif = img.info.get("exif") or _png_trailing_exif(img.fp, path)
                orientation = Image.Exif()
                if exif:
                    orientation.load(exif)
                orientation = orientation.get(_ORIENTATION, 1)
            else:
                orientation = img.getexif().get(_ORIENTATION, 1)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found.") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DataError(
            f"{path}: cannot read image ({e}). Re-export it or remove it from the dataset."
        ) from None
    # orientations 5-8 are stored transposed (`ImageOps.exif_transpose` swaps width and height)
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


_ORIENTATION = 0x0112  # EXIF tag


def _png_trailing_exif(fp, path) -> bytes | None:
    """Walk a PNG's chunks from the start, reading each chunk's 8-byte head and seeking past its data,
    up to IEND; return an eXIf chunk found after the image data (Pillow only sees one placed before
    it without decoding). A file that ends before IEND is truncated: DataError."""
    fp.seek(8)  # the signature
    exif = None
    while True:
        head = fp.read(8)
        if len(head) < 8:
            raise DataError(f"{path}: the PNG ends before its IEND chunk (truncated). Re-export it.")
        length, kind = int.from_bytes(head[:4], "big"), head[4:]
        if kind == b"IEND":
            return exif
        if kind == b"eXIf":
            exif = fp.read(length)
            fp.seek(4, os.SEEK_CUR)
        else:
            fp.seek(length + 4, os.SEEK_CUR)  # data and CRC


# ---------------------------------------------------------------- frame folders


def frame_files(folder: str | os.PathLike) -> list[Path]:
    """The images of a frame folder, in name order (frame_0001.png, frame_0002.png ...)."""
    return sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)


def _probe_folder(folder: Path) -> VideoInfo:
    files = frame_files(folder)
    if not files:
        raise DataError(f"{folder}: frame folder holds no images ({', '.join(IMAGE_EXTENSIONS)}).")
    w, h = probe_image(files[0])
    return VideoInfo(len(files), None, w, h)


def _read_folder(
    folder: Path, indices: list[int], transform: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    files = frame_files(folder)
    frames = []
    for i in indices:
        if i >= len(files):
            raise DataError(f"{folder}: frame {i} requested but the folder holds {len(files)} images.")
        frames.append(transform(np.asarray(read_image(files[i]))))
    if len({f.shape for f in frames}) > 1:
        raise DataError(f"{folder}: frame images differ in size; every frame of a clip must match.")
    return np.stack(frames)


# ---------------------------------------------------------------- videos


def _video_error(path, e: Exception) -> DataError:
    return DataError(f"{path}: cannot read video ({e}). Re-encode it (e.g. to H.264 mp4) or remove it.")


def probe_video(path: str | os.PathLike) -> VideoInfo:
    """Frame count, frame rate and size of a video file or frame folder."""
    path = Path(path)
    if path.is_dir():
        return _probe_folder(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found.")
    import av  # here, not at the top: a run that trains from the cache never opens a video

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise DataError(f"{path}: no video stream in the file.")
            stream = container.streams.video[0]
            rate = stream.guessed_rate or stream.average_rate or stream.base_rate
            width, height = stream.codec_context.width, stream.codec_context.height
            n = stream.frames
            if n <= 0:  # not recorded by the container: count packets (one per frame for video codecs)
                n = sum(1 for packet in container.demux(stream) if packet.size > 0)
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise _video_error(path, e) from None
    if n <= 0 or width <= 0 or height <= 0:
        raise DataError(f"{path}: video has no decodable frames.")
    return VideoInfo(n, float(rate) if rate else None, width, height)


def probe_media(path: str | os.PathLike, video: bool) -> VideoInfo:
    """`probe_video`, or for an image `probe_image` as a one-frame VideoInfo without a rate."""
    if video:
        return probe_video(path)
    width, height = probe_image(path)
    return VideoInfo(1, None, width, height)


def read_video_frames(
    path: str | os.PathLike,
    indices: list[int] | tuple[int, ...],
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """The frames at `indices` (in that order, repeats allowed) as uint8 [F, H, W, 3] RGB.

    `transform` is applied to each kept frame as it is decoded (e.g. resize and crop), so a long 4K
    clip never sits in memory at full size.
    """
    transform = transform or (lambda frame: frame)
    path = Path(path)
    indices = list(indices)
    if not indices:
        raise ValueError("read_video_frames needs at least one index")
    if path.is_dir():
        return _read_folder(path, indices, transform)
    wanted = set(indices)
    last = max(indices)
    got: dict[int, np.ndarray] = {}
    decoded = 0
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"  # frame-threaded decoding; order of output frames is unchanged
            for i, frame in enumerate(container.decode(stream)):
                decoded = i + 1
                if i in wanted:
                    got[i] = transform(frame.to_ndarray(format="rgb24"))
                if i >= last:
                    break
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as e:
        raise _video_error(path, e) from None
    missing = sorted(wanted - got.keys())
    if missing:
        raise DataError(
            f"{path}: frame {missing[0]} requested but the video decodes to only {decoded} frames; "
            "the file may be truncated. Re-encode it (e.g. to H.264 mp4) or remove it, or set "
            'on_error = "skip" to leave it out.'
        )
    return np.stack([got[i] for i in indices])


# ---------------------------------------------------------------- tensors


def to_tensor(pixels: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] or [F, H, W, 3] → float32 [C, F, H, W] in [-1, 1], the layout video VAEs take."""
    if pixels.ndim == 3:
        pixels = pixels[None]
    t = torch.from_numpy(pixels.astype(np.float32))  # astype copies: PIL-backed arrays are read-only
    return t.permute(3, 0, 1, 2).contiguous().div_(127.5).sub_(1.0)
