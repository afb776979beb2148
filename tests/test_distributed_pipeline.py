"""Pipeline parallelism (`distributed.strategy = "pipeline"`): the forward cut into stage parts equals the
whole forward; two CPU processes (gloo) train exactly what one process trains on the same batches; the
saved adapter and state are a one-process run's (resume on two processes or on one)."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch import launch
from project import cfg, make_cached_project, make_project, train_wan
from tuner.archs.model import ArchitectureModel, pipeline_architectures
from tuner.archs.stages import balanced_stages
from tuner.distributed.pipeline import Grid, PipelineStrategy
from tuner.errors import ConfigError
from tuner.registry import ARCHITECTURES
from tuner.trainers import trainer_class


def test_stages_are_contiguous_and_balanced_by_parameter_count():
    assert balanced_stages([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert balanced_stages([6, 1, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 7)]
    for sizes, stages, best in (([3, 3, 3, 1, 1, 1, 3], 3, 6), ([5, 2, 2, 2, 4, 4, 1], 4, 6)):
        runs = balanced_stages(sizes, stages)
        assert [i for run in runs for i in run] == list(range(len(sizes))) and all(runs)
        assert max(sum(sizes[i] for i in run) for run in runs) == best  # no cut has a smaller largest stage
    with pytest.raises(ValueError):
        balanced_stages([1, 1], 3)


def test_processes_form_stages_by_replicas_as_deepspeed_lays_them_out():
    """rank = stage · replicas + replica (DeepSpeed's PipeDataParallelTopology: the replicas of a stage are
    adjacent ranks); a pipeline is one replica's stages, the data-parallel group one stage's replicas."""
    grid = Grid.of(4, 2)
    assert (grid.stages, grid.replicas) == (2, 2)
    assert [(grid.stage(r), grid.replica(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [grid.pipeline(r) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [grid.replicas_of(s) for s in (0, 1)] == [[0, 1], [2, 3]]
    grid = Grid.of(6, 3)
    assert grid.pipeline(1) == [1, 3, 5] and grid.replicas_of(2) == [4, 5] and grid.rank(2, 1) == 5
    assert Grid.of(3, 0) == Grid(3, 1)  # 0: one stage per process
    for processes, stages in ((4, 3), (4, 1), (2, 4)):
        with pytest.raises(ConfigError, match="distributed.pipeline_stages"):
            Grid.of(processes, stages)


def _rule_of(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in c.__dict__)


def test_pipeline_parts_follow_the_predict_they_cut():
    """A trainer offering parts must predict as the class that wrote them (or a subclass of it) does; one
    that predicts otherwise must opt out, or its stages would train another model than `predict`."""
    for name, record in ARCHITECTURES.items():
        cls = record.family_class()
        if cls.pipeline_parts is ArchitectureModel.pipeline_parts:
            continue
        assert issubclass(_rule_of(cls, "pipeline_parts"), _rule_of(cls, "predict")), (
            f"{name}: {_rule_of(cls, 'predict').__name__} defines predict; give it a pipeline_parts that "
            "cuts that predict (or set pipeline_parts = ArchitectureModel.pipeline_parts and pipeline_refused)"
        )


def test_every_architecture_offers_pipeline_stages_or_says_why_not():
    """Completeness: each record's model offers `pipeline_parts`, or its record's `pipeline_refused` says
    why it cannot (the reason the refusal shows); never both."""
    offered = set(pipeline_architectures())
    for name, record in ARCHITECTURES.items():
        cls = record.family_class()
        where = f"src/tuner/archs/{record.folder}"
        assert (name in offered) != bool(record.pipeline_refused), (
            f"{name}: implement {cls.__name__}.pipeline_parts ({where}/trainer*.py; `PipelineParts` in "
            "tuner/archs/stages.py: prologue, blocks, run_block, epilogue, prologue_modules, from the "
            "diffusers forward) so tests/test_contract.py's pipeline cases run on it, or set "
            f"pipeline_refused in its record ({where}/record.py) to the reason users read"
            if name not in offered
            else f"{name}: offers pipeline_parts and sets pipeline_refused; remove pipeline_refused"
        )


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


@pytest.mark.parametrize(
    ("architecture", "layout"),
    [("wan", "single"), ("wan", "diffusers"), ("flux", "single"), ("flux", "diffusers")],
)
def test_each_stage_loads_only_its_own_blocks(architecture, layout, tmp_path):
    """Under the strategy's `loading`, each of two stages builds the transformer empty and loads only its
    share: its blocks, the prologue's modules on the first stage, and the output layers every stage keeps.
    Its resident parameter bytes are that share's (the two stages' sum is the whole model plus the output
    layers twice), every tensor it holds is the whole model's, and it trains on it (an adapter on every
    block, built on the host where the block is not loaded)."""
    from tuner.fixtures import write_fixture
    from tuner.models.loading import loading_only

    write_fixture(architecture, tmp_path / "model")
    config = make_project(tmp_path / "p", tmp_path / "model", architecture=architecture)
    single = {"wan": "wan2.1_t2v_tiny.safetensors", "flux": "flux1-dev_tiny.safetensors"}[architecture]
    transformer = tmp_path / "model" / layout / (single if layout == "single" else "")
    c = cfg(config, 'distributed.strategy="pipeline"', f"model.transformer='{transformer}'")
    trainer = trainer_class(architecture)(c)
    whole = trainer.load_transformer(torch.float32)
    parts = trainer.pipeline_parts(whole)
    blocks = [_bytes(b.parameters()) for b in parts.blocks]
    prologue = _bytes(p for m in parts.prologue_modules for p in m.parameters())
    shared = _bytes(whole.parameters()) - sum(blocks) - prologue  # the output layers (and what blocks share)
    expected = whole.state_dict()
    too_many = PipelineStrategy(c)
    too_many.num_stages = 3
    with pytest.raises(ConfigError, match="pipeline_stages.*2 blocks, fewer than the 3 pipeline stages"):
        too_many.not_held(trainer, whole)

    held = []
    for rank in (0, 1):
        strategy = PipelineStrategy(c)
        strategy.stage, strategy.num_stages = rank, 2
        with loading_only(lambda model, s=strategy: s.not_held(trainer, model)):
            model = trainer.load_transformer(torch.float32)
        assert strategy.loaded_own_blocks and strategy.stages == [range(0, 1), range(1, 2)]
        resident = _bytes(model.parameters())
        assert resident == blocks[rank] + shared + (prologue if rank == 0 else 0)
        held.append(resident)
        for key, tensor in model.state_dict().items():
            if not tensor.is_meta:
                torch.testing.assert_close(tensor, expected[key], rtol=0, atol=0, msg=key)
        assert all(p.is_meta for p in trainer.pipeline_parts(model).blocks[1 - rank].parameters())
        network = trainer.build_trained(model)  # adapters of the block held elsewhere live on the host
        assert not any(p.is_meta for p in network.parameters())
    assert sum(held) == _bytes(whole.parameters()) + shared


def test_check_refuses_what_stages_cannot_combine_with(tmp_path, wan_model):
    config = make_project(tmp_path / "p", wan_model)

    def refusal(*overrides, trainer_cls=None):
        c = cfg(config, 'distributed.strategy="pipeline"', *overrides)
        trainer = (trainer_cls or trainer_class("wan"))(c)
        with pytest.raises(ConfigError) as e:
            PipelineStrategy(c).check(trainer, 2)
        return str(e.value)

    for combines in (
        [],
        ["memory.blocks_to_swap=1"],
        ["distributed.pipeline_stages=2"],
    ):  # block swap, replicas
        PipelineStrategy(cfg(config, 'distributed.strategy="pipeline"', *combines)).check(
            trainer_class("wan")(cfg(config)), 2 if not combines or "memory" in combines[0] else 4
        )
    for overrides, key in (
        (["memory.activation_offload=true"], "memory.activation_offload"),
        (["train.fused_backward=true", "train.max_grad_norm=0"], "train.fused_backward"),
        (["train.ema_decay=0.99"], "train.ema_decay"),
        (['network.type="full"'], "network.type"),
        (['train.mixed_precision="fp16"'], "train.mixed_precision"),
        (["sample.every_n_steps=5", "sample.prompts=['a cat']"], "sample.every_n_steps"),
    ):
        message = refusal(*overrides)
        assert "distributed.strategy" in message and key in message, message
    with pytest.raises(ConfigError, match="2 stages do not divide 3 processes"):  # stages x replicas
        PipelineStrategy(cfg(config, "distributed.pipeline_stages=2")).check(
            trainer_class("wan")(cfg(config)), 3
        )
    refused = next(name for name, record in ARCHITECTURES.items() if record.pipeline_refused)
    message = refusal(trainer_cls=trainer_class(refused))
    assert f"not available for {refused} ({ARCHITECTURES[refused].pipeline_refused})" in message, message
    assert "available for wan, " in message


def _assert_same_adapter(a: Path, b: Path) -> None:
    """Equal within fp32 reduction order: micro-batches sum a gradient in another order than one batch,
    and Adam's normalization magnifies such differences where gradients are near zero (measured on FLUX
    weights of 3e-3 after three steps: at most 2e-6 with AVX2 kernels, 1.4e-5 with AVX-512 ones)."""
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys() and x
    for key in x:
        torch.testing.assert_close(x[key], y[key], rtol=1e-4, atol=3e-5, msg=key)


def _assert_as_one_process(piped: Path, one, folder: Path) -> None:
    """The multi-process run in `piped` logged the losses of the one-process run `one` (trained into
    `folder`) and saved its adapter."""
    assert torch.load(piped / "history0.pt") == pytest.approx(one.history, rel=1e-5)
    _assert_same_adapter(piped / "demo_lora.safetensors", folder / "demo_lora.safetensors")


@pytest.fixture(scope="module")
def cached_project(tmp_path_factory, wan_model):
    return make_cached_project(tmp_path_factory.mktemp("pipeline") / "p", wan_model)


@pytest.fixture(scope="module")
def flux_project(tmp_path_factory):
    from tuner.fixtures import write_fixture

    root = tmp_path_factory.mktemp("pipeline_flux")
    write_fixture("flux", root / "model")
    return make_cached_project(root / "p", root / "model", architecture="flux")


# the two-stage runs' settings (besides the step count), each compared with a one-process run of them
SAVES = ("save.every_n_steps=2", "save.save_state=true")
# two batches per step, one micro-batch each (GPipe), a clipping threshold every step reaches, and SGD
ACCUMULATE = ("train.gradient_accumulation_steps=2", "train.max_grad_norm=0.01", "train.lr_warmup_steps=0",
              'train.optimizer="sgd"', "train.learning_rate=10")  # fmt: skip
FP8 = ("memory.fp8_base=true", "train.gradient_checkpointing=true", "train.lr_warmup_steps=0")
# each stage streams its one block from host memory; four samples in two micro-batches (1F1B: forwards
# between backwards), the shared host copy refused (the stages swap different blocks)
SWAP = ("memory.blocks_to_swap=1", "train.lr_warmup_steps=0")
VALIDATE = ("train.validate_every_n_steps=1", "train.lr_warmup_steps=0")


def _held_out_videos(config: Path) -> Path:
    """A dataset config of the demo project whose videos are held out for validation (already cached)."""
    dataset = config.parent / "dataset_val.toml"
    text = (config.parent / "dataset.toml").read_text()
    dataset.write_text(
        text.replace('video_directory = "data/videos"', 'video_directory = "data/videos"\nvalidation = true')
    )
    return dataset


@pytest.fixture(scope="module")
def runs(cached_project, flux_project, tmp_path_factory) -> dict[str, Path]:
    """Every two-process run of this file, in one launch of tests/distributed_pipeline_worker.py (one
    start-up of two processes instead of one per run): by name, the folder it trained into. `resumed`
    continues the state `piped` saved at step 2."""
    root = tmp_path_factory.mktemp("pipeline_runs")
    wan, flux = str(cached_project), str(flux_project)
    held_out = _held_out_videos(cached_project)
    state = str(root / "piped" / "state" / "step000002")
    specs = {
        "piped": (wan, 4, None, SAVES),
        "resumed": (wan, 4, state, ("save.save_state=true",)),
        "accumulate": (wan, 2, None, ("distributed.pipeline_microbatches=1", *ACCUMULATE)),
        "fp8": (wan, 2, None, FP8),
        "flux": (flux, 3, None, ("train.lr_warmup_steps=0",)),
        "swap": (wan, 2, None, SWAP),
        "validate": (wan, 2, None, (f"data.dataset_config='{held_out}'", *VALIDATE)),
    }
    file = root / "runs.json"
    file.write_text(json.dumps([{"config": c, "out": str(root / name), "steps": steps, "resume": resume,
                                 "overrides": list(o)} for name, (c, steps, resume, o) in specs.items()]))  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).parent / "distributed_pipeline_worker.py"
    result = launch([str(worker), str(file)], env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return {name: root / name for name in specs}


@pytest.fixture(scope="module")
def grid_run(cached_project, tmp_path_factory) -> Path:
    """Four processes as 2 stages × 2 replicas (tests/distributed_pipeline_worker.py), two steps."""
    root = tmp_path_factory.mktemp("pipeline_grid")
    file = root / "runs.json"
    file.write_text(json.dumps([{"config": str(cached_project), "out": str(root / "grid"), "steps": 2, "resume": None,
                                 "overrides": ["distributed.pipeline_stages=2", "train.lr_warmup_steps=0"]}]))  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).parent / "distributed_pipeline_worker.py"
    result = launch([str(worker), str(file)], processes=4, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return root / "grid"


@pytest.mark.slow
def test_two_stages_by_two_replicas_train_what_one_process_trains(tmp_path, cached_project, grid_run):
    """Pipeline × data parallel on four processes: each replica (ranks 0, 2 and ranks 1, 3) reads half the
    batches, each stage's two replicas average its gradients; adapter and logged losses equal one process
    accumulating the two replicas' batches (the same global batch)."""
    one = train_wan(cached_project, tmp_path / "one", "train.max_steps=2", "train.lr_warmup_steps=0",
                    "train.gradient_accumulation_steps=2")  # fmt: skip
    histories = [torch.load(grid_run / f"history{r}.pt") for r in range(4)]
    assert all(h == histories[0] for h in histories)  # every process logs the mean over the replicas
    assert histories[0] == pytest.approx(one.history, rel=1e-5)
    _assert_same_adapter(grid_run / "demo_lora.safetensors", tmp_path / "one" / "demo_lora.safetensors")
    log = (grid_run / "log0.txt").read_text()
    assert "pipeline, 2 stages over 2 blocks" in log and "2 replicas of the pipeline" in log
    # the saved state: each stage's optimizer state gathered through its pipeline's group, one process's
    state, alone = grid_run / "state" / "step000002", tmp_path / "one" / "state" / "step000002"
    assert json.loads((state / "processes.json").read_text()) == {"data_shares": 2, "processes": 4}
    _assert_same_adapter(state / "optimizer.safetensors", alone / "optimizer.safetensors")
    figures = [json.loads((grid_run / f"memory{r}.json").read_text()) for r in range(4)]
    assert figures[0] == figures[1] and figures[2] == figures[3]  # a stage's replicas hold the same share
    adapter = load_file(grid_run / "demo_lora.safetensors")
    assert (
        figures[0]["trained"] + figures[2]["trained"]
        == sum(p.numel() for p in adapter.values() if p.ndim) * 4
    )


