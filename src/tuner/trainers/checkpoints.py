"""Saving adapters and full training state, atomically, and finding them again to resume.

Layout of `save.output_dir`:

    <name>-step000250.safetensors      adapter at step 250 (ComfyUI-native keys)
    <name>.safetensors                 the final adapter
    state/step000250/                  the training state at step 250, no pickles (`trainers/state.py`):
        network.json/.safetensors      the adapter's (or model's) state dict
        optimizer.json/.safetensors    the optimizer's state dict
        scheduler.json/.safetensors    the lr scheduler's state dict
        rng_<rank>.json/.safetensors   each process's random generators (dropout draws from them)
        position.json                  step, epoch, batch within the epoch
        run.json                       what a resumed run must share (architecture, adapter shape)
        schedule.json                  max_steps and the lr schedule (a change is noted on resume)
        settings.json                  the seed, a hash of the epoch's data order and the other settings
                                       that change results (each change is named on resume)
        manifest.json                  every file above with its size and SHA-256; written last

The state is saved before the adapter (or full model) file: writing that file converts key names and
fuses layers, and if it fails the run must still be resumable. A state folder is written under a hidden
temporary name and renamed into place only after everything in it (the manifest last) is on disk, so a
run killed mid-save leaves the previous state usable and a half-written one is never taken for
complete. Resuming checks the folder against its manifest first and refuses, naming the file, anything
missing, truncated, changed or added (a planted pickle is never opened), and names the newest state
that does check out.

Nothing non-finite is saved: a network with a NaN or infinite weight is refused before the state and the
adapter are written. A disk that is full or not writable during a save gives one message (what it needs,
what is still intact), not a traceback.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from tuner.distributed.accounting import tree_bytes
from tuner.distributed.failures import together
from tuner.errors import CheckpointError
from tuner.io import probe_writable, write_text
from tuner.optimizers.build import averaged_weights
from tuner.trainers import state

STATE_DIR = "state"
POSITION = "position.json"
IDENTITY = "run.json"
SCHEDULE = "schedule.json"
SETTINGS = "settings.json"
PROCESSES = "processes.json"  # how many processes saved it, and over how many the batches were shared
_STEP = re.compile(r"step(\d+)$")


def check_output_dir(out: Path) -> None:
    """Refuse, before anything is loaded, an output folder that cannot hold the run's files."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(
            f"save.output_dir {out} is a file, not a folder; choose another save.output_dir."
        )
    try:
        probe_writable(out)
    except OSError as e:
        raise CheckpointError(
            f"save.output_dir {out} is not writable ({e.strerror}); choose another save.output_dir or fix "
            "its permissions."
        ) from None


