"""Fault injection on the training side: what is kept, what is refused, and with which message.

Each test breaks something on purpose (a planted pickle, a damaged or truncated state file, a NaN, a full
or read-only disk, a kill at a random point) and checks that tuner refuses by name, keeps the previous
good state, and never writes a non-finite adapter. docs/reliability.md lists the guarantees these back.
"""

from __future__ import annotations

import errno
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tuner.io
from project import cfg, make_cached_project, run
from tuner.errors import CheckpointError, ConfigError, TrainingError
from tuner.trainers import state, trainer_class
from tuner.trainers.checkpoints import Checkpoints
from tuner.trainers.setup import setup

WanTrainer = trainer_class("wan")

STEPS = ("train.max_steps=4", "save.every_n_steps=2", "save.every_n_epochs=0", "network.dropout=0.1")


@pytest.fixture(scope="module")
def project(tmp_path_factory, wan_model):
    return make_cached_project(tmp_path_factory.mktemp("faults_project"), wan_model)


def trainer(config: Path, out: Path, *overrides: str, cls=WanTrainer) -> WanTrainer:
    return cls(cfg(config, f"save.output_dir='{out}'", "log.tensorboard=false", *overrides))


def train(config: Path, out: Path, *overrides: str, resume: str | None = None, log=None) -> WanTrainer:
    t = trainer(config, out, *overrides)
    t.train(resume=resume, log=log or (lambda s: None))
    return t


@pytest.fixture(scope="module")
def saved(project, tmp_path_factory):
    """A finished 4-step run with states at steps 2 and 4 (copy it before breaking it)."""
    out = tmp_path_factory.mktemp("saved") / "out"
    straight = train(project, out, *STEPS)
    return out, straight


