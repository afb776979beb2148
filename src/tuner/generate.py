"""`tuner generate`: text → image or video with the base model and any number of LoRAs.

Every sampling setting left unset (steps, guidance, embedded guidance, shift, negative prompt) is the
architecture's `SamplingDefaults` (its record: the release's numbers, guidance in the release's own CFG
form), and the resolved values are logged. The models are loaded one at a time (text encoder, then transformer, then VAE) and each is dropped
before the next, so inference needs no more memory than the largest of them. The same pieces draw
the samples `tuner train` makes along the way (`[sample]`). LoRAs attach as forward
patches with a strength each; any of the layouts tuner reads (comfy, kohya, diffusers) works.

Two-expert models (Wan 2.2 A14B, `tuner.archs.parts.experts`) load both experts and switch at the boundary; they
take two LoRA lists, `loras` for the high-noise expert (`model.transformer`) and `loras_2` for the
low-noise one (`model.transformer_2`), as ComfyUI loads them separately.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image

from tuner import registry
from tuner.archs.parts.text_encoder_training import attach_text_adapters, attach_to_denoiser
from tuner.cache.plan import torch_device
from tuner.diffusion.sampling import flow_sigmas
from tuner.dtypes import DTYPES
from tuner.errors import CheckpointError, ConfigError
from tuner.io import atomic_path, probe_writable
from tuner.networks.keys import nonfinite_keys, read_safetensors


@dataclass(frozen=True)
class GenerateOptions:
    prompt: str
    out: str
    negative_prompt: str | None = None  # None: the record's (`SamplingDefaults`), as steps .. shift below
    loras: tuple[tuple[str, float], ...] = ()
    loras_2: tuple[tuple[str, float], ...] = ()  # two-expert models: for model.transformer_2 (low noise)
    controls: tuple[str, ...] = ()  # control / reference images for edit models
    # frame images: image-to-video models' first (and last) frame; TI2V's optional first frame
    images: tuple[str, ...] = ()
    width: int = 832
    height: int = 480
    frames: int = 81
    steps: int | None = None
    guidance_scale: float | None = None  # in the release's convention (the record's `cfg_form`)
    embedded_guidance: float | None = None  # guidance-distilled models: their guidance embedding's value
    shift: float | None = None  # resolution-dependent for FLUX / Qwen; DDPM models have none
    sampler: str = "euler"  # DDPM models (SDXL): "euler" or "dpm++2m"; flow models always use Euler
    # "auto": as the release guides (its record's `sample_guidance` APG, else CFG); "cfg"; "apg"
    guidance_method: str = "auto"
    seed: int = 0
    device: str = "auto"


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def resolve_options(family, opts: GenerateOptions) -> GenerateOptions:
    """`opts` with every sampling setting it leaves unset (None) taken from the architecture's
    `SamplingDefaults` for the configured transformer; the shift evaluated at the latent's token count."""
    defaults = family.sampling_defaults()
    opts = replace(
        opts,
        steps=defaults.steps if opts.steps is None else opts.steps,
        guidance_scale=defaults.guidance if opts.guidance_scale is None else opts.guidance_scale,
        embedded_guidance=defaults.embedded_guidance
        if opts.embedded_guidance is None
        else opts.embedded_guidance,
        negative_prompt=defaults.negative_prompt if opts.negative_prompt is None else opts.negative_prompt,
    )
    if opts.shift is None and family.record.objective == "flow":
        opts = replace(
            opts,
            shift=family.default_sample_shift(
                family.latent_shape(opts.width, opts.height, opts.frames), opts.steps
            ),
        )
    return opts


def sampling_summary(family, opts: GenerateOptions) -> str:
    """The settings `opts` samples with (resolved), as one line for the log."""
    opts = resolve_options(family, opts)
    defaults = family.sampling_defaults()
    used = replace(defaults, steps=opts.steps, guidance=opts.guidance_scale, shift=opts.shift,
                   embedded_guidance=opts.embedded_guidance, negative_prompt=opts.negative_prompt)  # fmt: skip
    return f"{family.architecture} sampling: {used.summary()} (defaults: {defaults.source})"


