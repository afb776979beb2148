"""strategy = "deepspeed": ZeRO-2 and ZeRO-3 on two CPU processes (gloo, DeepSpeed's CPU accelerator)
train the weights one process trains on the same global batches, save the files one process saves (the
optimizer state consolidated into one process's state dict), and resume; bad settings are refused by name.

The reference is one process accumulating two batches per step (process r's i-th batch is the plan's batch
i * 2 + r; the loop draws each batch's noise by that place). Every two-process run of this file is one
launch of tests/distributed_deepspeed_worker.py (`runs`)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch import launch
from project import make_cached_project, make_project, train_wan
from tuner.archs.parts.text_encoder_training import attach_to_denoiser
from tuner.config import load_config
from tuner.errors import CheckpointError, ConfigError
from tuner.trainers import state

try:
    import deepspeed  # noqa: F401

    HAS_DEEPSPEED = True
except ImportError:
    HAS_DEEPSPEED = False
needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install tuner[deepspeed])"
)

WORKER = Path(__file__).parent / "distributed_deepspeed_worker.py"
STEPS = ["train.max_steps=3", "save.every_n_steps=2"]  # a state at step 2 to resume from, the final at 3
FULL = ["train.max_steps=2", "network.type='full'", "train.learning_rate=1e-4"]
DEEPSPEED = "distributed.strategy='deepspeed'"
STEP2 = "state/step000002"
# samples drawn by the main process (ZeRO-2 holds the whole model there) must not change the training
SAMPLES = ("sample.prompts=['a red circle']", "sample.every_n_steps=2", "sample.width=64", "sample.height=48",
           "sample.steps=2")  # fmt: skip


def _assert_same_files(a: Path, b: Path, atol: float = 1e-6) -> None:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys() and x
    for key in x:
        torch.testing.assert_close(x[key], y[key], rtol=0, atol=atol, msg=f"{key} differs")


def _assert_same_optimizer_state(a: Path, b: Path, atol: float = 1e-6) -> None:
    x, y = state.load_tree(a, "optimizer"), state.load_tree(b, "optimizer")
    assert len(x["state"]) == len(y["state"]) > 0
    assert [g["params"] for g in x["param_groups"]] == [g["params"] for g in y["param_groups"]]
    for i in y["state"]:
        assert x["state"][i].keys() == y["state"][i].keys()
        for key in y["state"][i]:
            torch.testing.assert_close(x["state"][i][key], y["state"][i][key], rtol=0, atol=atol)


@pytest.fixture(scope="module")
def project(tmp_path_factory, wan_model):
    return make_cached_project(tmp_path_factory.mktemp("ds") / "p", wan_model)


@pytest.fixture(scope="module")
def reference(project, tmp_path_factory):
    """One process, two batches accumulated per step: the global batch of two processes."""
    out = tmp_path_factory.mktemp("reference")
    train_wan(project, out, *STEPS, "train.gradient_accumulation_steps=2")
    return out


def _user_json(path: Path, zero: dict) -> Path:
    path.write_text(json.dumps({"zero_optimization": zero}))
    return path


@pytest.fixture(scope="module")
def runs(project, tmp_path_factory) -> dict[str, Path]:
    """Every two-process run of this file, in one launch: by name, the folder it trained into (its log
    and each process's measured memory in it). The resumed runs continue the state `zero2` saved at
    step 2; `zero3` reads a user's JSON that picks stage 3 and partitions every weight, however small
    (DeepSpeed may keep small ones whole on every process by default:
    stage3_param_persistence_threshold); `cpu` is told by accelerate's variable to use the CPU."""
    root = tmp_path_factory.mktemp("ds_runs")
    zero3_json = _user_json(root / "zero3.json", {"stage": 3, "stage3_param_persistence_threshold": 0})
    full_json = _user_json(root / "full.json", {"stage3_param_persistence_threshold": 0})
    zero3 = [
        DEEPSPEED,
        f"distributed.deepspeed_config='{zero3_json}'",
        "distributed.deepspeed_offload_optimizer=true",
    ]
    full = [DEEPSPEED, "distributed.deepspeed_stage=3", f"distributed.deepspeed_config='{full_json}'"]

    def resumed(name: str) -> dict:
        return {"copy": str(root / "zero2" / STEP2), "resume": str(root / name / STEP2)}

    specs = {
        "zero2": {"overrides": [*STEPS, DEEPSPEED, *SAMPLES]},
        "zero2_resumed": {"overrides": [*STEPS, DEEPSPEED], **resumed("zero2_resumed")},
        "zero3": {"overrides": [*STEPS, *zero3]},
        "zero3_resumed": {"overrides": [*STEPS, *zero3], **resumed("zero3_resumed")},
        "zero3_full": {"overrides": [*FULL, *full]},
        "cpu": {
            "overrides": ["train.max_steps=1", DEEPSPEED],
            "env": {"ACCELERATE_USE_CPU": "true"},
            "fails": True,
        },
    }
    file = root / "runs.json"
    file.write_text(json.dumps([{"out": str(root / name), **spec} for name, spec in specs.items()]))
    src = str(Path(__file__).parents[1] / "src")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    env.pop("ACCELERATE_USE_CPU", None)  # it turns accelerate's DeepSpeed plugin off
    result = launch([str(WORKER), str(project), str(file)], env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return {name: root / name for name in specs}


@needs_deepspeed
@pytest.mark.slow
def test_zero2_trains_as_one_process_and_resumes(project, reference, runs):
    zero2 = runs["zero2"]
    for name in ("demo_lora-step000002.safetensors", "demo_lora.safetensors"):
        _assert_same_files(zero2 / name, reference / name)
    # the optimizer state is one process's: every partition gathered into whole per-parameter moments
    _assert_same_optimizer_state(zero2 / "state/step000003", reference / "state/step000003")
    state.verify(zero2 / "state/step000003")
    assert [p.name for p in (zero2 / "samples").iterdir()] == ["demo_lora-step000002-00.png"]
    log = (zero2 / "log0.txt").read_text()
    assert "strategy: deepspeed ZeRO-2 over 2 processes; per process: parameters" in log

    # resumed from the step-2 state on two processes: the same final weights as the uninterrupted run
    resumed = runs["zero2_resumed"]
    _assert_same_files(resumed / "demo_lora.safetensors", reference / "demo_lora.safetensors")

    # one process cannot continue it (a position counts each process's batches): refused by name
    from tuner.trainers import trainer_class

    WanTrainer = trainer_class("wan")

    cfg = load_config(project, [f"save.output_dir='{resumed}'", "log.tensorboard=false", *STEPS])
    with pytest.raises(CheckpointError, match="saved by 2 process"):
        WanTrainer(cfg).train(resume=str(resumed / STEP2), log=lambda s: None)

    # the adapter file loads in a one-process model like any other
    trainer = WanTrainer(cfg)
    model = trainer.load_transformer(torch.float32)
    network = attach_to_denoiser(trainer, model, zero2 / "demo_lora.safetensors", 1.0)
    saved = load_file(zero2 / "demo_lora.safetensors")
    for key, tensor in network.file_state_dict().items():
        torch.testing.assert_close(tensor, saved[key])


@needs_deepspeed
@pytest.mark.slow
def test_zero3_from_a_user_json_with_offload(reference, runs):
    out = runs["zero3"]
    _assert_same_files(out / "demo_lora.safetensors", reference / "demo_lora.safetensors")
    _assert_same_optimizer_state(out / "state/step000003", reference / "state/step000003")
    log = (out / "log0.txt").read_text()
    assert "trainable parameters  22,528" in log  # counted whole, not as this process's partition
    assert "ZeRO-3 (optimizer offloaded to host) over 2 processes" in log
    # DeepSpeed's partitions: stage 3 holds half the weights stage 2 holds; both a half of the gradients
    # and optimizer state of what trains (22,528 fp32 elements: 45,056 bytes of master weights each)
    z2, z3 = (json.loads((run / "memory0.json").read_text()) for run in (runs["zero2"], out))
    assert z3["parameters"] == pytest.approx(z2["parameters"] / 2, rel=0.01)
    assert z2["master"] == z3["master"] == 22_528 * 4 // 2
    assert z2["moments"] == z3["moments"] == 2 * z2["master"]  # AdamW: two moments per element

    # a ZeRO-2 state resumes under ZeRO-3 with offload: the consolidated state is the same file
    resumed = runs["zero3_resumed"]
    _assert_same_files(resumed / "demo_lora.safetensors", reference / "demo_lora.safetensors")


@needs_deepspeed
@pytest.mark.slow
def test_zero3_full_finetune_partitions_the_whole_model(project, runs, tmp_path):
    reference = tmp_path / "one"
    train_wan(project, reference, *FULL, "train.gradient_accumulation_steps=2")
    out = runs["zero3_full"]
    # the saved model is whole (gathered from both processes' partitions) and as one process trains it
    _assert_same_files(out / "demo_lora.safetensors", reference / "demo_lora.safetensors")
    _assert_same_optimizer_state(out / "state/step000002", reference / "state/step000002")
    whole = sum(t.numel() * 4 for t in load_file(reference / "demo_lora.safetensors").values())
    memory = json.loads((out / "memory0.json").read_text())
    # each process: half the weights, half their gradients, half the master copy and moments
    assert memory["parameters"] == memory["gradients"] == memory["master"] == whole // 2
    assert memory["moments"] == whole


@needs_deepspeed
@pytest.mark.slow
def test_told_to_use_the_cpu_accelerate_starts_no_deepspeed_and_says_so(runs):
    for rank in range(2):
        error = (runs["cpu"] / f"error{rank}.txt").read_text()
        assert "accelerate did not start DeepSpeed" in error and "unset ACCELERATE_USE_CPU" in error, error


# ---- refusals (one process, no training) ----


def _check(config: Path, *overrides: str, world: int = 2) -> None:
    from tuner.trainers import trainer_class

    WanTrainer = trainer_class("wan")
    from tuner.distributed.deepspeed import DeepSpeedStrategy

    cfg = load_config(config, [DEEPSPEED, *overrides])
    DeepSpeedStrategy(cfg).check(WanTrainer(cfg), world)


@pytest.fixture
def config(tmp_path, wan_model):
    return make_project(tmp_path / "p", wan_model)


@needs_deepspeed
@pytest.mark.parametrize(
    "content, overrides, message",
    [
        (None, [], r"no file .*missing\.json"),
        ("{not json", [], r"ds\.json is not valid JSON \(.* line 1"),
        ("[1, 2]", [], "holds a JSON list"),
        ('{"zero_optimization": {"stage": 3}}', ["distributed.deepspeed_stage=2"],
         r"zero_optimization.stage = 3, but distributed.deepspeed_stage makes it 2"),
        ('{"zero_optimization": {"stage": 1}}', [], "runs ZeRO stages 2 and 3"),
        ('{"gradient_accumulation_steps": 4}', [],
         "gradient_accumulation_steps = 4, but train.gradient_accumulation_steps makes it 1"),
        ('{"gradient_clipping": 0.5}', ["train.max_grad_norm=1.0"], "but train.max_grad_norm makes it 1.0"),
        ('{"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}',
         ["distributed.deepspeed_offload_optimizer=false"], "distributed.deepspeed_offload_optimizer"),
        ('{"optimizer": {"type": "Adam"}}', [], "sets 'optimizer'; tuner builds the optimizer"),
        ('{"bf16": {"enabled": true}}', [], "enables 'bf16'.*train.mixed_precision"),
    ],
)  # fmt: skip
def test_the_users_json_is_checked(config, tmp_path, content, overrides, message):
    path = tmp_path / ("missing.json" if content is None else "ds.json")
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        _check(config, f"distributed.deepspeed_config='{path}'", *overrides)


@needs_deepspeed
def test_the_users_json_is_kept_under_our_keys(config, tmp_path):
    from tuner.distributed.deepspeed import deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1234},
                                "gradient_accumulation_steps": "auto"}))  # fmt: skip
    cfg = load_config(
        config, [DEEPSPEED, f"distributed.deepspeed_config='{path}'", "train.max_grad_norm=0.5"]
    )
    merged = deepspeed_config(cfg, world=4)
    assert merged["zero_optimization"]["reduce_bucket_size"] == 1234  # theirs
    assert merged["zero_optimization"]["stage"] == 3  # theirs, as deepspeed_stage is unset
    assert merged["zero_optimization"]["offload_optimizer"] == {"device": "none"}
    assert merged["gradient_accumulation_steps"] == 1 and merged["gradient_clipping"] == 0.5  # ours
    assert merged["train_batch_size"] == merged["train_micro_batch_size_per_gpu"] * 4