def _copy(saved, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(saved[0], out)
    return out


def _resume_cli(capsys, project, out: Path, *extra: str) -> tuple[int, str]:
    return run(capsys, "train", "--config", project, "--resume", "latest", "--set", f"save.output_dir='{out}'",
               "--set", "log.tensorboard=false", "--set", "train.max_steps=6", "--set", "network.dropout=0.1",
               *extra)  # fmt: skip


# ---- 1. a pickle in a state folder runs nothing -------------------------------------------------


class _Payload:
    """Unpickling this creates the marker file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("name", ["custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin",
                                  "network.safetensors", "rng_0.safetensors"])  # fmt: skip
def test_a_planted_pickle_runs_nothing_and_is_refused_by_path(saved, project, tmp_path, capsys, name):
    out = _copy(saved, tmp_path)
    marker = tmp_path / "code_ran"
    planted = out / "state" / "step000004" / name
    planted.write_bytes(pickle.dumps(_Payload(marker)))
    code, log = _resume_cli(capsys, project, out)
    assert code == 2, log
    assert str(planted) in log, log
    assert not marker.exists()
    assert "step000002" in log  # the previous state that still checks out is offered


def test_no_state_file_is_a_pickle(saved):
    for path in (saved[0] / "state").rglob("*"):
        if path.is_file():
            head = path.read_bytes()[:2]
            assert head != b"\x80\x04" and head != b"PK", path  # pickle protocol 2+ / torch zip


# ---- 2. an incomplete or damaged state is refused, naming the file -----------------------------


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[:-7])


def _flip(p: Path):
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name, damage, says",
    [
        ("rng_0.safetensors", Path.unlink, "missing"),
        ("rng_0.json", _truncate, "bytes"),
        ("optimizer.safetensors", _truncate, "truncated"),
        ("network.safetensors", _flip, "changed"),
        ("scheduler.json", _flip, "changed"),
        ("manifest.json", Path.unlink, "incomplete"),
        ("manifest.json", _truncate, "damaged"),
    ],
)
def test_a_damaged_state_is_refused_by_name_and_the_previous_one_offered(
    saved, project, tmp_path, capsys, name, damage, says
):
    out = _copy(saved, tmp_path)
    target = out / "state" / "step000004" / name
    damage(target)
    code, log = _resume_cli(capsys, project, out)
    assert code == 2, log
    assert str(target.parent if name == "manifest.json" and says == "incomplete" else target) in log, log
    assert says in log, log
    assert f"--resume {out / 'state' / 'step000002'}" in log, log
    # and the offered state does resume, to the same adapter as a straight run
    code, log = run(capsys, "train", "--config", project, "--resume", out / "state" / "step000002",
                    "--set", f"save.output_dir='{out}'", "--set", "log.tensorboard=false", *_set(STEPS))  # fmt: skip
    assert code == 0, log
    _assert_same_adapter(saved[0], out)


def test_an_added_file_is_refused(saved, project, tmp_path, capsys):
    out = _copy(saved, tmp_path)
    extra = out / "state" / "step000004" / "notes.txt"
    extra.write_text("hello")
    code, log = _resume_cli(capsys, project, out)
    assert code == 2 and str(extra) in log and "did not save" in log, log


def test_a_state_of_an_older_tuner_is_refused_with_what_to_do(saved, project, tmp_path, capsys):
    out = _copy(saved, tmp_path)
    folder = out / "state" / "step000004"
    for p in folder.iterdir():
        if p.name != "position.json":
            p.unlink()
    torch.save({"step": 4}, folder / "random_states_0.pkl")
    code, log = _resume_cli(capsys, project, out)
    assert code == 2 and "older tuner" in log and "network.network_weights" in log, log


def _set(overrides) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _assert_same_adapter(a_dir: Path, b_dir: Path, name: str = "demo_lora.safetensors") -> None:
    a, b = load_file(a_dir / name), load_file(b_dir / name)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_tree_round_trip_keeps_types():
    tree = {"state": {0: {"step": torch.tensor(3.0), "m": torch.ones(2)}}, "groups": [{"betas": (0.9, 0.99),
            "lr": 1e-3, "fused": None, "flag": True, "params": [0]}], "name": "x"}  # fmt: skip
    folder = Path(__import__("tempfile").mkdtemp())
    state.save_tree(tree, folder, "t")
    back = state.load_tree(folder, "t")
    assert back["groups"][0]["betas"] == (0.9, 0.99) and isinstance(back["groups"][0]["betas"], tuple)
    assert list(back["state"]) == [0] and torch.equal(back["state"][0]["m"], torch.ones(2))
    with pytest.raises(CheckpointError, match="object"):
        state.save_tree({"bad": object()}, folder, "u")
    shutil.rmtree(folder)


# ---- 3. NaN and infinity --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.learning_rate=inf", "train.learning_rate"),
        ("network.alpha=inf", "network.alpha"),
        ("train.learning_rate=1e30", "train.learning_rate"),
        ("timesteps.logit_mean=nan", "timesteps.logit_mean"),
        ("train.optimizer_args={eps = nan}", "train.optimizer_args.eps"),
        ("train.validation_timesteps=[0.5, nan]", "train.validation_timesteps[1]"),
    ],
)
def test_non_finite_settings_are_refused_at_load(project, override, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        cfg(project, override)


class _NanAt(WanTrainer):
    """A trainer whose loss is NaN on the batches listed in `nan_batches` (counting from 0)."""

    nan_batches: tuple[int, ...] = ()

    def loss(self, *args, **kwargs):
        value = super().loss(*args, **kwargs)
        self.batches = getattr(self, "batches", 0) + 1
        return value * float("nan") if self.batches - 1 in self.nan_batches else value


def test_a_nan_loss_stops_training_naming_step_and_last_finite_loss(project, tmp_path):
    _NanAt.nan_batches = (2,)
    t = trainer(project, tmp_path / "out", *STEPS, cls=_NanAt)
    lines = []
    with pytest.raises(TrainingError) as e:
        t.train(log=lines.append)
    message = str(e.value)
    assert "step 3: loss nan" in message, message
    assert f"last finite loss was {t.history[1]:.4f} at step 2" in message, message
    assert "step000002" in message and "train.learning_rate" in message, message
    # nothing was saved after the bad step
    assert sorted(p.name for p in (tmp_path / "out" / "state").iterdir()) == ["step000002"]
    assert not (tmp_path / "out" / "demo_lora.safetensors").exists()


def test_non_finite_steps_can_be_skipped_up_to_a_count(project, tmp_path):
    _NanAt.nan_batches = (1,)
    lines = []
    t = trainer(project, tmp_path / "out", *STEPS, "train.max_nonfinite_steps=1", cls=_NanAt)
    t.train(log=lines.append)
    assert any("update skipped (1 of 1 allowed)" in line for line in lines), lines
    weights = load_file(tmp_path / "out" / "demo_lora.safetensors")
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_a_huge_adapter_scale_stops_instead_of_saving_nan(project, tmp_path, capsys):
    out = tmp_path / "out"
    code, log = run(capsys, "train", "--config", project, "--set", f"save.output_dir='{out}'",
                    "--set", "log.tensorboard=false", "--set", "network.alpha=1e30", *_set(STEPS))  # fmt: skip
    assert code == 2, log
    assert "training stopped" in log and "network.alpha" in log, log
    assert not list(out.glob("*.safetensors"))


def test_a_non_finite_network_is_never_saved(project, tmp_path):
    t = trainer(project, tmp_path / "out", *STEPS)
    run_ = setup(t, None, lambda s: None)
    next(run_.trained.parameters()).data[0] = float("inf")
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        run_.checkpoints.save(run_.trained, run_.pos, run_.metadata, t.layout)
    assert not list((tmp_path / "out").glob("*.safetensors"))
    assert not (tmp_path / "out" / "state").exists() or not any((tmp_path / "out" / "state").iterdir())


# ---- 7. unwritable or full places -----------------------------------------------------------------


def test_an_output_dir_that_is_a_file_is_refused_before_step_1(project, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("not a folder")
    code, log = run(capsys, "train", "--config", project, "--set", f"save.output_dir='{out}'",
                    "--set", "log.tensorboard=true", *_set(STEPS))  # fmt: skip
    assert code == 2 and f"save.output_dir {out} is a file" in log and "Traceback" not in log, log


def test_an_unwritable_output_dir_is_refused_before_step_1(project, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    real = Path.write_bytes

    def denied(self, data):
        if self.parent == out:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", denied)  # root ignores chmod; inject EACCES instead
    code, log = run(capsys, "train", "--config", project, "--set", f"save.output_dir='{out}'", *_set(STEPS))
    assert code == 2 and "not writable (Permission denied)" in log, log


def _fail_writes(monkeypatch, err: int, after: int):
    """Make every atomic write after the first `after` ones fail with `err` (ENOSPC, EACCES)."""
    real = tuner.io.atomic_path
    calls = {"n": 0}

    def failing(path):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(err, __import__("os").strerror(err), str(path))
        return real(path)

    monkeypatch.setattr(tuner.io, "atomic_path", failing)
    return calls


def _writes_per_save(saved) -> int:
    """Atomic writes in one save: the state's files (less the manifest's own entry) plus the adapter."""
    return len(list((saved[0] / "state" / "step000002").iterdir())) + 1


@pytest.mark.parametrize("err, says", [(errno.ENOSPC, "no space left on"), (errno.EACCES, "cannot write to")])
def test_a_full_or_unwritable_disk_during_a_save_keeps_the_previous_state(
    saved, project, tmp_path, monkeypatch, err, says
):
    out = tmp_path / "out"
    # the second save (step 4) fails part-way through its state
    _fail_writes(monkeypatch, err, after=_writes_per_save(saved) + 3)
    with pytest.raises(CheckpointError) as e:
        train(project, out, *STEPS)
    message = str(e.value)
    assert says in message and "step 4" in message, message
    assert f"the previous state {out / 'state' / 'step000002'} is intact" in message, message
    if err == errno.ENOSPC:
        assert f"no space left on {out}: need about" in message and "MB for a save" in message, message
    monkeypatch.undo()
    assert [p.name for p in (out / "state").iterdir()] == ["step000002"]  # no half-written folder left
    state.verify(out / "state" / "step000002")
    train(project, out, *STEPS, resume="latest")
    _assert_same_adapter(saved[0], out)


def test_too_little_free_space_for_the_saves_is_said_before_step_1(project, tmp_path, monkeypatch):
    from tuner.trainers import checkpoints

    real = shutil.disk_usage
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    said = []
    train(project, tmp_path / "out", "train.max_steps=1", log=said.append)
    warning = next(line for line in said if line.startswith("warning:"))
    assert "has 0.0 GiB free; this run's saves need about" in warning and "save.keep_last" in warning
    assert said.index(warning) < len(said) - 1  # said at setup, not at the end


# ---- 9. kills at seeded random points --------------------------------------------------------------


class _Killed(BaseException):
    """Stands for SIGKILL: not an Exception, so nothing on the way catches it."""


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_killed_at_a_random_point_then_resumed_equals_a_straight_run(
    saved, project, tmp_path, monkeypatch, seed
):
    """Kill during a step or inside a save (at the n-th file write), resume from what is left, until the
    run finishes: the final adapter equals the uninterrupted run's, bit for bit."""
    rng = random.Random(seed)
    out = tmp_path / "out"
    kills = []
    for _attempt in range(6):
        real_write, real_step = tuner.io.atomic_path, WanTrainer._step
        writes, steps = rng.randrange(1, 2 * _writes_per_save(saved)), rng.randrange(1, 8)
        counter = {"w": 0, "s": 0}

        def write(path, _real=real_write, _at=writes, counter=counter):
            counter["w"] += 1
            if counter["w"] == _at:
                raise _Killed
            return _real(path)

        def step(self, run_, batch, _real=real_step, _at=steps, counter=counter):
            counter["s"] += 1
            if counter["s"] == _at:
                raise _Killed
            return _real(self, run_, batch)

        monkeypatch.setattr(tuner.io, "atomic_path", write)
        monkeypatch.setattr(WanTrainer, "_step", step)
        resume = "latest" if Checkpoints(out, None, None).states() else None
        try:
            train(project, out, *STEPS, resume=resume)
            break
        except _Killed:
            kills.append("in a save" if counter["w"] == writes else f"in step {counter['s']}")
            continue
        finally:
            monkeypatch.undo()
    else:
        monkeypatch.undo()
        train(project, out, *STEPS, resume="latest" if Checkpoints(out, None, None).states() else None)
    assert kills, "nothing was killed"
    _assert_same_adapter(saved[0], out)


