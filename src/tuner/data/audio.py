"""Reading the audio track of a video file for the frames a clip takes, and turning it into log-mel frames.

Audio-video models (LTX-2) learn a clip's sound together with its pictures, so a cached video clip
also holds the sound that plays while its frames are shown. A clip of frames `i..j` of a video at
`fps` shows from `i / fps` to `(j + 1) / fps` seconds; `audio_window` turns a job's frame indices into
that interval, and `read_audio_window` decodes the file's first audio stream with PyAV, resamples it
(`av.AudioResampler`: any codec, rate and layout in, float32 planar at the model's rate out) and cuts
exactly `round(duration · sample_rate)` samples starting at `round(start · sample_rate)`.

What can go wrong is named by file, as `tuner.data.media` does for pictures:

- no audio stream: `has_audio` says so (the dataset's `audio` option decides whether such an item
  trains video-only or is refused);
- a stream that fails to decode raises `DataError`, which caching handles by `on_error` like a bad
  frame (the file is named in `tuner cache info` when skipped);
- audio that ends before the clip's last frame raises `DataError` with the file name and both lengths:
  padding silence would teach the model that the clip's end is silent.

`log_mel` is the spectrogram audio VAEs take: magnitude STFT (Hann window, centred, reflect padding),
a Slaney-style triangular mel filter bank, and the natural log clamped at 1e-5.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from tuner.config.dataset import AudioMode
from tuner.errors import DataError


class AudioWindow(NamedTuple):
    """The seconds of sound a clip covers, and the rate and channel count it is read at."""

    start: float
    duration: float
    sample_rate: int
    channels: int

    @property
    def samples(self) -> int:
        return round(self.duration * self.sample_rate)

    def params(self) -> dict:
        """What a cache key needs to know besides the file's contents (JSON-friendly)."""
        return {
            "start": round(self.start, 9),
            "duration": round(self.duration, 9),
            "sample_rate": self.sample_rate,
            "channels": self.channels,
        }


def audio_window(frame_indices: tuple[int, ...], fps: float, sample_rate: int, channels: int) -> AudioWindow:
    """The sound played while frames `frame_indices[0]..frame_indices[-1]` are shown, at `fps`."""
    if not frame_indices or fps <= 0:
        raise ValueError("an audio window needs frame indices and a positive frame rate")
    first, last = frame_indices[0], frame_indices[-1]
    return AudioWindow(first / fps, (last + 1 - first) / fps, sample_rate, channels)


def _audio_error(path, e: Exception) -> DataError:
    return DataError(
        f"{path}: cannot decode its audio track ({e}). Re-encode it (e.g. AAC in mp4), remove it, or set "
        'on_error = "skip" to leave it out.'
    )


def has_audio(path: str | os.PathLike) -> bool:
    """Whether a video file has an audio stream (a frame folder never has one)."""
    path = Path(path)
    if path.is_dir():
        return False
    import av  # here, not at the top: a run that trains from the cache never opens a file

    try:
        with av.open(str(path)) as container:
            return bool(container.streams.audio)
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise _audio_error(path, e) from None


def read_audio(path: str | os.PathLike, sample_rate: int, channels: int) -> torch.Tensor:
    """The whole first audio stream of `path`, resampled: float32 [channels, samples] in [-1, 1]."""
    import av

    layout = {1: "mono", 2: "stereo"}[channels]
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=sample_rate)
    chunks = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise DataError(f"{path}: no audio stream in the file.")
            stream = container.streams.audio[0]
            for frame in container.decode(stream):
                chunks += [f.to_ndarray() for f in resampler.resample(frame)]
            chunks += [f.to_ndarray() for f in resampler.resample(None)]  # what the resampler holds back
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as e:
        raise _audio_error(path, e) from None
    if not chunks:
        return torch.zeros(channels, 0)
    return torch.from_numpy(np.concatenate(chunks, axis=1).astype(np.float32))


def read_audio_window(path: str | os.PathLike, window: AudioWindow) -> torch.Tensor:
    """The samples of `window`: float32 [channels, window.samples]. Audio that ends before the window
    does is refused with the file name (DataError)."""
    audio = read_audio(path, window.sample_rate, window.channels)
    start = round(window.start * window.sample_rate)
    end = start + window.samples
    if audio.shape[1] < end:
        have = audio.shape[1] / window.sample_rate
        raise DataError(
            f"{path}: its audio track lasts {have:.3f} s, shorter than the clip it belongs to "
            f"({window.start:.3f} s to {window.start + window.duration:.3f} s). Re-mux the file with "
            "its full sound, or choose target_frames that end before the sound does."
        )
    return audio[:, start:end].contiguous()


# ---------------------------------------------------------------- spectrograms


def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, math.log(6.4) / 27.0
    lin = f / f_sp
    return torch.where(f >= min_log_hz, min_log_hz / f_sp + torch.log(f / min_log_hz) / logstep, lin)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, math.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp
    return torch.where(m >= min_log_mel, min_log_hz * torch.exp(logstep * (m - min_log_mel)), f_sp * m)


def mel_filters(sample_rate: int, n_fft: int, mel_bins: int, f_min: float = 0.0, f_max: float | None = None):
    """[n_fft // 2 + 1, mel_bins] triangular filters, area-normalized (Slaney)."""
    f_max = f_max or sample_rate / 2
    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = _mel_to_hz(
        torch.linspace(
            _hz_to_mel(torch.tensor(f_min, dtype=torch.float64)).item(),
            _hz_to_mel(torch.tensor(f_max, dtype=torch.float64)).item(),
            mel_bins + 2,
            dtype=torch.float64,
        )
    )
    widths = edges[1:] - edges[:-1]
    slopes = edges[None, :] - freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0)
    return (filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]).float()


def log_mel(
    waveform: torch.Tensor, sample_rate: int, n_fft: int, hop_length: int, mel_bins: int
) -> torch.Tensor:
    """[C, S] waveform → [C, S // hop_length + 1, mel_bins] log-mel frames (time before frequency,
    the layout audio VAEs take)."""
    window = torch.hann_window(n_fft, dtype=waveform.dtype, device=waveform.device)
    spec = torch.stft(
        waveform, n_fft, hop_length, window=window, center=True, pad_mode="reflect", return_complex=True
    ).abs()  # [C, F, T]
    mel = torch.einsum("cft,fm->ctm", spec, mel_filters(sample_rate, n_fft, mel_bins).to(spec))
    return torch.log(torch.clamp(mel, min=1e-5))


# ---------------------------------------------------------------- planning


def plan_audio(
    path: str,
    mode: AudioMode,
    frame_indices: tuple[int, ...],
    fps: float | None,
    audio_format: tuple[int, int],
) -> AudioWindow | None:
    """The sound a video clip takes for a model that learns sound at `audio_format` = (sample rate,
    channels), or None when the clip trains video-only: `mode` "ignore", or "optional" and the file has
    no audio stream. "require" refuses such a file (DataError, handled by the dataset's `on_error`)."""
    if mode == "ignore" or not frame_indices:
        return None
    if not has_audio(path):
        if mode == "require":
            raise DataError(
                f'{path}: no audio track, and the dataset sets audio = "require". Add the sound, remove the '
                'file, or set audio = "optional" to train such clips video-only.'
            )
        return None
    if not fps:
        raise DataError(f"{path}: the file records no frame rate, so its sound cannot be matched to frames.")
    return audio_window(frame_indices, fps, *audio_format)
