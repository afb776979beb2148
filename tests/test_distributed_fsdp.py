"""strategy = "fsdp": two CPU processes (gloo; tests/launch.py) train the tiny Wan with FSDP2, and end where
one process with the same global batch ends (two batches per step: gradient accumulation 2); the files
they save are a one-process run's; a resumed run repeats the uninterrupted one; each process holds half
of what a DDP process holds. The loop seeds each batch's draws by its global index
(process r's i-th batch is the plan's batch i * 2 + r), as the one-process run does."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch import launch
from project import cfg, make_project, output, train_wan
from tuner.cli import main
from tuner.errors import ConfigError

FSDP = "distributed.strategy='fsdp'"
CLIP = "train.max_grad_norm=0.001"  # small enough to clip every step: the norm is over whole gradients
LORA = [CLIP, "train.max_steps=4", "save.every_n_steps=2", "train.validate_every_n_steps=2"]
FULL = ["network.type='full'", "train.learning_rate=1e-4", "train.max_steps=2"]
# fp8 blocks and checkpointing; DoRA (reads the gathered base weight); adapters outside the blocks (head,
# text embedding) in the first block's group
FP8 = ["memory.fp8_base=true", "train.gradient_checkpointing=true", "train.max_steps=2", "network.dora=true",
       "network.include=['proj_out', 'condition_embedder.text_embedder.linear_1']"]  # fmt: skip


@pytest.fixture(scope="module")
def project(tmp_path_factory, wan_model):
    """The demo project with the images held out for validation too, cached."""
    config = make_project(tmp_path_factory.mktemp("fsdp") / "p", wan_model)
    dataset = config.parent / "dataset.toml"
    dataset.write_text(
        dataset.read_text() + '\n[[datasets]]\nimage_directory = "data/images"\nvalidation = true\n'
    )
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    return config


@pytest.fixture(scope="module")
def runs(project, tmp_path_factory) -> dict[str, Path]:
    """Every two-process run of this file, in one launch of tests/distributed_fsdp_worker.py (one
    start-up of two processes instead of one per run): by name, the folder it trained into, holding
    its log (process 0's) in `log.txt` and each process's measured memory. `resumed` continues the state
    `lora` saved at step 2."""
    root = tmp_path_factory.mktemp("fsdp_runs")
    step2 = "state/step000002"
    specs = {
        "lora": {"overrides": LORA},
        "resumed": {
            "overrides": LORA,
            "copy": str(root / "lora" / step2),
            "resume": str(root / "resumed" / step2),
        },
        "full": {"overrides": FULL},
        "fp8": {"overrides": FP8},
    }
    file = root / "runs.json"
    file.write_text(
        json.dumps(
            [{"out": str(root / n), **s, "overrides": [FSDP, *s["overrides"]]} for n, s in specs.items()]
        )
    )
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).parent / "distributed_fsdp_worker.py"
    result = launch([str(worker), str(project), str(file)], env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return {name: root / name for name in specs}


def _memory(out: Path) -> list[dict[str, int]]:
    """What each process held after the run's last backward (tests/distributed_fsdp_worker.py)."""
    return [json.loads((out / f"memory_{r}.json").read_text()) for r in range(2)]


def _one_process(config: Path, out: Path, overrides: list[str], resume: str | None = None):
    return train_wan(config, out, "train.gradient_accumulation_steps=2", *overrides, resume=resume)


def _assert_close(file: Path, reference: Path, atol: float = 1e-6) -> None:
    a, b = load_file(file), load_file(reference)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=0, atol=atol), f"{file.name}: {key} differs"