# ---- 3. non-finite adapter files; 8. pickled and damaged files -------------------------------------


def _nan_adapter(saved, tmp_path: Path) -> Path:
    tensors = load_file(saved[0] / "demo_lora.safetensors")
    key = next(k for k in sorted(tensors) if tensors[k].ndim == 2)
    tensors[key][0, 0] = float("nan")
    path = tmp_path / "nan_lora.safetensors"
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


def test_a_non_finite_adapter_is_flagged_by_info_and_refused_by_generate(saved, project, tmp_path, capsys):
    path = _nan_adapter(saved, tmp_path)
    code, log = run(capsys, "lora", "info", path)
    assert code == 0 and "WARNING" in log and "NaN or infinity" in log, log
    out = tmp_path / "sample.png"
    code, log = run(capsys, "generate", "--config", project, "--prompt", "a red circle", "--lora", f"{path}:1",
                    "--size", "64x48", "--frames", "1", "--steps", "1", "--device", "cpu", "--out", out)  # fmt: skip
    assert code == 2 and "NaN or infinity" in log and "Traceback" not in log, log
    assert not out.exists()


@pytest.mark.parametrize("name", ["lora.pt", "lora.ckpt", "renamed.safetensors"])
def test_a_pickled_adapter_is_refused_for_safety_with_how_to_convert(tmp_path, capsys, name):
    marker = tmp_path / "code_ran"
    path = tmp_path / name
    torch.save({"x.lora_A.weight": torch.zeros(2, 2), "payload": _Payload(marker)}, path)
    code, log = run(capsys, "lora", "info", path)
    assert code == 2 and "does not load pickled files" in log and "weights_only=True" in log, log
    assert "header too large" not in log and not marker.exists()


