"""`tuner timesteps`: the configured training-timestep distribution drawn as a PNG histogram.

Pillow only, so the command works without matplotlib. Every mode of `tuner.diffusion.timesteps` is drawn
the same way: `n` draws with seed 0 (after min/max), binned over [0, 1] as a density.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

from tuner.diffusion.timesteps import TimestepSampler
from tuner.io import atomic_path


def plot_histogram(
    sampler: TimestepSampler,
    out_png: str | Path,
    n: int = 100_000,
    bins: int = 50,
    seq_len: int | None = None,
) -> Path:
    """Draw `n` timesteps (seed 0) and write their histogram as a PNG; returns the path written."""
    t = sampler.sample(n, torch.Generator().manual_seed(0), seq_len=seq_len)
    density = torch.histc(t, bins=bins, min=0.0, max=1.0) * bins / n  # integrates to 1 over [0, 1]
    top = max(float(density.max()), 1e-12)

    width, height = 720, 440
    left, right, upper, lower = 70, 30, 60, 60  # margins around the plot area
    plot_w, plot_h = width - left - right, height - upper - lower
    x_axis_y = upper + plot_h
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=14)

    def text(x: float, y: float, s: str, align: str = "center") -> None:
        x0, y0, x1, y1 = draw.textbbox((0, 0), s, font=font)
        dx = {"center": (x1 - x0) / 2, "right": x1 - x0, "left": 0}[align]
        draw.text((x - dx, y - (y1 - y0) / 2), s, fill="black", font=font)

    for i, value in enumerate(density.tolist()):
        bar_h = value / top * plot_h
        x0, x1 = left + i * plot_w / bins, left + (i + 1) * plot_w / bins
        if bar_h > 0:
            draw.rectangle([x0, x_axis_y - bar_h, max(x0, x1 - 1), x_axis_y], fill=(70, 120, 190))

    draw.line([(left, upper), (left, x_axis_y), (left + plot_w, x_axis_y)], fill="black", width=2)
    for frac, label in ((0.0, "0"), (0.5, "0.5"), (1.0, "1")):
        x = left + frac * plot_w
        draw.line([(x, x_axis_y), (x, x_axis_y + 6)], fill="black", width=2)
        text(x, x_axis_y + 16, label)
    for frac in (0.0, 1.0):
        y = x_axis_y - frac * plot_h
        draw.line([(left - 6, y), (left, y)], fill="black", width=2)
        text(left - 10, y, f"{frac * top:.2f}", align="right")
    text(left + plot_w / 2, height - 20, "t  (0 = clean, 1 = noise; the model sees t * 1000)")
    text(left - 10, upper - 16, "density", align="left")
    text(width / 2, 20, f"timesteps: {sampler.describe(seq_len)}  [n={n}]")

    out = Path(out_png)
    with atomic_path(out) as tmp:
        image.save(tmp, format="PNG")
    return out