@pytest.mark.slow
def test_two_stages_train_what_one_process_trains_and_resume(tmp_path, cached_project, runs):
    """Stages 0 and 1 (one tiny Wan block each, two micro-batches on the two-image batches) end with the
    one-process adapter: same losses, same file. Their state at step 2 resumes on two processes and on one
    process to the same adapter, so the saved state is a one-process run's."""
    config = cached_project
    steps = ("train.max_steps=4", "save.every_n_steps=2", "save.save_state=true")
    one = train_wan(config, tmp_path / "one", *steps)

    piped = runs["piped"]
    histories = [torch.load(piped / f"history{r}.pt") for r in (0, 1)]
    assert histories[0] == histories[1]  # the last stage's loss reaches every process
    assert histories[0] == pytest.approx(one.history, rel=1e-5)
    _assert_same_adapter(piped / "demo_lora.safetensors", tmp_path / "one" / "demo_lora.safetensors")
    _assert_same_adapter(
        piped / "demo_lora-step000002.safetensors", tmp_path / "one" / "demo_lora-step000002.safetensors"
    )
    logs = [(piped / f"log{r}.txt").read_text() for r in (0, 1)]
    assert "pipeline, 2 stages over 2 blocks" in logs[0] and not logs[1]  # the main process logs
    assert "stage 0: blocks 0 (0.05M)" in logs[0] and "stage 1: blocks 1 (0.05M)" in logs[0]
    assert "each stage loaded only its own blocks" in logs[0]

    # each stage holds its own half: weights, gradients and optimizer state (measured at the last save)
    figures = [json.loads((piped / f"memory{r}.json").read_text()) for r in (0, 1)]
    adapter = load_file(piped / "demo_lora.safetensors")
    whole = sum(p.numel() for p in adapter.values() if p.ndim) * 4  # fp32 adapter; alphas aside
    assert figures[0]["trained"] + figures[1]["trained"] == whole
    for f in figures:  # AdamW: two moments per weight (and a step count per tensor)
        assert f["gradients"] == f["trained"] and f["optimizer"] == pytest.approx(2 * f["trained"], rel=0.01)
        assert f["planned_optimizer"] == pytest.approx(f["optimizer"], rel=0.01)  # the plan's probe

    state = piped / "state" / "step000002"
    resumed = runs["resumed"]
    _assert_same_adapter(resumed / "demo_lora.safetensors", piped / "demo_lora.safetensors")
    alone = train_wan(config, tmp_path / "alone", "train.max_steps=4", resume=str(state))
    assert alone.history == pytest.approx(one.history[2:], rel=1e-5)
    _assert_same_adapter(tmp_path / "alone" / "demo_lora.safetensors", piped / "demo_lora.safetensors")