class Checkpoints:
    def __init__(self, out_dir: Path, save_cfg, accelerator, identity: dict | None = None,
                 parts: dict | None = None, schedule: dict | None = None, strategy=None,
                 settings: dict | None = None, data_order=None):  # fmt: skip
        from tuner.distributed import Strategy

        self.out = Path(out_dir)
        self.cfg = save_cfg
        self.accelerator = accelerator
        # what a resumed run must share with the saved one (architecture, adapter shape and targets)
        self.identity = identity or {}
        # what a state holds: name -> object with state_dict / load_state_dict ("network", "optimizer",
        # "scheduler"); the random generators of every process are saved besides
        self.parts = parts or {}
        self.schedule = schedule or {}
        # what changes results without changing the state's shapes (`setup.run_settings`): named on resume
        self.settings = settings or {}
        # epoch -> a hash of that epoch's batch order (`setup.data_order`), or None
        self.data_order = data_order
        # how processes hold the parts (`tuner.distributed`): a sharded state is gathered to be saved
        self.strategy = strategy or Strategy(None)

    # ---- saving ----
    def save(self, network, pos, metadata: dict, export_name, final: bool = False) -> Path:
        """Save the full state (when `save.save_state`), then the adapter, for position `pos`; return the
        adapter path. The state goes first: exporting converts names and fuses layers, and an export
        that fails must leave the run resumable (`--resume latest`), never lose it."""
        acc = self.accelerator
        network = self._unwrapped(network)
        _check_finite(network, pos.step)
        name = self.cfg.output_name if final else f"{self.cfg.output_name}-step{pos.step:06d}"
        adapter = self.out / f"{name}.safetensors"
        try:
            if self.cfg.save_state:  # the final state too, so a finished run can be extended later
                self._save_state(network, pos)
            # an export that fails on the main process stops the others too (none waits at a barrier)
            with together(acc, f"saving the step {pos.step} adapter"), self.strategy.full_weights(network):
                if acc.is_main_process:
                    meta = {**metadata, "tuner.steps": str(pos.step), "tuner.epoch": str(pos.epoch)}
                    save = dict(dtype=_SAVE_DTYPES[self.cfg.precision], metadata=meta, format=self.cfg.format)
                    with averaged_weights(self.parts.get("optimizer")):  # schedule-free: export the average
                        network.save(adapter, export_name, **save)
                    if ema := self.parts.get("ema"):  # train.ema_decay: the average of the weights beside it
                        with ema.applied():
                            network.save(self.out / f"{name}-ema.safetensors", export_name, **save)
                    self._keep_last()
        except OSError as e:
            raise self._write_error(e, network, pos) from None
        # two-expert networks write one file per expert beside `adapter`; the first is returned
        self.written = network.files(adapter) if hasattr(network, "files") else [adapter]
        return self.written[0]

    def _save_state(self, network, pos) -> None:
        acc = self.accelerator
        root = self.out / STATE_DIR
        final = root / f"step{pos.step:06d}"
        tmp = root / f".tmp-step{pos.step:06d}"
        what = f"saving the state of step {pos.step}"
        # each barrier of a save is `together`: a write that fails on one process (the main one writes
        # nearly everything: a full disk) raises on every process, none is left waiting for it
        with together(acc, what):
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
        try:
            names = [f"rng_{r}.{ext}" for r in range(acc.num_processes) for ext in ("json", "safetensors")]
            # the gathers (collectives) first, before any process can fail on a write
            trees = {part_name: self.strategy.full_state_dict(part) for part_name, part in self.parts.items()}
            with together(acc, what):
                state.save_tree(state.rng_state(), tmp, f"rng_{acc.process_index}")
                if acc.is_main_process:
                    names += self._write_main_files(tmp, trees, pos)
            with together(acc, what):
                if acc.is_main_process:
                    state.write_manifest(tmp, names)  # last: marks the folder complete
                    shutil.rmtree(final, ignore_errors=True)
                    os.replace(tmp, final)
        except BaseException:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)  # free the space; the previous states are untouched
            raise

    def _write_main_files(self, tmp: Path, trees: dict, pos) -> list[str]:
        """The main process's files of a state (the parts, the scaler, the JSON files); their names."""
        names = []
        for part_name, tree in trees.items():
            names += state.save_tree(tree, tmp, part_name)
        if self.accelerator.scaler is not None:
            names += state.save_tree(self.accelerator.scaler.state_dict(), tmp, "scaler")
        for file, data in (
            (IDENTITY, self.identity),
            (SCHEDULE, self.schedule),
            (POSITION, asdict(pos)),
            (PROCESSES, self._processes()),
            (SETTINGS, self._settings(pos.epoch)),
        ):
            write_text(tmp / file, json.dumps(data, sort_keys=True, indent=1))
            names.append(file)
        return names

    def _write_error(self, e: OSError, network, pos) -> CheckpointError:
        """A save that failed for want of space or permission, said in one line with what is intact."""
        previous = [s for s in self.complete_states() if _step_of(s) < pos.step]
        intact = f"the previous state {previous[-1]} is intact" if previous else "no earlier state was saved"
        if e.errno == errno.ENOSPC:
            need = self._save_bytes(network) / 2**20
            return CheckpointError(
                f"no space left on {self.out}: need about {need:.0f} MB for a save (step {pos.step}); {intact}. "
                "Free some space or set save.keep_last, then continue with --resume latest."
            )
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            where = (
                Path(e.filename).parent if e.filename else self.out
            )  # the folder; the file was a temporary
            return CheckpointError(f"cannot write to {where} ({e.strerror}) at step {pos.step}; {intact}.")
        return CheckpointError(f"saving step {pos.step} failed: {e}; {intact}.")

    def _save_bytes(self, network) -> int:
        """About what one save writes: the adapter plus the state's tensors (network, optimizer, ...)."""
        total = tree_bytes(network.state_dict())
        if self.cfg.save_state:
            total += sum(tree_bytes(part.state_dict()) for part in self.parts.values())
        return total

    def _unwrapped(self, network):
        """The network inside a strategy's wrapper. One process wraps nothing, and accelerate's
        `unwrap_model` imports deepspeed (about 425 modules) wherever it is installed."""
        return network if self.strategy.name == "single" else self.accelerator.unwrap_model(network)

    def space_note(self, network, free_bytes: int | None = None) -> str | None:
        """A warning, before step 1, when the output folder's disk cannot hold the saves this run keeps
        (one save's size from the network and state, times `keep_last`, or times two when it keeps all)."""
        need = self._save_bytes(self._unwrapped(network)) * max(2, self.cfg.keep_last or 2)
        free = shutil.disk_usage(self.out).free if free_bytes is None else free_bytes
        if free >= need:
            return None
        return (
            f"{self.out} has {free / 2**30:.1f} GiB free; this run's saves need about {need / 2**30:.1f} GiB "
            f"({self._save_bytes(network) / 2**30:.2f} GiB each). Free some space, set save.keep_last, or "
            "save.save_state = false."
        )

    def _keep_last(self) -> None:
        k = self.cfg.keep_last
        if not k:
            return
        # every file of the steps before the last k: the adapter, its -ema twin, two experts' _high_noise /
        # _low_noise files
        pattern = re.compile(rf"{re.escape(self.cfg.output_name)}-step(\d+)([-_][A-Za-z_-]+)?\.safetensors$")
        saved = [(int(m.group(1)), f) for f in self.out.iterdir() if (m := pattern.match(f.name))]
        kept = sorted({step for step, _ in saved})[-k:]
        for step, old in saved:
            if step not in kept:
                old.unlink(missing_ok=True)
        for old in self.complete_states()[:-k]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- finding and loading ----
    def states(self) -> list[Path]:
        """Every state folder that got as far as its position file (complete or not), oldest first. A
        hidden `.tmp-stepN` folder is a save that never finished (killed mid-write): never a state."""
        root = self.out / STATE_DIR
        if not root.is_dir():
            return []
        dirs = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and _STEP.search(d.name) and
                ((d / POSITION).is_file() or state.is_complete(d))]  # fmt: skip
        return sorted(dirs, key=_step_of)

    def complete_states(self) -> list[Path]:
        """State folders with a manifest (not yet checked against it), oldest first."""
        return [d for d in self.states() if state.is_complete(d)]

    def resolve(self, resume: str) -> Path:
        """`latest` → the newest saved state folder; anything else is a state folder path."""
        if resume == "latest":
            states = self.states()
            if not states:
                raise CheckpointError(
                    f"--resume latest: no complete saved state in {self.out / STATE_DIR}. "
                    "Train with save.save_state = true and save.every_n_steps or every_n_epochs set."
                )
            return states[-1]
        path = Path(resume)
        if not path.is_dir() or not ((path / POSITION).is_file() or state.is_complete(path)):
            raise CheckpointError(
                f"--resume {resume}: not a complete training state (no {POSITION}); it may be a save that was "
                f"interrupted. Use a folder under {self.out / STATE_DIR} or --resume latest."
            )
        return path

    def load(self, resume: str) -> dict:
        """Check the state against its manifest, restore every part, and return the saved position."""
        path = self.resolve(resume)
        try:
            state.verify(path)
        except CheckpointError as e:
            raise CheckpointError(f"--resume {resume}: {e}. {self._fallback(path)}") from None
        self._check_identity(path)
        acc = self.accelerator
        saved_by = len(list(path.glob("rng_*.json")))
        # states from before processes.json: every process read its own share of the batches
        saved = json.loads((path / PROCESSES).read_text()) if (path / PROCESSES).is_file() else {}
        saved_shares, shares = saved.get("data_shares", saved_by), self._processes()["data_shares"]
        if saved_shares != shares:
            raise CheckpointError(
                f"--resume {path}: saved by {saved_by} process(es), resumed with {acc.num_processes} (the batches "
                f"shared {saved_shares} ways then, {shares} now). The saved position counts each process's own batches (each takes every N-th "
                "batch of an epoch) and the effective batch is N times the batch size, so it means another place "
                f"in the data and another schedule with another N. Resume with {saved_by} process(es), or start a "
                "new run from the saved adapter with network.network_weights."
            )
        if not (path / f"rng_{acc.process_index}.json").is_file():
            raise CheckpointError(
                f"--resume {path}: saved by {saved_by} process(es), resumed with {acc.num_processes}: process "
                f"{acc.process_index} has no saved random state there. Resume with {saved_by} process(es)."
            )
        scheduler = getattr(self.parts.get("scheduler"), "scheduler", self.parts.get("scheduler"))
        new_base_lrs = list(getattr(scheduler, "base_lrs", []))  # the resumed run's config set them
        for part_name, part in self.parts.items():
            self.strategy.load_full_state_dict(part, state.load_tree(path, part_name))
        if self.schedule_changes(path):
            _continue_on_new_schedule(scheduler, new_base_lrs)
        if acc.scaler is not None and (path / "scaler.json").is_file():
            acc.scaler.load_state_dict(state.load_tree(path, "scaler"))
        state.set_rng_state(state.load_tree(path, f"rng_{acc.process_index}"))
        return json.loads((path / POSITION).read_text())

    def schedule_changes(self, path: Path) -> list[str]:
        """How max_steps and the lr schedule differ from the ones the state at `path` was saved with."""
        if not (path / SCHEDULE).is_file():
            return []
        saved = json.loads((path / SCHEDULE).read_text())
        return [
            f"{k} {saved.get(k)!r} → {v!r}" for k, v in sorted(self.schedule.items()) if saved.get(k) != v
        ]

    def _settings(self, epoch: int) -> dict:
        values = json.loads(json.dumps(self.settings, default=str))  # tuples become lists, as in the file
        digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
        order = self.data_order(epoch) if self.data_order else None
        return {"values": values, "sha256": digest, "epoch": epoch, "data_order": order}

    def settings_changes(self, path: Path, step: int) -> list[str]:
        """Each difference between the settings, seed and data order the state at `path` was saved with
        and this run's, one line each (states saved before settings.json: none)."""
        if not (path / SETTINGS).is_file():
            return []
        saved = json.loads((path / SETTINGS).read_text())
        now = self._settings(saved["epoch"])
        if saved["sha256"] == now["sha256"] and saved["data_order"] == now["data_order"]:
            return []
        old, new = saved["values"], now["values"]
        lines = []
        for k in sorted(old.keys() | new.keys()):
            if old.get(k) == new.get(k):
                continue
            if k == "train.seed":
                lines.append(f"train.seed {old.get(k)!r} → {new.get(k)!r}: the noise, timesteps and data order "
                             f"after step {step} differ from the saved run's; this is not an exact resume")  # fmt: skip
            else:
                lines.append(f"{k} {old.get(k)!r} → {new.get(k)!r} since this state was saved")
        if saved["data_order"] != now["data_order"] and old.get("train.seed") == new.get("train.seed"):
            lines.append(f"the data order of epoch {saved['epoch'] + 1} differs from the saved run's (the datasets "
                         "or their settings changed): this is not an exact resume")  # fmt: skip
        return lines

    def _fallback(self, bad: Path) -> str:
        """Name the newest state older than `bad` that checks out, if any."""
        for older in reversed([s for s in self.complete_states() if _step_of(s) < _step_of(bad)]):
            try:
                state.verify(older)
            except CheckpointError:
                continue
            return f"The newest complete state before it is {older}: resume with --resume {older}"
        return "No earlier complete state is left; start a new run (network.network_weights can start it from a saved adapter)."

    def _processes(self) -> dict[str, int]:
        """How many processes run, and over how many the batches are shared (a pipeline's stages all read
        every batch): a state resumes where the second is the same."""
        shares = self.strategy.data_share(self.accelerator)[1]
        return {"processes": self.accelerator.num_processes, "data_shares": shares}

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


