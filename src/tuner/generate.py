"""`tuner generate`: text → image or video with the base model and any number of LoRAs.

The models are loaded one at a time (text encoder, then transformer, then VAE) and each is dropped
before the next, so inference needs no more memory than the largest of them. The same pieces draw
the samples `tuner train` makes along the way (`[sample]`). LoRAs attach as forward
patches with a strength each; any of the layouts tuner reads (comfy, kohya, diffusers) works.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image

from tuner.cache.plan import torch_device
from tuner.dtypes import DTYPES
from tuner.errors import ConfigError
from tuner.memory import apply_memory_settings
from tuner.networks.factory import apply_adapter_file
from tuner.sampling import euler_sample, flow_sigmas
from tuner.trainers import trainer_class


@dataclass(frozen=True)
class GenerateOptions:
    prompt: str
    out: str
    negative_prompt: str = ""
    loras: tuple[tuple[str, float], ...] = ()
    controls: tuple[str, ...] = ()  # control / reference images for edit models
    width: int = 832
    height: int = 480
    frames: int = 81
    steps: int = 30
    guidance_scale: float = 5.0
    shift: float | None = None  # None: the architecture's default (resolution-dependent for FLUX / Qwen)
    seed: int = 0
    device: str = "auto"


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_options(trainer, opts: GenerateOptions) -> None:
    """Size, frame count and control images the architecture accepts (before anything is loaded)."""
    arch, step = trainer.architecture, trainer.spatial_step
    if opts.width % step or opts.height % step:
        raise ConfigError(
            f"size {opts.width}x{opts.height}: both sides must be multiples of {step} for {arch}."
        )
    if not trainer.valid_frame_count(opts.frames):
        raise ConfigError(
            f"frames {opts.frames}: {arch} takes {trainer.frame_multiple}N+{trainer.frame_remainder} frames."
        )
    low, high = trainer.control_images
    if not low <= len(opts.controls) <= high:
        raise ConfigError(f"control images: {arch} takes {low} to {high}, got {len(opts.controls)}.")


def encode_conditions(trainer, cfg, opts: GenerateOptions, device) -> tuple[dict, dict]:
    """(cond, uncond) for one prompt: text embeddings, plus the encoded control images of edit models.
    Loads the text encoder and, for controls, the VAE, and drops each before returning."""
    control_pixels = [load_control_image(p, opts.width, opts.height) for p in opts.controls]
    encoder = trainer.load_text_encoder(device, cfg.cache.text_encoder_dtype)
    # edit models whose text encoder sees the control images get them for both prompts, as in training
    seen = [control_pixels] if trainer.text_uses_controls else None
    with torch.no_grad():
        cond, uncond = (trainer.collate_text(trainer.encode_text(encoder, [p], seen))
                        for p in (opts.prompt, opts.negative_prompt))  # fmt: skip
    del encoder
    _release_memory()
    cond = {k: v.to(device) for k, v in cond.items()}
    uncond = {k: v.to(device) for k, v in uncond.items()}
    if control_pixels:
        vae = trainer.load_vae(device, DTYPES[cfg.model.vae_dtype]).eval()
        vae_dtype = next(vae.parameters()).dtype
        with torch.no_grad():
            controls = {f"control_{i}": trainer.encode_pixels(vae, px.unsqueeze(0).to(device, vae_dtype))
                        for i, px in enumerate(control_pixels)}  # fmt: skip
        del vae
        _release_memory()
        cond, uncond = {**cond, **controls}, {**uncond, **controls}
    return cond, uncond


def sample_latents(trainer, model, opts: GenerateOptions, cond: dict, uncond: dict, device, dtype,
                   progress: bool = True) -> torch.Tensor:  # fmt: skip
    """Denoise from the seed's noise to latents [1, ...] with the model as it is (adapters attached)."""
    shape = trainer.latent_shape(opts.width, opts.height, opts.frames)
    noise = torch.randn((1, *shape), generator=torch.Generator().manual_seed(opts.seed))
    shift = opts.shift if opts.shift is not None else trainer.default_sample_shift(shape)

    def model_fn(x: torch.Tensor, t: torch.Tensor, c: dict) -> torch.Tensor:
        return trainer.predict(model, x.to(dtype), t / 1000, c).float()

    with torch.no_grad():
        return euler_sample(model_fn, noise.to(device), flow_sigmas(opts.steps, shift), cond, uncond,
                            opts.guidance_scale, progress=progress, combine=trainer.combine_guidance)  # fmt: skip


def decode_and_write(trainer, cfg, latents: torch.Tensor, out: str | Path, device) -> Path:
    """Load the VAE, decode, write the PNG or mp4, drop the VAE."""
    vae = trainer.load_vae(device, DTYPES[cfg.model.vae_dtype]).eval()
    with torch.no_grad():
        pixels = trainer.decode_latents(vae, latents)[0]
    del vae
    _release_memory()
    return write_media(pixels, out, trainer.model_fps)


def generate(cfg, opts: GenerateOptions, log: Callable[[str], None] = print) -> Path:
    trainer = trainer_class(cfg.model.architecture)(cfg)
    check_options(trainer, opts)
    for path, _ in opts.loras:
        if not Path(path).is_file():
            raise ConfigError(f"--lora {path}: file not found.")
    device = torch_device(opts.device)
    dtype = DTYPES[cfg.model.dtype]

    cond, uncond = encode_conditions(trainer, cfg, opts, device)
    model = trainer.load_transformer(dtype).eval().requires_grad_(False)
    # the same memory switches as training (block swap, fp8, attention); activations need no offload
    settings = replace(cfg.memory, activation_offload=False)
    apply_memory_settings(
        model,
        settings,
        device,
        block_lists=trainer.record.block_lists,
        fp8_source=cfg.model.transformer,
        name_map=trainer.layout.inverse,
        compile=cfg.train.compile,
    )
    for path, strength in opts.loras:
        network = apply_adapter_file(model, path, strength, name_map=trainer.layout)
        network.to(device)
        log(f"lora {path} × {strength}: {len(network)} modules")
    latents = sample_latents(trainer, model, opts, cond, uncond, device, dtype)
    del model
    _release_memory()
    out = decode_and_write(trainer, cfg, latents, opts.out, device)
    log(f"wrote {out}")
    return out


def load_control_image(path: str, width: int, height: int) -> torch.Tensor:
    """A control image resized and center-cropped to the output size, as caching does: [3, 1, H, W]."""
    from tuner.data.buckets import resize_and_crop
    from tuner.data.media import read_image, to_tensor

    array, _ = resize_and_crop(read_image(path), (width, height))
    return to_tensor(array)


def write_media(pixels: torch.Tensor, out: str | Path, fps: float) -> Path:
    """[C, F, H, W] in [-1, 1] → a PNG (one frame, or `.png` asked) or an H.264 mp4."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    frames = (
        ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).cpu().numpy()
    )
    if out.suffix.lower() == ".png" or frames.shape[0] == 1:
        out = out.with_suffix(".png")
        Image.fromarray(frames[0]).save(out)
        return out
    out = out.with_suffix(".mp4")
    tmp = out.with_name(f".{out.name}.tmp.mp4")
    with av.open(str(tmp), mode="w") as container:
        stream = container.add_stream("libx264", rate=int(round(fps)))
        stream.height, stream.width = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            image = np.ascontiguousarray(frame[: stream.height, : stream.width])
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    tmp.replace(out)
    return out