@pytest.mark.slow
def test_two_stages_accumulate_and_clip_by_the_norm_of_every_stage(tmp_path, cached_project, runs):
    """Two batches per step, one micro-batch each (GPipe), and a clipping threshold every step reaches:
    the stages clip by the norm of all their gradients together, as one process clips by the whole. SGD,
    whose steps scale with the gradient (Adam's would hide a wrong clipping factor)."""
    one = train_wan(cached_project, tmp_path / "one", "train.max_steps=2", *ACCUMULATE)
    piped = runs["accumulate"]
    _assert_as_one_process(piped, one, tmp_path / "one")
    figures = [json.loads((piped / f"memory{r}.json").read_text()) for r in (0, 1)]
    assert all(f["trained"] for f in figures)


@pytest.mark.slow
def test_stage_bytes_of_the_real_models_halve_with_each_doubling(monkeypatch, capsys):
    """benchmarks/pipeline_stages.py on the shipped Wan 14B and FLUX.1 dev configs (meta device)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import pipeline_stages

    table = pipeline_stages.main(["--rank", "4"])
    assert "Wan 2.1 T2V 14B" in capsys.readouterr().out
    for model in ("Wan 2.1 T2V 14B", "FLUX.1 dev"):
        one, two = table[model, 1], table[model, 2]
        assert (
            26 < one["bf16"] < 27 if model.startswith("Wan") else 22 < one["bf16"] < 23
        )  # 14B / 12B in bf16
        assert one["bf16"] / 2 < two["bf16"] < one["bf16"] * 0.52  # half the blocks + the shared parts
        assert two["fp8"] < two["bf16"] * 0.53 and table[model, 8]["lora"] < two["lora"] / 3


@pytest.mark.slow
def test_two_stages_with_fp8_base_weights_and_checkpointing(tmp_path, cached_project, runs):
    """The case pipeline stages are for: fp8 base weights (each stage quantizes only its own blocks; the
    others are freed unquantized) and gradient checkpointing inside the stages' blocks."""
    one = train_wan(cached_project, tmp_path / "one", "train.max_steps=2", *FP8)
    piped = runs["fp8"]
    _assert_as_one_process(piped, one, tmp_path / "one")
    log = (piped / "log0.txt").read_text()
    assert "gradient checkpointing on" in log and "fp8" in log
    frozen = [json.loads((piped / f"memory{r}.json").read_text())["frozen"] for r in (0, 1)]
    assert all(f < 451840 for f in frozen)  # below the fp32 stage's bytes: its block's linears are fp8