@contextmanager
def _collect_only_this_runs_objects():
    """What is alive before a generation (torch, diffusers, a caller's objects) is out of the collector's
    reach while it runs, so each `_release_memory` walks the models it dropped, not the whole heap again
    (0.2 s a collection in a fresh process, about 1 s in a test process); given back at the end."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def check_options(family, opts: GenerateOptions) -> None:
    """Size, frame count, control images and numbers the architecture accepts (before anything is
    loaded)."""
    arch, step = family.architecture, family.record.spatial_step
    given = opts
    opts = resolve_options(family, opts)
    for flag, value in (("--guidance", opts.guidance_scale), ("--shift", given.shift),
                        ("--embedded-guidance", opts.embedded_guidance)):  # fmt: skip
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{flag} {value}: must be a finite number.")
    if given.embedded_guidance is not None and family.sampling_defaults().embedded_guidance is None:
        raise ConfigError(
            f"--embedded-guidance {given.embedded_guidance}: {arch} takes no guidance-embedding value; use --guidance."
        )
    if family.record.objective != "flow" and given.shift is not None:
        raise ConfigError(
            f"--shift {given.shift}: a flow-matching option; {arch} samples its {family.record.objective.upper()} schedule."
        )
    if family.record.objective != "ddpm" and opts.sampler != "euler":
        raise ConfigError(
            f"--sampler {opts.sampler}: {arch} is sampled with Euler steps (the DDPM models take other samplers)."
        )
    if opts.guidance_method == "apg" and not family.record.sample_guidance:
        raise ConfigError(
            f"--guidance-method apg: {arch}'s release samples with CFG and names no APG settings; use cfg."
        )
    if opts.steps < 1:
        raise ConfigError(f"--steps {opts.steps}: must be at least 1.")
    if opts.width % step or opts.height % step:
        raise ConfigError(
            f"size {opts.width}x{opts.height}: both sides must be multiples of {step} for {arch}."
        )
    if not family.valid_frame_count(opts.frames):
        raise ConfigError(
            f"frames {opts.frames}: {arch} takes {family.record.frame_multiple}N+{family.record.frame_remainder} frames."
        )
    low, high = family.record.control_images
    if not low <= len(opts.controls) <= high:
        raise ConfigError(f"control images: {arch} takes {low} to {high}, got {len(opts.controls)}.")
    if family.record.first_frame_image:  # text-and-image-to-video: the first frame may be given
        if len(opts.images) > 1:
            raise ConfigError(f"frame images: {arch} takes at most one --image (the first frame).")
        if opts.images and opts.frames == 1:
            raise ConfigError(
                f"--image {opts.images[0]}: the given image is the first frame; ask for more (--frames 5+)."
            )
    elif len(opts.images) != family.record.frame_images:
        wanted = {0: "no frame image; leave --image out", 1: "the first frame (--image FIRST)",
                  2: "the first and last frame (--image FIRST --image LAST)"}[family.record.frame_images]  # fmt: skip
        raise ConfigError(f"frame images: {arch} takes {wanted}, got {len(opts.images)}.")
    if opts.frames < family.record.min_frames:
        raise ConfigError(f"frames {opts.frames}: {arch} needs at least {family.record.min_frames}.")


def encode_conditions(family, cfg, opts: GenerateOptions, device) -> tuple[dict, dict]:
    """(cond, uncond) for one prompt: text embeddings, plus the encoded control images of edit models
    and the first frame of text-and-image-to-video models (`first_frame`, with `clean_first` True: the
    frame is given, not generated). Loads the text encoder and, for images, the VAE, and drops each
    before returning."""
    opts = resolve_options(family, opts)
    control_pixels = [load_control(p, opts.width, opts.height, opts.frames) for p in opts.controls]
    encoder = family.load_text_encoder(device, cfg.cache.text_encoder_dtype)
    attach_text_adapters(family, encoder, opts.loras)  # SDXL files may hold its text encoders' parts
    # edit models whose text encoder sees the control images get them for both prompts, as in training
    seen = [control_pixels] if family.record.text_uses_controls else None
    with torch.no_grad():
        cond, uncond = (family.collate_text(family.encode_text(encoder, [p], seen))
                        for p in (opts.prompt, opts.negative_prompt))  # fmt: skip
    del encoder
    _release_memory()
    cond = {k: v.to(device) for k, v in cond.items()}
    uncond = {k: v.to(device) for k, v in uncond.items()}
    if family.sampling_defaults().zero_empty_negative and not opts.negative_prompt:
        uncond = {k: torch.zeros_like(v) for k, v in uncond.items()}
    first_frame = opts.images[0] if family.record.first_frame_image and opts.images else ""
    if control_pixels or first_frame:
        vae = family.load_vae(device, DTYPES[cfg.model.vae_dtype]).eval()
        vae_dtype = next(vae.parameters()).dtype
        with torch.no_grad():
            controls = family.encode_controls(
                vae, [px.unsqueeze(0).to(device, vae_dtype) for px in control_pixels]
            )
            if first_frame:
                first = load_control_image(first_frame, opts.width, opts.height).unsqueeze(0)
                controls["first_frame"] = family.encode_pixels(vae, first.to(device, vae_dtype))
                controls["clean_first"] = torch.ones(1, dtype=torch.bool, device=device)
        del vae
        _release_memory()
        cond, uncond = {**cond, **controls}, {**uncond, **controls}
    # image-to-video frames and one-frame references are conditions of both passes, as in training
    references = family.record.one_frame == "frames"
    if family.record.frame_images or references:
        if references:
            frames = [px[:, 0][None] for px in control_pixels]
        else:
            frames = [load_control_image(p, opts.width, opts.height)[:, 0][None] for p in opts.images]
        encoder = family.load_latent_encoder(device, DTYPES[cfg.model.vae_dtype]).eval()
        with torch.no_grad():
            given = family.encode_frame_images(encoder, [f.to(device) for f in frames], opts.frames)
        del encoder
        _release_memory()
        cond, uncond = {**cond, **given}, {**uncond, **given}
    return cond, uncond


def sample_latents(family, model, opts: GenerateOptions, cond: dict, uncond: dict, device, dtype,
                   progress: bool = True) -> torch.Tensor:  # fmt: skip
    """Denoise from the seed's noise to latents [1, ...] with the model as it is (adapters attached)."""
    opts = resolve_options(family, opts)
    guidance = family.sampling_defaults().plain_guidance(opts.guidance_scale)
    with _embedded_guidance(family, opts.embedded_guidance):
        return _sample_latents(family, model, opts, guidance, cond, uncond, device, dtype, progress)


