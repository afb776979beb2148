"""The folders the UI may touch, and the one check every path from a request goes through.

`tuner ui --root DIR` (repeatable) names them; the runs folder is always one. A path is accepted when,
after `~` expansion and resolving every symlink and `..`, it lies inside a resolved root: a link that
points outside a root is refused like a path that names the outside directly.
"""

from __future__ import annotations

import os
from pathlib import Path

from tuner.errors import TunerError


class OutsideRoots(TunerError):
    """A request named a path outside the folders the UI was given."""


class BadPath(TunerError):
    """A request named something that cannot be a path (a NUL byte, a name too long for the system)."""


class Roots:
    def __init__(self, folders: list[str | os.PathLike]):
        if not folders:
            raise ValueError("the UI needs at least one root folder")
        self.folders = tuple(dict.fromkeys(Path(f).expanduser().resolve() for f in folders))

    def resolve(self, path: str | os.PathLike) -> Path:
        """`path` resolved (symlinks followed), or `OutsideRoots` when it is not inside a root.

        A relative path is taken from the first root."""
        if "\0" in str(path):
            raise BadPath(f"{str(path)!r}: a path cannot hold a NUL byte.")
        try:
            p = Path(path).expanduser()
            if not p.is_absolute():
                p = self.folders[0] / p
            resolved = p.resolve()
        except (OSError, RuntimeError) as e:  # a name too long, a symlink loop, no home for `~user`
            raise BadPath(f"{path}: not a usable path ({e}).") from None
        if not any(resolved == root or resolved.is_relative_to(root) for root in self.folders):
            raise OutsideRoots(
                f"{path}: outside the folders this UI may use ({', '.join(map(str, self.folders))}); "
                "start `tuner ui` with --root for it."
            )
        return resolved

    def contains(self, path: str | os.PathLike) -> bool:
        try:
            self.resolve(path)
        except OutsideRoots:
            return False
        return True
