"""Full disks and folders that cannot be written or read, on every write path: the error each library
raises (safetensors' `SafetensorError`, SQLite's, the OS's) becomes one line naming the path and the fix,
and what was written before is kept. docs/reliability.md lists the guarantees these back.

Tests run as root here and in CI, where chmod does not stop a write: permission errors are injected by
monkeypatching instead."""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

import pytest
from safetensors import SafetensorError

import tuner.io
from project import cfg, make_cached_project, make_project, run, summary
from tuner.cache.store import CacheStore
from tuner.errors import CacheError, CheckpointError
from tuner.trainers import state, trainer_class

WanTrainer = trainer_class("wan")
STEPS = ("train.max_steps=4", "save.every_n_steps=2", "save.every_n_epochs=0", "log.tensorboard=false")


def _disk_full_after(monkeypatch, n: int) -> dict:
    """safetensors' own error for a full disk, from the (n+1)-th safetensors file written on."""
    real, calls = tuner.io.save_file, {"n": 0}

    def save_file(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] > n:
            raise SafetensorError(
                f'Error while serializing: I/O error: No space left on device (os error 28) at path "{filename}"'
            )
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(tuner.io, "save_file", save_file)
    return calls


@pytest.fixture(scope="module")
def project(tmp_path_factory, wan_model):
    return make_cached_project(tmp_path_factory.mktemp("writes_project"), wan_model)


def test_a_full_disk_while_saving_a_state_is_one_line_and_keeps_the_previous_state(
    project, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    t = WanTrainer(cfg(project, f"save.output_dir='{out}'", *STEPS))
    # a save writes network, optimizer, scheduler, rng tensors and the adapter: the second save fails
    _disk_full_after(monkeypatch, 5)
    with pytest.raises(CheckpointError) as e:
        t.train(log=lambda s: None)
    message = str(e.value)
    assert f"no space left on {out}: need about" in message and "step 4" in message, message
    assert f"the previous state {out / 'state' / 'step000002'} is intact" in message, message
    assert [p.name for p in (out / "state").iterdir()] == ["step000002"]
    state.verify(out / "state" / "step000002")


def test_a_full_disk_while_caching_keeps_what_was_committed_and_the_next_run_reuses_it(
    tmp_path, wan_model, capsys, monkeypatch
):
    config = make_project(tmp_path / "p", wan_model)
    # every entry is committed as it comes (commit_every_seconds = 0); the third shard meets a full disk
    _disk_full_after(monkeypatch, 2)
    code, log = run(capsys, "cache", "latents", "--config", config, "--set", "cache.commit_every_seconds=0")
    assert code == 2 and "Traceback" not in log, log
    line = next(line for line in log.splitlines() if line.startswith("error:"))
    assert "cannot write the cache shard" in line and "No space left on device" in line, line
    assert "the 2 committed before them are kept" in line and "Free some space on" in line, line
    monkeypatch.undo()
    code, log = run(capsys, "cache", "latents", "--config", config)
    assert code == 0, log
    encoded, reused, _ = summary(log)
    assert reused == 2 and encoded > 0, log


def test_caching_into_a_read_only_empty_cache_is_one_line(tmp_path, wan_model, capsys, monkeypatch):
    config = make_project(tmp_path / "p", wan_model)
    cache = config.parent / "cache"
    cache.mkdir()
    real = Path.mkdir

    def read_only(self, *args, **kwargs):  # a read-only mount: existing folders stay, new ones fail
        if self.is_relative_to(cache) and not self.exists():
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    code, log = run(capsys, "cache", "latents", "--config", config)
    assert code == 2 and "Traceback" not in log, log
    assert f"cannot write the cache store {cache}" in log and "Read-only file system" in log, log
    assert "set cache_directory" in log, log


def test_caching_into_a_read_only_filled_cache_is_one_line(project, capsys, monkeypatch):
    cache = project.parent / "cache"
    real = os.open

    def read_only(path, flags, *args, **kwargs):  # its lock files cannot be created there
        if Path(path).parent == cache and str(path).endswith(".lock") and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    code, log = run(capsys, "cache", "latents", "--config", project)
    assert code == 2 and "Traceback" not in log, log
    assert f"cannot write the cache store {cache}" in log and ".lock: Read-only file system" in log, log


def test_a_cache_unreadable_for_permissions_is_not_called_broken(project, monkeypatch):
    root = project.parent / "cache"
    index = root / "index.sqlite"

    def refused(*args, **kwargs):
        raise sqlite3.OperationalError("unable to open database file")

    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if Path(p) in (root, index) else real_access(p, mode)
    )
    monkeypatch.setattr(sqlite3, "connect", refused)
    for readonly in (True, False):
        with pytest.raises(CacheError) as e:
            CacheStore(root, readonly=readonly)
        message = str(e.value)
        assert (
            "a permission problem or a read-only mount, not damage" in message
            and "fix its permissions" in message
        ), message
        assert "delete" not in message, message


def test_generate_checks_its_output_folder_before_sampling(project, tmp_path, capsys, monkeypatch):
    import tuner.generate

    folder = tmp_path / "read_only"
    folder.mkdir()
    real = Path.write_bytes

    def denied(self, data):
        if self.parent == folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, data)

    sampled = []
    monkeypatch.setattr(Path, "write_bytes", denied)
    monkeypatch.setattr(tuner.generate, "sample_latents", lambda *a, **k: sampled.append(1))
    out = folder / "sample.png"
    code, log = run(capsys, "generate", "--config", project, "--prompt", "a red circle", "--size", "64x48",
                    "--frames", "1", "--steps", "1", "--device", "cpu", "--out", out)  # fmt: skip
    assert code == 2 and f"--out {out}: cannot write to {folder} (Permission denied)" in log, log
    assert not sampled and not out.exists()


def test_a_full_disk_while_generate_writes_is_one_line_and_leaves_no_file(
    project, tmp_path, capsys, monkeypatch
):
    from PIL import Image

    def full(self, fp, *args, **kwargs):
        Path(fp).write_bytes(b"\x89PNG half")  # a part was written before the disk filled
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(fp))

    monkeypatch.setattr(Image.Image, "save", full)
    out = tmp_path / "gen" / "sample.png"
    code, log = run(capsys, "generate", "--config", project, "--prompt", "a red circle", "--size", "64x48",
                    "--frames", "1", "--steps", "1", "--device", "cpu", "--out", out)  # fmt: skip
    assert code == 2 and f"--out {out}: writing it failed (No space left on device)" in log, log
    assert "Traceback" not in log and list(out.parent.iterdir()) == [], log
