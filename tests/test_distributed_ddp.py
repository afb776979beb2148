"""`distributed.strategy = "ddp"` with two CPU processes (gloo) against one process with the same global
batch: two processes with batch b each and one process accumulating two batches of b see the same
batches, noise and timesteps, so after K steps their weights agree to fp32 rounding. One launch trains
every two-process run (tests/ddp_worker.py); each test compares one of them."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch import launch as launch_ranks
from project import cfg, make_cached_project, run
from tuner import memory
from tuner.archs.parts.experts import expert_file
from tuner.errors import CheckpointError
from tuner.fixtures import write_fixture
from tuner.offload import FakeTransfer
from tuner.trainers import trainer_class

pytestmark = pytest.mark.slow

COMMON = ("train.lr_warmup_steps=0", "save.precision='fp32'", "log.tensorboard=false")
# name -> (project, overrides of both the two-process run and its one-process twin)
EQUIVALENT = {
    "lora": ("wan", ()),
    "checkpointing": ("wan", ("train.gradient_checkpointing=true",)),
    "block_swap": ("wan", ("memory.blocks_to_swap=1", "train.gradient_checkpointing=true")),
    "full": ("wan", ("network.type='full'", "train.learning_rate=1e-4")),
    "loha": ("wan", ("network.type='loha'",)),
    "lokr": ("wan", ("network.type='lokr'", "network.rank=4")),
    "dora": ("wan", ("network.dora=true",)),
    # boundary 0.5: the two processes' samples go to different experts within one step
    "both_experts": ("wan22", ("model.expert='both'", "model.boundary=0.5")),
}
DOC = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"
STEPS = 3  # the demo data has 6 batches per epoch: 3 per process
RESUME = ("train.max_steps=4", "save.every_n_steps=2")
FUSED = ("train.fused_backward=true", "train.max_grad_norm=0")
REFUSAL = "key 'train.fused_backward' with distributed.strategy = 'ddp' on 2 processes"


def launch(workdir: Path, runs: list[dict], processes: int = 2, timeout: int = 600) -> None:
    """Train `runs` (see tests/ddp_worker.py) in `processes` CPU processes (tests/launch.py)."""
    spec = workdir / "runs.json"
    spec.write_text(json.dumps(runs))
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).parent / "ddp_worker.py"
    result = launch_ranks([str(worker), str(spec)], processes, env, timeout)
    assert result.returncode == 0, result.stderr[-3000:]


def rank_weights(out: Path) -> tuple[dict, dict]:
    return torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, wan_model):
    """Every two-process run, trained in one launch: the EQUIVALENT runs; `accumulated` (2 processes × 2
    batches per step); `module_dropout`; `fused` (refused); `full_disk` (the main process's first save
    fails); `straight` (4 steps, a state saved at step 2) and `resumed`
    (from that state, to step 4)."""
    root = tmp_path_factory.mktemp("ddp")
    write_fixture("wan22_t2v", root / "wan22")
    projects = {
        "wan": make_cached_project(root / "wan_project", wan_model),
        "wan22": make_cached_project(root / "wan22_project", root / "wan22", architecture="wan22_t2v"),
    }
    runs = [
        {"config": str(projects[p]), "out": str(root / name), "overrides": [*COMMON, f"train.max_steps={STEPS}", *o],
         "fake_device": _swaps(o)}
        for name, (p, o) in EQUIVALENT.items()
    ]  # fmt: skip
    wan = str(projects["wan"])
    runs += [
        {"config": wan, "out": str(root / "accumulated"),
         "overrides": [*COMMON, "train.max_steps=2", "train.gradient_accumulation_steps=2"]},
        {"config": wan, "out": str(root / "module_dropout"),
         "overrides": [*COMMON, f"train.max_steps={STEPS}", "network.module_dropout=0.5"]},
        {"config": wan, "out": str(root / "fused"), "overrides": [*COMMON, *FUSED]},
        {"config": wan, "out": str(root / "full_disk"), "overrides": [*COMMON, *RESUME], "full_disk": True},
        {"config": wan, "out": str(root / "straight"), "overrides": [*COMMON, *RESUME]},
        {"config": wan, "out": str(root / "resumed"), "overrides": [*COMMON, *RESUME],
         "resume": str(root / "straight" / "state" / "step000002")},
    ]  # fmt: skip
    launch(root, runs)
    return root, projects


def _swaps(overrides) -> bool:
    """Block swap needs a CUDA device; on the CPU it runs through `FakeTransfer` (as test_blockswap)."""
    return any(o.startswith("memory.blocks_to_swap") for o in overrides)


def _one_process(config, out, *overrides, resume=None):
    c = cfg(config, f"save.output_dir='{out}'", *COMMON, *overrides)
    trainer = trainer_class(c.model.architecture)(c)
    trainer.train(resume=resume, log=lambda s: None)
    return trainer


def _files(out, project: str) -> list:
    final = out / "demo_lora.safetensors"
    return [expert_file(final, e) for e in ("high", "low")] if project == "wan22" else [final]


def _assert_close(a: dict, b: dict, what: str, atol: float = 1e-7) -> None:
    assert a.keys() == b.keys() and a, what
    for key in a:
        diff = (a[key] - b[key]).abs().max().item()
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=atol), (
            f"{what}: {key} differs by up to {diff:.3g}"
        )


def _assert_ranks_identical(out) -> None:
    a, b = rank_weights(out)
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), f"ranks diverged at {key}"


@pytest.mark.parametrize("name", list(EQUIVALENT))
def test_two_processes_equal_one_process_with_the_same_global_batch(trained, tmp_path, monkeypatch, name):
    root, projects = trained
    project, overrides = EQUIVALENT[name]
    if _swaps(overrides):
        monkeypatch.setattr(memory, "transfer_for", lambda device: FakeTransfer())
    out = root / name
    assert not list(out.glob("error*.txt")), (out / "error0.txt").read_text()
    _assert_ranks_identical(out)
    assert torch.load(out / "reductions0.pt") >= STEPS  # reduced once per step
    single = _one_process(projects[project], tmp_path, f"train.max_steps={STEPS}",
                          "train.gradient_accumulation_steps=2", *overrides)  # fmt: skip
    for two, one in zip(_files(out, project), _files(tmp_path, project), strict=True):
        _assert_close(load_file(two), load_file(one), f"{name}: {two.name}")
    # the steps' losses agree too: every process has (and logs) the mean of the two processes' batch losses
    assert torch.load(out / "history0.pt") == torch.load(out / "history1.pt") == pytest.approx(single.history)
    logged = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged if "loss" in r] == pytest.approx(single.history, rel=1e-6)


def test_the_final_state_holds_each_processs_generators_and_verifies(trained):
    """The final state of a two-process run checks out against its manifest and holds each process's
    random generators."""
    from tuner.trainers.state import verify

    root, _ = trained
    (final_state,) = (root / "lora" / "state").iterdir()
    verify(final_state)
    assert {p.name for p in final_state.glob("rng_*.json")} == {"rng_0.json", "rng_1.json"}


def test_accumulation_reduces_once_per_step(trained, tmp_path):
    """Two processes accumulating two batches each equal one process accumulating four; the batches
    before a group's last run under no_sync, so one bucket is reduced per step, not per batch."""
    root, projects = trained
    out = root / "accumulated"
    _assert_ranks_identical(out)
    assert torch.load(out / "reductions0.pt") == 2  # two steps, one bucket (a tiny adapter) each
    _one_process(projects["wan"], tmp_path, "train.max_steps=2", "train.gradient_accumulation_steps=4")
    # four batches summed as 2 + 2 across the all-reduce, not 1 + 1 + 1 + 1 in one process: fp32 rounding
    # moves the adapter by up to 4.4e-7 on an AVX2 CPU (measured; AVX-512 kernels happened to agree to 1e-7)
    _assert_close(
        load_file(out / "demo_lora.safetensors"),
        load_file(tmp_path / "demo_lora.safetensors"),
        "accumulated",
        atol=1e-6,
    )