@contextmanager
def _embedded_guidance(family, value: float | None):
    """Guidance-distilled models read their guidance embedding's value from `model.guidance` (what training
    feeds); while sampling it is `value`, then the configured one again."""
    if value is None or value == family.cfg.model.guidance:
        yield
        return
    configured = family.cfg
    family.cfg = replace(
        configured, file=replace(configured.file, model=replace(configured.model, guidance=value))
    )
    try:
        yield
    finally:
        family.cfg = configured


def _sample_latents(family, model, opts: GenerateOptions, guidance: float, cond: dict, uncond: dict, device,
                    dtype, progress: bool) -> torch.Tensor:  # fmt: skip
    shape = family.latent_shape(opts.width, opts.height, opts.frames)
    generator = torch.Generator().manual_seed(opts.seed)
    noise = torch.randn((1, *shape), generator=generator)

    def model_fn(x: torch.Tensor, t: torch.Tensor, c: dict) -> torch.Tensor:
        return family.predict(model, x.to(dtype), t / 1000, c).float()

    stream = family.sound_stream() if family.record.sound_stream else None
    sound_shape = stream.latent_shape(opts.frames) if stream is not None else None
    if sound_shape is not None:  # audio-video models: both streams denoised together, as one tensor
        sound = torch.randn((1, *sound_shape), generator=generator)  # drawn after the video's noise
        size = noise[0].numel()
        noise = torch.cat([noise.flatten(1), sound.flatten(1)], 1)

        sigmas = flow_sigmas(opts.steps, opts.shift)
        sound_sigmas = stream.sound_levels(sigmas, opts.shift)

        def model_fn(x: torch.Tensor, t: torch.Tensor, c: dict) -> torch.Tensor:  # noqa: F811
            video, audio = x[:, :size].reshape(-1, *shape), x[:, size:].reshape(-1, *sound_shape)
            t = t / 1000
            if stream.sound_shift is None:
                v, a = stream.predict_streams(model, video.to(dtype), t, audio.to(dtype), t, c)
            else:  # the sound down its own schedule: its Euler step scaled onto the video's
                i = int((sigmas - t[0].cpu()).abs().argmin())
                sound_t = torch.full_like(t, float(sound_sigmas[i]))
                v, a = stream.predict_streams(model, video.to(dtype), t, audio.to(dtype), sound_t, c)
                a = a * float((sound_sigmas[i + 1] - sound_sigmas[i]) / (sigmas[i + 1] - sigmas[i]))
            return torch.cat([v.float().flatten(1), a.float().flatten(1)], 1)

    if family.record.objective == "ddpm":  # SDXL: diffusers' Euler / DPM++ 2M on the trained schedule
        from tuner.diffusion.ddpm import ddpm_sample

        return ddpm_sample(model_fn, noise.to(device), family.training_objective(), opts.steps, cond, uncond,
                           guidance, opts.sampler, progress, family.combine_guidance)  # fmt: skip
    if family.record.objective == "edm":  # Cosmos 1.0: its pipelines' Karras levels, Euler in σ
        from tuner.diffusion.edm import edm_sample

        return edm_sample(model_fn, noise.to(device), opts.steps, cond, uncond, guidance, progress,
                          family.combine_guidance)  # fmt: skip
    sigmas = flow_sigmas(opts.steps, opts.shift, family.sampling_defaults().shift_terminal)
    with torch.no_grad():
        latents = family.sample_flow(model_fn, noise.to(device), sigmas, cond, uncond,
                                      guidance, progress, opts.guidance_method)  # fmt: skip
    if sound_shape is None:
        return latents
    size = math.prod(shape)
    return latents[:, :size].reshape(-1, *shape), latents[:, size:].reshape(-1, *sound_shape)