def test_a_pickled_base_checkpoint_is_refused_for_safety_not_called_damaged(tmp_path):
    from tuner.models.loading import load_tensors

    marker = tmp_path / "code_ran"
    path = tmp_path / "model.ckpt"
    torch.save({"w": torch.zeros(2), "payload": _Payload(marker)}, path)
    with pytest.raises(CheckpointError) as e:
        load_tensors(path)
    assert "does not load such files" in str(e.value) and "damaged" not in str(e.value)
    assert not marker.exists()


def test_a_truncated_adapter_is_refused_by_name(saved, tmp_path, capsys):
    path = tmp_path / "cut.safetensors"
    path.write_bytes((saved[0] / "demo_lora.safetensors").read_bytes()[:-100])
    code, log = run(capsys, "lora", "info", path)
    assert code == 2 and str(path) in log and "Traceback" not in log, log


# ---- 8. small things: upscaling, schedule changes on resume, batch larger than the data -----------


def test_items_much_smaller_than_their_bucket_are_noted_once_with_counts(project, tmp_path, capsys):
    from PIL import Image

    images = tmp_path / "small"
    images.mkdir()
    for i, size in enumerate([(16, 16), (16, 12), (64, 48)]):
        Image.new("RGB", size, (200, 10 * i, 0)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text("a small square")
    dataset = tmp_path / "dataset.toml"
    dataset.write_text(f'[general]\nresolution = [64, 48]\ncache_directory = "{tmp_path / "cache"}"\n'
                       f'[[datasets]]\nimage_directory = "{images}"\n')  # fmt: skip
    code, log = run(
        capsys, "cache", "latents", "--config", project, "--set", f"data.dataset_config='{dataset}'"
    )
    assert code == 0, log
    assert log.count("much smaller than their bucket") == 1 and "2 of 3 items" in log, log


def test_resume_with_another_max_steps_gets_a_note(saved, project, tmp_path, capsys):
    out = _copy(saved, tmp_path)
    code, log = _resume_cli(capsys, project, out)
    assert code == 0, log
    assert "note: the schedule changed" in log and "total_steps 4 → 6" in log, log


def test_a_batch_size_larger_than_the_data_shows_the_effective_batch(project, tmp_path, capsys):
    dataset = project.parent / "dataset_batch64.toml"  # beside the demo's, so its relative paths hold
    dataset.write_text(
        (project.parent / "dataset.toml").read_text().replace("batch_size = 2", "batch_size = 64")
    )
    out = tmp_path / "out"
    code, log = run(capsys, "train", "--config", project, "--set", f"data.dataset_config='{dataset}'", "--set",
                    f"save.output_dir='{out}'", "--set", "train.max_steps=1", "--set", "log.tensorboard=false")  # fmt: skip
    assert code == 0, log
    assert "effective batch 1/8 (datasets[0] has batch_size 64 but at most 8 items per bucket)" in log, log


@pytest.mark.slow
def test_sigkilled_inside_a_write_then_resumed_equals_a_straight_run(saved, project, tmp_path):
    """A real SIGKILL half-way through writing a file of a save (temporary files and a half-built state
    folder are left behind): resume takes the newest complete state and ends where a straight run does."""
    import os
    import subprocess
    import sys

    rng = random.Random(0)
    out = tmp_path / "out"
    worker = Path(__file__).parent / "kill_worker.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    killed = 0
    for _attempt in range(2):  # each costs a process start (~10 s)
        resume = "latest" if Checkpoints(out, None, None).states() else ""
        kill_at = rng.randrange(1, 2 * _writes_per_save(saved))
        done = subprocess.run([sys.executable, str(worker), str(project), str(out), str(kill_at), resume, *STEPS],
                              env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        if done.returncode == 0:
            break
        assert done.returncode == -9, done.stderr[-3000:]
        killed += 1
        assert any(p.name.endswith(".tmp") for p in out.rglob("*")), "the kill left no half-written file"
        for folder in Checkpoints(out, None, None).complete_states():
            state.verify(folder)  # whatever is listed as complete checks out
    assert killed
    resume = "latest" if Checkpoints(out, None, None).states() else None
    train(project, out, *STEPS, resume=resume)
    _assert_same_adapter(saved[0], out)


def test_a_save_killed_before_its_rename_is_never_taken_for_a_state(tmp_path):
    """A hidden `.tmp-stepN` folder (a save killed after its position file, before its manifest and rename)
    is not a state: `--resume latest` must not pick it, and a new run may start in that folder."""
    tmp = tmp_path / "state" / ".tmp-step000002"
    tmp.mkdir(parents=True)
    (tmp / "position.json").write_text('{"step": 2, "epoch": 0, "batch": 2}')
    checkpoints = Checkpoints(tmp_path, None, None)
    assert checkpoints.states() == []
    with pytest.raises(CheckpointError, match="no complete saved state"):
        checkpoints.resolve("latest")
    (tmp_path / "state" / "step000002").mkdir()
    (tmp_path / "state" / "step000002" / "position.json").write_text('{"step": 2, "epoch": 0, "batch": 2}')
    assert [p.name for p in checkpoints.states()] == ["step000002"]