def _step_of(folder: Path) -> int:
    return int(_STEP.search(folder.name).group(1))


def _continue_on_new_schedule(scheduler, base_lrs: list[float]) -> None:
    """Loading a `LambdaLR` brings back the saved run's base learning rates (and each group's lr of its
    schedule); a resume with another schedule means to continue on the new one: its base rates, and each
    group's lr what the new schedule gives at the saved step."""
    if not base_lrs or not hasattr(scheduler, "lr_lambdas"):
        return
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(base_lrs, scheduler.lr_lambdas)]
    for group, base, lr in zip(scheduler.optimizer.param_groups, base_lrs, lrs):
        group["initial_lr"], group["lr"] = base, lr
    scheduler.base_lrs, scheduler._last_lr = list(base_lrs), lrs


def first_nonfinite(module, frozen_only: bool = False) -> str | None:
    """The name of the first floating-point parameter of `module` (of those not trained, with
    `frozen_only`) holding NaN or infinity, or None."""
    for name, param in module.named_parameters():
        if frozen_only and param.requires_grad:
            continue
        if param.is_floating_point() and param.element_size() > 1 and not torch.isfinite(param).all():
            return name  # (fp8 storage is skipped: torch has no isfinite for it)
    return None


def _check_finite(network, step: int) -> None:
    """Refuse to save weights that hold NaN or infinity (they would load and draw black images)."""
    if name := first_nonfinite(network):
        raise CheckpointError(
            f"step {step}: the trained weights hold NaN or infinite values (first: {name}); not saved. "
            "Lower train.learning_rate or network.alpha, or use bf16 instead of fp16."
        )


_SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