def decode_and_write(family, cfg, latents, out: str | Path, device) -> Path:
    """Load the VAE, decode, write the PNG or mp4, drop the VAE. `latents` is the video's, or for
    audio-video models (video, sound), whose sound is muxed into the mp4."""
    latents, sound = latents if isinstance(latents, tuple) else (latents, None)
    vae = family.load_vae(device, DTYPES[cfg.model.vae_dtype]).eval()
    with torch.no_grad():
        pixels = family.decode_latents(vae, latents)[0]
    del vae
    _release_memory()
    audio = None
    if sound is not None:
        with torch.no_grad():
            audio = family.sound_stream().decode(sound, device, DTYPES[cfg.model.vae_dtype])
        _release_memory()
    return write_media(pixels, out, family.record.model_fps, audio)


@_collect_only_this_runs_objects()
def generate(cfg, opts: GenerateOptions, log: Callable[[str], None] = print) -> Path:
    family = registry.architecture(cfg.model.architecture).family_model(cfg)
    check_options(family, opts)
    opts = resolve_options(family, opts)
    log(sampling_summary(family, opts))
    _check_out(opts.out)
    two_experts = family.record.boundary is not None
    if opts.loras_2 and not two_experts:
        raise ConfigError(f"--lora-2: {family.architecture} has one transformer; give its LoRAs with --lora.")
    for path, _ in (*opts.loras, *opts.loras_2):
        if not Path(path).is_file():
            raise ConfigError(f"--lora {path}: file not found.")
        if bad := nonfinite_keys(read_safetensors(path)[0]):
            raise CheckpointError(
                f"--lora {path}: {len(bad)} tensors hold NaN or infinity (e.g. {bad[0]}); the file is damaged "
                "(trained to NaN?) and would draw a black image. Use an earlier save."
            )
    device = torch_device(opts.device)
    dtype = DTYPES[cfg.model.dtype]

    cond, uncond = encode_conditions(family, cfg, opts, device)
    model = family.load_experts(dtype) if two_experts else family.load_transformer(dtype)
    family.merge_base_adapters(model)
    model.eval().requires_grad_(False)
    # the same memory switches as training (block swap, fp8, attention); activations need no offload
    family.apply_memory(model, replace(cfg.memory, activation_offload=False), device)
    targets = [(model, opts.loras)] if not two_experts else [(model.transformer, opts.loras),
                                                            (model.transformer_2, opts.loras_2)]  # fmt: skip
    for target, loras in targets:
        for path, strength in loras:
            network = attach_to_denoiser(family, target, path, strength)
            network.to(device)
            log(f"lora {path} × {strength}: {len(network)} modules")
    latents = sample_latents(family, model, opts, cond, uncond, device, dtype)
    if not all(torch.isfinite(x).all() for x in (latents if isinstance(latents, tuple) else (latents,))):
        raise CheckpointError(
            "the model produced NaN or infinite values; nothing written. Likely a damaged checkpoint or "
            "adapter, or fp16 overflow (use model.dtype = 'bf16')."
        )
    del model
    _release_memory()
    try:
        out = decode_and_write(family, cfg, latents, opts.out, device)
    except (OSError, av.error.FFmpegError) as e:  # the disk filled while writing: one line, no traceback
        raise ConfigError(
            f"--out {opts.out}: writing it failed ({getattr(e, 'strerror', None) or e}); nothing was written. "
            "Free some space or choose another --out."
        ) from None
    log(f"wrote {out}")
    return out


