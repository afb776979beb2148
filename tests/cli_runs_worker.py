"""Run by tests/test_cache_processes.py as the ranks of one launch: `tuner` commands in turn, as
`python -m tuner ...` runs each (one start-up of the processes instead of one per command).

argv: each command's arguments as one JSON list, e.g. '["cache", "latents", "--config", "p.toml"]'.
Before each command every process prints `RUN_MARK` and the command's index, so its output can be told
apart (`outputs`); the first command to fail ends the process with its exit status.
"""

from __future__ import annotations

import json
import sys

RUN_MARK = "---- tuner command "


def outputs(stdout: str, commands: int) -> list[str]:
    """Each command's output, every process's lines of it joined in the order they came."""
    parts = [""] * commands
    for chunk in stdout.split(RUN_MARK)[1:]:
        index, _, text = chunk.partition("\n")
        parts[int(index)] += text
    return parts


if __name__ == "__main__":
    from tuner.cli import main

    for index, argv in enumerate(sys.argv[1:]):
        print(f"{RUN_MARK}{index}", flush=True)
        code = main(json.loads(argv))
        sys.stdout.flush()
        if code:
            sys.exit(code)
