"""`make demo`: the whole pipeline on a tiny Wan model and generated data, end to end, on the CPU.

    fixture (both checkpoint layouts) → dataset (images + videos with captions) → configs
    → tuner cache latents → tuner cache text → tuner train → tuner generate (with the LoRA)

Every step after the fixture runs through the real CLI entry point, exactly as a user would type it.
`--model DIR` takes a fixture written before (by an earlier demo, or `tuner.fixtures.write_fixture`)
instead of writing one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tuner.cli import main as tuner
from tuner.fixtures import fixture, write_fixture
from tuner.fixtures.dataset import write_demo_dataset
from tuner.registry import ARCHITECTURES

GENERAL_TOML = """\
[general]
resolution = [{width}, {height}]
caption_extension = ".txt"
batch_size = 2
cache_directory = "cache"
"""

IMAGES_TOML = """
[[datasets]]
image_directory = "data/images"
num_repeats = 2
"""

CONTROLS_TOML = """\
control_directory = "data/controls"
"""

VIDEOS_TOML = """
[[datasets]]
video_directory = "data/videos"
batch_size = 1
target_frames = [{frames}]
frame_extraction = "head"
source_fps = 24.0
"""

CONTROL_VIDEOS_TOML = """\
control_directory = "data/control_videos"
"""

TRAIN_TOML = """\
[model]
{model_section}dtype = "fp32"

[data]
dataset_config = "dataset.toml"
num_workers = 0

[cache]
device = "cpu"
batch_size = 4
text_max_length = 64

[network]
rank = 8
alpha = 8

[train]
learning_rate = 1e-3
max_steps = {steps}
mixed_precision = "no"
lr_warmup_steps = 5

[save]
output_dir = "output"
output_name = "demo_lora"
every_n_steps = 25
every_n_epochs = 0
keep_last = 2
"""


def data_kinds(architecture: str) -> tuple[bool, int]:
    """(whether the architecture trains on video, control images per item) for its demo data."""
    record = ARCHITECTURES[architecture]
    return record.supports_video, record.control_images[0]


def demo_size(architecture: str) -> tuple[int, int]:
    """The demo's (width, height): 64×48, with the height rounded up to the model's spatial step
    (64×64 for Wan 2.2 TI2V-5B, whose tokens cover 32 pixels)."""
    step = ARCHITECTURES[architecture].spatial_step
    return 64, -(-48 // step) * step


def demo_frames(architecture: str) -> int:
    """The demo's clip length: 9 frames, or the first count from 9 up the model accepts (22 for MiniMax
    H3's 17N+5)."""
    record = ARCHITECTURES[architecture]
    frames = 9
    while frames % record.frame_multiple != record.frame_remainder % record.frame_multiple:
        frames += 1
    return frames


def control_path(architecture: str, data: Path) -> Path:
    """`tuner generate`'s control for architectures that take one: the demo dataset's first control
    video for video models (Wan VACE), else its first control image."""
    video, _ = data_kinds(architecture)
    return data / "control_videos" / "video_000.mp4" if video else data / "controls" / "image_000.png"


def frame_image_args(architecture: str, data: Path) -> list[str]:
    """`tuner generate`'s frame images for image-to-video architectures (`--image` once or twice), from
    the demo dataset's images; none for the others."""
    count = ARCHITECTURES[architecture].frame_images
    return [arg for i in range(count) for arg in ("--image", str(data / "images" / f"image_{i:03d}.png"))]


def prepare(out: Path, steps: int = 50, model: Path | None = None, architecture: str = "wan") -> Path:
    """Write the fixture (unless `model` points at one), the dataset and both TOMLs; return the config."""
    spec = fixture(architecture)
    video, controls = data_kinds(architecture)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = out / "model"
        print(f"== fixture: tiny {architecture} in its checkpoint layouts → {model}")
        write_fixture(architecture, model)
    print(f"== dataset: generated images{' and videos' if video else ''} → {out / 'data'}")
    images = ARCHITECTURES[architecture].supports_images
    sound = ARCHITECTURES[architecture].audio_format is not None  # audio-video models: videos with a tone
    write_demo_dataset(out / "data", videos=2 if video else 0, controls=controls, tone=sound)
    width, height = demo_size(architecture)
    dataset = GENERAL_TOML.format(width=width, height=height)
    dataset += IMAGES_TOML + (CONTROLS_TOML if controls else "") if images else ""
    dataset += (
        VIDEOS_TOML.format(frames=demo_frames(architecture)) + (CONTROL_VIDEOS_TOML if controls else "")
        if video
        else ""
    )
    (out / "dataset.toml").write_text(dataset)
    config = out / "train.toml"
    section = spec.model_section.format(root=Path(model).resolve())
    config.write_text(TRAIN_TOML.format(steps=steps, model_section=section))
    return config


def run(out: Path, steps: int = 50, architecture: str = "wan", model: Path | None = None) -> dict[str, Path]:
    if model is not None and not Path(model).is_dir():
        raise SystemExit(f"--model {model}: no such folder; give the folder a fixture was written to, or leave "
                         "--model out to write one.")  # fmt: skip
    out = out.resolve()
    config = prepare(out, steps, model, architecture)
    video, controls = data_kinds(architecture)
    c = str(config)
    for argv in (
        ["cache", "latents", "--config", c],
        ["cache", "text", "--config", c],
        ["train", "--config", c],
        ["generate", "--config", c, "--prompt", "a red circle moving left on a black background",
         "--lora", str(out / "output" / "demo_lora.safetensors:1.0"), "--size", "{}x{}".format(*demo_size(architecture)),
         "--frames", str(demo_frames(architecture)) if video else "1",
         "--steps", "8", "--guidance", "3.0", "--device", "cpu",
         *(["--control", str(control_path(architecture, out / "data"))] * controls),
         *frame_image_args(architecture, out / "data"),
         "--out", str(out / "samples" / ("demo.mp4" if video else "demo.png"))],
    ):  # fmt: skip
        print(f"== tuner {' '.join(argv)}")
        if tuner(argv) != 0:
            raise SystemExit(f"demo step failed: tuner {' '.join(argv)}")
    paths = {
        "model": Path(model).resolve() if model is not None else out / "model",
        "dataset": out / "data",
        "config": config,
        "cache": out / "cache",
        "lora": out / "output" / "demo_lora.safetensors",
        "states": out / "output" / "state",
        "sample": out / "samples" / ("demo.mp4" if video else "demo.png"),
    }
    print("\n== done. Where everything is:")
    for name, path in paths.items():
        print(f"  {name:8s} {path}")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo_out")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--architecture", default="wan", choices=list(ARCHITECTURES))
    parser.add_argument(
        "--model", type=Path, help="the architecture's fixture written before; default: write one"
    )
    args = parser.parse_args(argv)
    run(Path(args.out), args.steps, args.architecture, args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