def _check_out(out: str | Path) -> None:
    """Refuse, before anything is loaded or sampled, an --out that cannot be written (the drawing would
    be lost after minutes of sampling)."""
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file name, e.g. --out {out / 'sample.png'}.")
    try:
        probe_writable(out.parent)
    except OSError as e:
        raise ConfigError(
            f"--out {out}: cannot write to {out.parent} ({e.strerror}); choose another --out or make the "
            "folder writable."
        ) from None


def load_control(path: str, width: int, height: int, frames: int) -> torch.Tensor:
    """A control image ([3, 1, H, W], `load_control_image`), or a control video's first `frames` frames
    resized and center-cropped to the output size: [3, frames, H, W] in [-1, 1] (a shorter video is refused)."""
    from tuner.data.buckets import resize_and_crop
    from tuner.data.media import VIDEO_EXTENSIONS, probe_media, read_video_frames, to_tensor

    if Path(path).suffix.lower() not in VIDEO_EXTENSIONS:
        return load_control_image(path, width, height)
    if (count := probe_media(path, True).n_frames) < frames:
        raise ConfigError(
            f"--control {path}: the control video has {count} frames; --frames {frames} needs as many."
        )
    array, _ = resize_and_crop(read_video_frames(path, list(range(frames))), (width, height))
    return to_tensor(array)


def load_control_image(path: str, width: int, height: int) -> torch.Tensor:
    """A control image resized and center-cropped to the output size, as caching does: [3, 1, H, W]."""
    from tuner.data.buckets import resize_and_crop
    from tuner.data.media import read_image, to_tensor

    array, _ = resize_and_crop(read_image(path), (width, height))
    return to_tensor(array)


def write_media(pixels: torch.Tensor, out: str | Path, fps: float, audio=None) -> Path:
    """[C, F, H, W] in [-1, 1] → a PNG (one frame, or `.png` asked) or an H.264 mp4; `audio` =
    (waveform [channels, samples] in [-1, 1], sample rate) adds an AAC track to the mp4."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    frames = (
        ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).cpu().numpy()
    )
    if out.suffix.lower() == ".png" or frames.shape[0] == 1:
        out = out.with_suffix(".png")
        with atomic_path(out) as tmp:  # never a half-written image
            Image.fromarray(frames[0]).save(tmp, format="PNG")
        return out
    out = out.with_suffix(".mp4")
    tmp = out.with_name(f".{out.name}.tmp.mp4")
    with av.open(str(tmp), mode="w") as container:
        stream = container.add_stream("libx264", rate=int(round(fps)))
        stream.height, stream.width = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
        stream.pix_fmt = "yuv420p"
        sound = _add_audio_stream(container, audio) if audio is not None else None
        for frame in frames:
            image = np.ascontiguousarray(frame[: stream.height, : stream.width])
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
        if sound is not None:
            _write_audio(container, sound, audio[0])
    tmp.replace(out)
    return out


def _add_audio_stream(container, audio):
    """An AAC stream for (waveform, rate), added before the first packet (the header names every stream)."""
    waveform, rate = audio
    return container.add_stream("aac", rate=int(rate), layout="stereo" if waveform.shape[0] == 2 else "mono")


def _write_audio(container, stream, waveform: torch.Tensor) -> None:
    samples = waveform.float().clamp(-1, 1).cpu().numpy()
    layout = "stereo" if samples.shape[0] == 2 else "mono"
    for start in range(0, samples.shape[1], 1024):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start : start + 1024]), format="fltp",
                                           layout=layout)  # fmt: skip
        frame.sample_rate, frame.pts = stream.rate, start
        container.mux(stream.encode(frame))
    container.mux(stream.encode())