@needs_deepspeed
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.optimizer='adamw8bit'"], r"train.optimizer = 'adamw8bit' with distributed.strategy = 'deepspeed'"),
        (["train.optimizer='adafactor'"], "only an optimizer whose state is per element"),
        (["distributed.deepspeed_stage=3", "train.ema_decay=0.99"], r"train.ema_decay with .*ZeRO-3"),
        (["memory.blocks_to_swap=1"], "memory.blocks_to_swap with distributed.strategy = 'deepspeed'"),
        (["train.max_nonfinite_steps=2"], "train.max_nonfinite_steps with"),
        (["train.mixed_precision='fp16'"], "fp16"),
        (["distributed.deepspeed_stage=3", "sample.every_n_steps=1", "sample.prompts=['a cat']"],
         "sample.every_n_steps / sample.at_start with .*ZeRO-3"),
    ],
)  # fmt: skip
def test_settings_it_cannot_combine_with_are_refused(config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _check(config, *overrides)


@needs_deepspeed
def test_a_plain_lora_config_passes(config):
    _check(config)
    _check(
        config,
        "distributed.deepspeed_stage=3",
        "distributed.deepspeed_offload_optimizer=true",
        "train.optimizer='SGD'",
    )


def test_without_deepspeed_installed_the_extra_is_named(config, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    with pytest.raises(ConfigError, match=r"pip install tuner\[deepspeed\]"):
        _check(config)
