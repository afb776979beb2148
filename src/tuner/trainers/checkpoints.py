"""Saving adapters and full training state, atomically, and finding them again to resume.

Layout of `save.output_dir`:

    <name>-step000250.safetensors      adapter at step 250 (ComfyUI-native keys)
    <name>.safetensors                 the final adapter
    state/step000250/                  accelerate state (adapter, optimizer, scheduler, RNG) +
                                       position.json (step, epoch, batch within the epoch)

The state is saved before the adapter (or full model) file: writing that file converts key names and
fuses layers, and if it fails the run must still be resumable. A state folder is written under a hidden
temporary name and renamed into place only after everything in it (position.json last) is on disk, so a
run killed mid-save leaves the previous state usable and a half-written one is never taken for
complete: `--resume latest` only considers folders that hold a position.json.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from tuner.errors import CheckpointError
from tuner.io import write_text

STATE_DIR = "state"
POSITION = "position.json"
IDENTITY = "run.json"
_STEP = re.compile(r"step(\d+)$")


class Checkpoints:
    def __init__(self, out_dir: Path, save_cfg, accelerator, identity: dict | None = None):
        self.out = Path(out_dir)
        self.cfg = save_cfg
        self.accelerator = accelerator
        # what a resumed run must share with the saved one (architecture, adapter shape and targets)
        self.identity = identity or {}

    # ---- saving ----
    def save(self, network, pos, metadata: dict, export_name, final: bool = False) -> Path:
        """Save the full state (when `save.save_state`), then the adapter, for position `pos`; return the
        adapter path. The state goes first: exporting converts names and fuses layers, and an export
        that fails must leave the run resumable (`--resume latest`), never lose it."""
        acc = self.accelerator
        name = self.cfg.output_name if final else f"{self.cfg.output_name}-step{pos.step:06d}"
        adapter = self.out / f"{name}.safetensors"
        if self.cfg.save_state:  # the final state too, so a finished run can be extended later
            self._save_state(pos)
        if acc.is_main_process:
            meta = {**metadata, "tuner.steps": str(pos.step), "tuner.epoch": str(pos.epoch)}
            acc.unwrap_model(network).save(
                adapter,
                export_name,
                dtype=_SAVE_DTYPES[self.cfg.precision],
                metadata=meta,
                format=self.cfg.format,
            )
            self._keep_last()
        acc.wait_for_everyone()
        return adapter

    def _save_state(self, pos) -> None:
        acc = self.accelerator
        root = self.out / STATE_DIR
        final = root / f"step{pos.step:06d}"
        tmp = root / f".tmp-step{pos.step:06d}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            write_text(tmp / IDENTITY, json.dumps(self.identity, sort_keys=True, indent=1))
            write_text(tmp / POSITION, json.dumps(asdict(pos)))  # last: marks the folder complete
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)

    def _keep_last(self) -> None:
        k = self.cfg.keep_last
        if not k:
            return
        adapters = sorted(self.out.glob(f"{self.cfg.output_name}-step*.safetensors"))
        for old in adapters[:-k]:
            old.unlink(missing_ok=True)
        for old in self.complete_states()[:-k]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- finding and loading ----
    def complete_states(self) -> list[Path]:
        root = self.out / STATE_DIR
        if not root.is_dir():
            return []
        dirs = [d for d in root.iterdir() if d.is_dir() and _STEP.search(d.name) and (d / POSITION).is_file()]
        return sorted(dirs, key=lambda d: int(_STEP.search(d.name).group(1)))

    def resolve(self, resume: str) -> Path:
        """`latest` → the newest complete state folder; anything else is a state folder path."""
        if resume == "latest":
            states = self.complete_states()
            if not states:
                raise CheckpointError(
                    f"--resume latest: no complete saved state in {self.out / STATE_DIR}. "
                    "Train with save.save_state = true and save.every_n_steps or every_n_epochs set."
                )
            return states[-1]
        path = Path(resume)
        if not (path / POSITION).is_file():
            raise CheckpointError(
                f"--resume {resume}: not a complete training state (no {POSITION}); it may be a save that was "
                f"interrupted. Use a folder under {self.out / STATE_DIR} or --resume latest."
            )
        return path

    def load(self, resume: str) -> dict:
        path = self.resolve(resume)
        self._check_identity(path)
        self.accelerator.load_state(str(path))
        return json.loads((path / POSITION).read_text())

    def _check_identity(self, path: Path) -> None:
        """Refuse, with the differences named, a state saved by a run with another adapter or model."""
        if not (path / IDENTITY).is_file():
            return
        saved = json.loads((path / IDENTITY).read_text())
        now = json.loads(json.dumps(self.identity))  # tuples become lists, as in the file
        changed = [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in sorted(saved.keys() | now.keys())
                   if saved.get(k) != now.get(k)]  # fmt: skip
        if changed:
            raise CheckpointError(
                f"--resume {path}: this state was saved with other settings ({'; '.join(changed)}). Resume "
                "with the settings it was saved with, or train into a new save.output_dir."
            )


_SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
