"""Resuming with other settings: what a resume says it does is what it does, and every difference from
the saved run (learning rate, seed, data order, other settings) is named, one line each.
docs/reliability.md lists the guarantees these back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from project import make_cached_project, run

STEPS = ("train.max_steps=4", "save.every_n_steps=2", "save.every_n_epochs=0", "log.every_n_steps=1",
         "log.tensorboard=false", "train.lr_scheduler='constant'", "train.learning_rate=1e-3", "train.lr_warmup_steps=0")  # fmt: skip


def _set(overrides) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def project(tmp_path_factory, wan_model):
    return make_cached_project(tmp_path_factory.mktemp("resume_project"), wan_model)


@pytest.fixture(scope="module")
def straight(project, tmp_path_factory):
    """A finished 4-step run at lr 1e-3 with states at steps 2 and 4."""
    out = tmp_path_factory.mktemp("straight") / "out"
    from project import tuner

    assert tuner(["train", "--config", str(project), "--set", f"save.output_dir='{out}'", *_set(STEPS)]) == 0
    return out


def _resume_from_step_2(
    straight: Path, tmp_path: Path, capsys, project, *extra: str
) -> tuple[int, str, Path]:
    out = tmp_path / "out"
    shutil.copytree(straight, out)
    shutil.rmtree(out / "state" / "step000004")
    code, log = run(capsys, "train", "--config", project, "--resume", out / "state" / "step000002",
                    "--set", f"save.output_dir='{out}'", *_set(STEPS), *_set(extra))  # fmt: skip
    return code, log, out


def _lrs(out: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["lr"] for line in lines if "lr" in line}


def test_a_resume_with_another_learning_rate_trains_on_with_it(straight, project, tmp_path, capsys):
    code, log, out = _resume_from_step_2(straight, tmp_path, capsys, project, "train.learning_rate=5e-4")
    assert code == 0, log
    assert "train.learning_rate 0.001 → 0.0005" in log, log
    assert "learning rate continues from step 2 on the new schedule" in log, log
    # what the note says is what the metrics show: the old rate up to step 2, the new one after it
    assert _lrs(out) == pytest.approx({1: 1e-3, 2: 1e-3, 3: 5e-4, 4: 5e-4}), _lrs(out)
    a, b = load_file(straight / "demo_lora.safetensors"), load_file(out / "demo_lora.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)  # not the 1e-3 run's adapter


def test_a_resume_with_the_same_settings_says_nothing_and_is_exact(straight, project, tmp_path, capsys):
    code, log, out = _resume_from_step_2(straight, tmp_path, capsys, project)
    assert code == 0, log
    assert "warning:" not in log and "note: the schedule" not in log, log
    a, b = load_file(straight / "demo_lora.safetensors"), load_file(out / "demo_lora.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_names_every_changed_setting_one_line_each(straight, project, tmp_path, capsys):
    code, log, _ = _resume_from_step_2(
        straight,
        tmp_path,
        capsys,
        project,
        "train.seed=7",
        "timesteps.discrete_flow_shift=5.0",
        "train.max_grad_norm=0.5",
    )
    assert code == 0, log
    warnings = [line for line in log.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3, log
    assert any("train.seed 42 → 7" in w and "not an exact resume" in w for w in warnings), warnings
    assert any("timesteps.discrete_flow_shift 3.0 → 5.0" in w for w in warnings), warnings
    assert any("train.max_grad_norm 1.0 → 0.5" in w for w in warnings), warnings


def test_a_resume_with_another_data_order_says_it_is_not_exact(straight, project, tmp_path, capsys):
    dataset = project.parent / "dataset_repeats.toml"  # beside the demo's, so its relative paths hold
    text = (project.parent / "dataset.toml").read_text()
    dataset.write_text(text.replace("num_repeats = 2", "num_repeats = 3"))
    code, log, _ = _resume_from_step_2(
        straight, tmp_path, capsys, project, f"data.dataset_config='{dataset}'"
    )
    assert code == 0, log
    assert "warning: the data order of epoch 1 differs" in log and "not an exact resume" in log, log