@pytest.mark.slow
def test_two_stages_of_flux_train_what_one_process_trains(tmp_path, flux_project, runs):
    """FLUX.1: the dual-stream block and the embeddings on stage 0, the single-stream block and the output
    layers on stage 1; the streams, the conditioning and the rotary tables pass between them."""
    settings = ("train.max_steps=3", "train.lr_warmup_steps=0")
    one = trainer_class("flux")(
        cfg(flux_project, f"save.output_dir='{tmp_path / 'one'}'", "log.tensorboard=false", *settings)
    )
    one.train(log=lambda s: None)
    piped = runs["flux"]
    _assert_as_one_process(piped, one, tmp_path / "one")
    assert "stage 1: blocks 1" in (piped / "log0.txt").read_text()


@pytest.mark.slow
def test_two_stages_each_swapping_its_blocks_train_what_one_process_trains(tmp_path, cached_project, runs):
    """Block swap inside each stage (`memory.blocks_to_swap` counts the stage's own blocks): the stage's
    block streams from host memory through each micro-batch's forward and backward, and the run equals
    one process's without swap."""
    one = train_wan(cached_project, tmp_path / "one", "train.max_steps=2", "train.lr_warmup_steps=0")
    piped = runs["swap"]
    _assert_as_one_process(piped, one, tmp_path / "one")
    assert "1 of 1 blocks swapped" in (piped / "log0.txt").read_text()


@pytest.mark.slow
def test_two_stages_validate_what_one_process_validates(tmp_path, cached_project, runs):
    """The validation loss, the held-out batches' forward alone through the stages (the schedule's eval),
    after every step: equal to one process's, on every process."""
    dataset = _held_out_videos(cached_project)
    one = train_wan(cached_project, tmp_path / "one", "train.max_steps=2", f"data.dataset_config='{dataset}'",
                    *VALIDATE)  # fmt: skip
    piped = runs["validate"]
    assert [step for step, _ in one.val_history] == [1, 2]
    for rank in (0, 1):
        validated = torch.load(piped / f"validation{rank}.pt")
        assert [step for step, _ in validated] == [1, 2]
        assert [loss for _, loss in validated] == pytest.approx(
            [loss for _, loss in one.val_history], rel=1e-5
        )
    assert torch.load(piped / "history0.pt") == pytest.approx(one.history, rel=1e-5)
