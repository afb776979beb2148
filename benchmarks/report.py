"""Markdown tables for the GPU benchmarks, and the sections of `docs/memory.md` they fill.

A benchmark prints its table in markdown as it goes and, given `--markdown FILE`, rewrites FILE after
every row, so a run that `gpu_suite.sh` stops at its time limit still leaves the rows it measured. The
suite then runs this script to put each file between its pair of marker comments in the doc:

    <!-- gpu-suite:NAME:begin -->
    (replaced on every run)
    <!-- gpu-suite:NAME:end -->

    python benchmarks/report.py docs/memory.md memory-1.3B=out/memory-1.3B.md ... \\
        --note memory-14B="stopped at its time limit" --environment

A section whose file is missing or empty says "not measured" (with its note, if given); `--environment`
fills the `environment` section with the GPU, the library versions and the commit measured.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

BEGIN, END = "<!-- gpu-suite:{}:begin -->", "<!-- gpu-suite:{}:end -->"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


class TableOut:
    """Prints a markdown table row by row and keeps `path` (if any) holding the table so far."""

    def __init__(self, path: Path | None, title: str, headers: Sequence[str]):
        self.path, self.title, self.headers = path, title, list(headers)
        self.rows: list[list[object]] = []
        self.notes: list[str] = []
        print(f"\n{title}\n\n" + table(self.headers, []), flush=True)

    def add(self, row: Sequence[object]) -> None:
        self.rows.append(list(row))
        print("| " + " | ".join(str(cell) for cell in row) + " |", flush=True)
        self._write()

    def note(self, line: str) -> None:
        """A line printed now and written under the table."""
        self.notes.append(line)
        print(line, flush=True)
        self._write()

    def _write(self) -> None:
        if self.path is not None:
            notes = "".join(f"\n{line}\n" for line in self.notes)
            self.path.write_text(f"{self.title}\n\n{table(self.headers, self.rows)}\n{notes}")


def replace_section(doc: str, name: str, body: str) -> str:
    """`doc` with the text between the markers of section `name` replaced by `body`."""
    begin, end = BEGIN.format(name), END.format(name)
    start, stop = doc.find(begin), doc.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"the doc has no section {name!r} (add the lines {begin} and {end})")
    return doc[: start + len(begin)] + "\n" + body.strip() + "\n" + doc[stop:]


def environment() -> str:
    """What was measured on: GPU, versions, commit, date."""
    import diffusers

    from tuner.attention import available_backends

    gpu = "no GPU"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return "\n".join(
        [
            f"Measured {datetime.date.today().isoformat()} at commit {commit or 'unknown'} on {gpu};",
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), diffusers {diffusers.__version__}; "
            f"attention backends available: {', '.join(available_backends(device))}.",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write benchmark tables into a doc's marked sections.")
    parser.add_argument("doc", type=Path)
    parser.add_argument("sections", nargs="*", metavar="NAME=FILE", help="a section and its table file")
    parser.add_argument("--note", action="append", default=[], metavar="NAME=TEXT", help="a line above it")
    parser.add_argument("--environment", action="store_true", help="fill the 'environment' section")
    args = parser.parse_args(argv)

    notes = dict(n.split("=", 1) for n in args.note)
    doc = args.doc.read_text()
    for name, file in (s.split("=", 1) for s in args.sections):
        path = Path(file)
        body = path.read_text().strip() if path.is_file() else ""
        note = notes.get(name, "")
        if not body:
            body = "**Not measured**" + (f": {note}." if note else ".")
        elif note:
            body = f"**{note}; the rows below are those measured by then.**\n\n{body}"
        doc = replace_section(doc, name, body)
    if args.environment:
        doc = replace_section(doc, "environment", environment())
    args.doc.write_text(doc)


if __name__ == "__main__":
    main()