@pytest.mark.slow
def test_lora_equals_one_process_saves_its_files_and_resumes(project, runs, tmp_path, wan_model):
    fsdp = runs["lora"]
    memory = _memory(fsdp)
    one = tmp_path / "one"
    reference = _one_process(project, one, LORA)
    _assert_close(fsdp / "demo_lora-step000002.safetensors", one / "demo_lora-step000002.safetensors")
    _assert_close(fsdp / "demo_lora.safetensors", one / "demo_lora.safetensors")
    # validation runs on every process (the sharded forward needs them all) and finds the same losses
    validation = json.loads((fsdp / "history_0.json").read_text())["validation"]
    assert [step for step, _ in validation] == [2, 4]
    assert [loss for _, loss in validation] == pytest.approx(
        [loss for _, loss in reference.val_history], abs=1e-6
    )
    assert any(load_file(fsdp / "demo_lora.safetensors")[k].abs().max() > 0 for k in load_file(one / "demo_lora.safetensors")
               if "lora_B" in k)  # fmt: skip

    # the state holds the same parts, tensors and shapes as a one-process state (plus a second rng)
    fsdp_state, one_state = fsdp / "state" / "step000002", one / "state" / "step000002"
    assert {p.name for p in fsdp_state.iterdir()} == {p.name for p in one_state.iterdir()} | {
        "rng_1.json", "rng_1.safetensors"}  # fmt: skip
    for part in ("network", "optimizer"):
        a, b = load_file(fsdp_state / f"{part}.safetensors"), load_file(one_state / f"{part}.safetensors")
        assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
        assert json.loads((fsdp_state / f"{part}.json").read_text()) == json.loads(
            (one_state / f"{part}.json").read_text()
        )

    # resumed from the state at step 2 by a second run of the two processes: the same bits as the run that
    # went on
    resumed = runs["resumed"]
    for key, value in load_file(fsdp / "demo_lora.safetensors").items():
        assert torch.equal(load_file(resumed / "demo_lora.safetensors")[key], value), key

    # the saved adapter loads in one process and changes the model's output
    from tuner.archs.wan.trainer import WanModel
    from tuner.networks.factory import apply_adapter_file

    trainer = WanModel(cfg(project))
    model = trainer.load_transformer(torch.float32)
    before = output(model)
    apply_adapter_file(
        model, fsdp / "demo_lora.safetensors", 1.0, trainer.layout, name_map_inverse=trainer.layout.inverse
    )
    assert not torch.allclose(output(model), before)

    # `tuner train` said so before step 1, from the shards
    log = (fsdp / "log.txt").read_text()
    assert "distributed: fsdp (FSDP2) over 2 processes" in log
    assert (
        f"frozen weights {memory[0]['frozen'] / 2**20:.2f} of {memory[0]['frozen_full'] / 2**20:.2f} MiB"
        in log
    )

    # per process: half the frozen weights, trained weights, gradients and optimizer state of a DDP
    # process (whose figures are the whole tensors); the two halves make the whole
    for what in ("frozen", "trained", "gradients", "optimizer"):
        assert memory[0][what] < 0.51 * memory[0][f"{what}_full"], what
    assert memory[0]["frozen"] + memory[1]["frozen"] == memory[0]["frozen_full"]
    assert memory[0]["trained"] + memory[1]["trained"] == memory[0]["trained_full"]


@pytest.mark.slow
def test_full_finetune_equals_one_process(project, runs, tmp_path):
    memory = _memory(runs["full"])
    _one_process(project, tmp_path / "one", FULL)
    _assert_close(runs["full"] / "demo_lora.safetensors", tmp_path / "one" / "demo_lora.safetensors")
    assert memory[0]["frozen_full"] == 0 and memory[0]["trained"] < 0.51 * memory[0]["trained_full"]
    assert memory[0]["optimizer"] < 0.51 * memory[0]["optimizer_full"]


@pytest.mark.slow
def test_fp8_base_and_checkpointing_compose(project, runs, tmp_path):
    memory = _memory(runs["fp8"])
    _one_process(project, tmp_path / "one", FP8)
    _assert_close(runs["fp8"] / "demo_lora.safetensors", tmp_path / "one" / "demo_lora.safetensors")
    # the fp8 weights themselves are sharded: half of the (already halved) base per process
    assert memory[0]["frozen"] < 0.51 * memory[0]["frozen_full"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("memory.blocks_to_swap=1", "memory.blocks_to_swap"),
        ("memory.activation_offload=true", "memory.activation_offload"),
        ("train.ema_decay=0.99", "train.ema_decay"),
        ("train.optimizer='automagic'", "train.optimizer"),
    ],
)
def test_check_names_both_keys(tmp_path, wan_model, override, key):
    from tuner.archs.wan.trainer import WanModel
    from tuner.distributed import strategy_for

    config = cfg(make_project(tmp_path, wan_model), FSDP, override)
    with pytest.raises(ConfigError) as refused:
        strategy_for(config, 2).check(WanModel(config), 2)
    assert key in str(refused.value) and "distributed.strategy = 'fsdp'" in str(refused.value)


def test_check_refuses_samples_during_training(tmp_path, wan_model):
    from tuner.archs.wan.trainer import WanModel
    from tuner.distributed import strategy_for

    project = make_project(tmp_path, wan_model)
    config = cfg(project, FSDP, "sample.prompts=['a cat']", "sample.every_n_steps=2")
    with pytest.raises(ConfigError, match="sample.every_n_steps"):
        strategy_for(config, 2).check(WanModel(config), 2)
    plain = cfg(project, FSDP)
    strategy_for(plain, 2).check(WanModel(plain), 2)  # the config without them passes


def test_full_finetune_of_mixed_dtypes_is_refused_naming_the_fix(tmp_path, wan_model):
    """Wan keeps its modulation tables and some norms in fp32: a bf16 full fine-tune trains two dtypes,
    which FSDP2 cannot shard in one group; fp32 weights can."""
    from tuner.archs.wan.trainer import WanModel
    from tuner.distributed.fsdp import _check_one_trained_dtype
    from tuner.networks.full import FullNetwork

    config = cfg(make_project(tmp_path, wan_model), FSDP, "network.type='full'", "model.dtype='bf16'")
    model = WanModel(config).load_transformer(torch.bfloat16)
    with pytest.raises(ConfigError, match="model.dtype = 'fp32' and train.mixed_precision = 'bf16'"):
        _check_one_trained_dtype(config, model, FullNetwork(model))
    _check_one_trained_dtype(config, model.float(), FullNetwork(model))
