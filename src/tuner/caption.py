"""`tuner caption DIR`: caption sidecar files (`clip.mp4` -> `clip.txt`) written by a vision-language model.

Every image and video in the folder (not its subfolders) is shown to the model with a prompt; a video as a
few evenly spaced frames. The answer, after the trigger word if one is given, is written beside the file
(atomically: a run killed midway leaves whole captions only). Files that already have a caption are
skipped unless asked otherwise, so a second run captions only what is new.

The model is any image-text-to-text model transformers loads by hub id or folder (`AutoProcessor` +
`AutoModelForImageTextToText`, prompted through its chat template); Qwen2.5-VL by default, whose processor
needs torchvision (its video processor is built on it, even though videos are shown as frames). The
walking, skipping and writing take any `Captioner` (frames, prompt -> text); the transformers captioner
is tested end to end on a tiny random LLaVA, whose processor needs only PIL.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.errors import DataError

if TYPE_CHECKING:  # the CLI reads the defaults below without loading image or model code
    from PIL import Image

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
DEFAULT_PROMPT = (
    "Describe this {kind} in one detailed paragraph: the subject, what happens, the setting, the style and "
    "the camera. Answer with the description only."
)
Captioner = Callable[[list["Image.Image"], str], str]
"""Frames (one for an image) and the prompt -> the caption."""


@dataclass(frozen=True)
class CaptionOptions:
    prompt: str = DEFAULT_PROMPT
    """The question asked of every file; `{kind}` becomes "image" or "video"."""
    trigger: str = ""
    """Word(s) put before every caption, e.g. "ohwx style" ("ohwx style, a cat on a sofa ...")."""
    overwrite: bool = False
    """Caption files that already have a caption again."""
    frames: int = 4
    """Frames shown of a video, evenly spaced from its first to its last."""
    extension: str = ".txt"
    """Suffix of the caption files."""


def media_files(folder: str | Path) -> list[Path]:
    """The images and videos in `folder`, sorted."""
    from tuner.data.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS

    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder.")
    suffixes = IMAGE_EXTENSIONS + VIDEO_EXTENSIONS
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes)


def read_frames(path: Path, count: int) -> list[Image.Image]:
    """An image as one frame; a video as `count` evenly spaced frames."""
    import numpy as np
    from PIL import Image

    from tuner.data.media import IMAGE_EXTENSIONS, probe_video, read_image, read_video_frames

    if path.suffix.lower() in IMAGE_EXTENSIONS:
        return [read_image(path).convert("RGB")]
    n = probe_video(path).n_frames
    indices = sorted({int(i) for i in np.linspace(0, n - 1, min(count, n)).round()})
    return [Image.fromarray(frame) for frame in read_video_frames(path, indices)]


def caption_folder(folder: str | Path, captioner: Captioner, opts: CaptionOptions = CaptionOptions()) -> dict:
    """Caption every image and video of `folder`; returns {"written": [...], "skipped": [...]} paths."""
    from tqdm import tqdm

    from tuner.data.media import IMAGE_EXTENSIONS

    written, skipped = [], []
    for path in tqdm(media_files(folder), desc="captioning", unit="file"):
        sidecar = path.with_suffix(opts.extension)
        if sidecar.exists() and not opts.overwrite:
            skipped.append(sidecar)
            continue
        kind = "image" if path.suffix.lower() in IMAGE_EXTENSIONS else "video"
        text = " ".join(captioner(read_frames(path, opts.frames), opts.prompt.format(kind=kind)).split())
        if opts.trigger:
            text = f"{opts.trigger}, {text}"
        tmp = sidecar.with_name(f".{sidecar.name}.tmp")
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, sidecar)
        written.append(sidecar)
    return {"written": written, "skipped": skipped}


def transformers_captioner(
    model: str = DEFAULT_MODEL, device: str = "auto", max_new_tokens: int = 200
) -> Captioner:
    """A `Captioner` over any image-text-to-text model (hub id or folder), greedy decoding."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        processor = AutoProcessor.from_pretrained(model)
    except OSError as e:  # not a folder, and the hub cannot give it (offline, not cached, no such repository)
        raise DataError(_unavailable(model, e)) from None
    except (
        ImportError
    ) as e:  # Qwen2-VL / Qwen2.5-VL: their processor holds a video processor built on torchvision
        if "torchvision" not in str(e).lower():
            raise
        raise DataError(
            f"{model}: its processor needs torchvision, which does not import here; install the torchvision "
            f"built for torch {torch.__version__.split('+')[0]}, or caption with a model whose processor needs "
            "only PIL (a LLaVA model, e.g. --model llava-hf/llava-1.5-7b-hf)."
        ) from None
    try:
        vlm = AutoModelForImageTextToText.from_pretrained(model, dtype=dtype).to(device).eval()
    except OSError as e:  # its weights are missing from the cache (a processor-only download)
        raise DataError(_unavailable(model, e)) from None

    @torch.no_grad()
    def caption(frames: list[Image.Image], prompt: str) -> str:
        content = [{"type": "image"} for _ in frames] + [{"type": "text", "text": prompt}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        inputs = processor(text=[text], images=frames, return_tensors="pt").to(device)
        out = vlm.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0]

    return caption


def _unavailable(model: str, error: OSError) -> str:
    """One line for a model transformers cannot load: why, and the command that fetches it."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if Path(model).expanduser().exists():
        return f"--model {model}: cannot be loaded from that folder ({first})."
    return (
        f"--model {model}: not a local folder, and not loaded from the hub ({first}); fetch it once online: "
        f"`hf download {model}`, or give --model a local folder."
    )