def test_module_dropout_leaves_ranks_identical(trained):
    """Module dropout skips whole adapters (unused parameters for DDP) and the ranks stay in step."""
    root, _ = trained
    _assert_ranks_identical(root / "module_dropout")


def test_resume_on_the_same_world_size_continues_exactly(trained):
    root, _ = trained
    straight, resumed = root / "straight", root / "resumed"
    assert not list(resumed.glob("error*.txt")), (resumed / "error0.txt").read_text()
    assert len(torch.load(resumed / "history0.pt")) == 2
    a, b = load_file(straight / "demo_lora.safetensors"), load_file(resumed / "demo_lora.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_on_another_world_size_is_refused_naming_why(trained, tmp_path):
    root, projects = trained
    with pytest.raises(
        CheckpointError, match=r"saved by 2 process\(es\), resumed with 1.*counts each process"
    ):
        _one_process(
            projects["wan"], tmp_path, *RESUME, resume=str(root / "straight" / "state" / "step000002")
        )


@pytest.mark.parametrize("name", ["lora", "full"])
def test_saved_files_load_in_a_one_process_run(trained, name):
    """The two-process file loads as a one-process run's `network.network_weights` does, into the
    weights the processes held."""
    root, projects = trained
    trainer = trainer_class("wan")(cfg(projects["wan"], *EQUIVALENT[name][1]))
    network = trainer.build_trained(trainer.load_transformer(torch.float32))
    network.load_weights(root / name / "demo_lora.safetensors", trainer.layout.inverse)
    _assert_close(network.state_dict(), rank_weights(root / name)[0], name)


def test_train_prints_the_strategy_and_its_memory_plan(trained):
    root, _ = trained
    log = (root / "lora" / "log.txt").read_text()
    line = next(x for x in log.splitlines() if x.startswith("  distributed "))
    assert line.startswith("  distributed           ddp on 2 processes; per process: parameters"), line
    assert line in DOC.read_text()  # docs/distributed.md quotes the measured line
    full = (root / "full" / "log.txt").read_text()
    assert "parameters 639.00 KiB (trained 639.00 KiB)" in full  # the whole tiny Wan trains


def test_a_refused_combination_stops_training_before_step_1_and_tuner_check_names_it(
    trained, capsys, monkeypatch
):
    root, projects = trained
    assert REFUSAL in (root / "fused" / "error0.txt").read_text()
    assert not (root / "fused" / "history0.pt").exists() and not (root / "fused" / "state").exists()
    sets = [arg for o in FUSED for arg in ("--set", o)]
    code, out = run(capsys, "check", "--config", projects["wan"], "--num-processes", "2", *sets)
    assert code == 2 and REFUSAL in out, out
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under a launcher
    code, out = run(capsys, "check", "--config", projects["wan"], *sets)
    assert code == 2 and REFUSAL in out, out
    code, out = run(capsys, "check", "--config", projects["wan"])
    assert code == 0 and "ddp on 2 processes" in out, out
    monkeypatch.delenv("WORLD_SIZE")
    code, out = run(capsys, "check", "--config", projects["wan"], *sets)
    assert code == 0 and "processes" not in out, out  # one process: fused backward is fine


def test_a_save_failing_on_the_main_process_stops_every_process_and_none_waits(trained):
    """The main process's disk fills while it writes the state of step 2: it says so in one line; the
    other process stops too, naming it, instead of waiting at the save's barrier (the launch's later runs
    went on in the same process group); no state, no temporary folder is left."""
    root, _ = trained
    out = root / "full_disk"
    assert (out / "error0.txt").read_text().startswith("CheckpointError: no space left on ")
    assert (out / "error1.txt").read_text() == (
        "PeerFailed: process 0 failed while saving the state of step 2 (its own error says why); process 1 "
        "stops too, leaving the files of the last complete save as they were"
    )
    assert not (out / "state").exists() or not list((out / "state").iterdir())
    assert (root / "resumed" / "history0.pt").is_file()  # the runs after it trained
