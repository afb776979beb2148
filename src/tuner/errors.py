"""Errors a user can act on.

Every failure caused by the user's input (a config key, a file, a cache, a checkpoint) raises a
subclass of `TunerError`. The CLI prints its message without a traceback, so the message must name
the file or key and say what to do about it; `did_you_mean` adds the nearest known name to one.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """ " Did you mean 'x'?" for the candidate closest to a mistyped `name`, or "" when none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


class TunerError(Exception):
    """Base class for errors caused by input the user can fix."""


class ConfigError(TunerError):
    """A TOML file or a `--set` override is invalid."""


class DataError(TunerError):
    """A dataset item (image, video, caption, manifest line) cannot be read or is invalid."""


class CacheError(TunerError):
    """The cache store is missing entries, stale, or was written for something else."""


class CheckpointError(TunerError):
    """A model or adapter checkpoint cannot be loaded (wrong architecture, missing keys, corrupt)."""


class TrainingError(TunerError):
    """Training cannot go on (a loss or gradient that is NaN or infinite)."""


class TrainingStopped(Exception):
    """Training was stopped on request (SIGTERM or SIGINT) after saving a resumable state; not an error.
    The message names the state and the command that continues the run (`tuner.trainers.stop`)."""

    exit_code = 75  # what `tuner train` exits with (sysexits' EX_TEMPFAIL: try again later)
