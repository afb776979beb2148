"""Regional compilation (`tuner.compile`): each block compiled, one compile shared by all blocks, outputs
and gradients unchanged, with LoRA, fp8 storage, checkpointing, activation offload and block swap.

Most tests count compiles with dynamo's `aot_eager` backend: it traces exactly what inductor would
(dynamo's graph and guards, AOT autograd's forward/backward split) but runs the captured ops
eagerly, so results are bit-equal to the uncompiled model and a compile costs about a second, not the
10-90 s of inductor's C++ code generation on a CPU. One slow test runs inductor itself."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from project import cfg, make_project, wan_inputs
from test_blockswap import add_lora, tiny_wan, train_step
from tuner import compile as compile_module
from tuner import memory
from tuner.memory import MemorySettings, apply_memory_settings
from tuner.offload import FakeTransfer
from tuner.trainers import trainer_class
from tuner.trainers.base import NetworkTrainer

WanTrainer = trainer_class("wan")

# (memory settings, diffusers' gradient checkpointing)
# (LoRA alone: `test_train_compile_trains_exactly_as_eager_without_recompiling`)
COMBINATIONS = {
    "fp8+checkpointing+swap": ({"fp8_base": True, "blocks_to_swap": 2}, True),
    "fp8+offload+swap": ({"fp8_base": True, "activation_offload": True, "blocks_to_swap": 2}, False),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's cache is per code object and process-wide: start each test with none compiled."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _prepared(settings: dict, checkpointing: bool, compile=False):
    model = tiny_wan()
    if checkpointing:
        model.enable_gradient_checkpointing()
        model.train()
    uses_transfer = settings.get("blocks_to_swap") or settings.get("activation_offload")
    handle = apply_memory_settings(
        model, MemorySettings(**settings), "cpu", transfer=FakeTransfer() if uses_transfer else None,
        compile=compile,
    )  # fmt: skip
    if handle.checkpointing:
        handle.checkpointing.min_bytes = 0  # the tiny model's activations are below the default 1 MiB
    return model, handle


def _steps(model, lora, n: int, counter=None):
    """`n` training steps on fixed inputs: outputs and gradients of the last, compiles after each."""
    compiles = []
    for _ in range(n):
        for p in lora.parameters():
            p.grad = None
        out, grads = train_step(model, lora, wan_inputs())
        compiles.append(counter.frame_count if counter else 0)
    return out, grads, compiles


@pytest.mark.slow
@pytest.mark.parametrize("combination", COMBINATIONS)
def test_blocks_compile_once_and_train_exactly_as_eager(combination):
    settings, checkpointing = COMBINATIONS[combination]
    reference, _ = _prepared(settings, checkpointing)
    want_out, want_grads, _ = _steps(reference, add_lora(reference), 1)

    counter = CompileCounterWithBackend("aot_eager")
    model, handle = _prepared(settings, checkpointing, compile=counter)
    out, grads, compiles = _steps(model, add_lora(model), 3, counter)

    assert len(handle.compiled.modules) == 4
    # Two graphs for four blocks: block 0's input does not require grad (only the adapters train), the
    # other three share one graph. A guard on any per-block object would compile each block (5+).
    assert compiles == [2, 2, 2]
    assert torch.equal(out, want_out)
    for g, w in zip(grads, want_grads, strict=True):
        assert torch.equal(g, w)


def test_remove_restores_the_blocks_and_the_summary_says_compiled():
    model, handle = _prepared({}, False, compile="aot_eager")
    assert "4 blocks compiled" in handle.summary()
    assert all("forward" in block.__dict__ for block in model.blocks)
    handle.remove()
    assert all("forward" not in block.__dict__ for block in model.blocks)


@pytest.mark.slow
def test_inductor_matches_eager_with_everything_attached():
    """The default backend, with fp8 storage, diffusers' checkpointing, block swap and LoRA at once."""
    settings, checkpointing = COMBINATIONS["fp8+checkpointing+swap"]
    reference, _ = _prepared(settings, checkpointing)
    want_out, want_grads, _ = _steps(reference, add_lora(reference), 1)

    counter = CompileCounterWithBackend("inductor")
    model, _ = _prepared(settings, checkpointing, compile=counter)
    out, grads, compiles = _steps(model, add_lora(model), 2, counter)

    assert compiles == [2, 2]
    # inductor fuses the fp32 norms, softmax and matmul epilogues and so sums in another order: measured
    # differences are ~1e-6 on outputs of magnitude ~1, far below anything a bug would cause
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_train_compile_trains_exactly_as_eager_without_recompiling(tmp_path, wan_model, monkeypatch):
    """`train.compile = true` through the trainer: the same losses; compiles stop once each bucket shape
    has been seen (the demo data has two: 2 graphs at the first step, 2 more when the second shape
    arrives and dynamo makes its sizes dynamic), however many blocks and steps there are."""
    config = make_project(tmp_path / "project", wan_model)
    from tuner.cli import main

    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0

    def run(out, *overrides):
        trainer = WanTrainer(cfg(config, f"save.output_dir='{out}'", "log.tensorboard=false", "train.max_steps=8",
                                 *overrides))  # fmt: skip
        trainer.train(log=lambda s: None)
        return trainer

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(
        memory, "compile_blocks", functools.partial(compile_module.compile_blocks, backend=counter)
    )
    per_step = []
    log_step = NetworkTrainer._log_step
    monkeypatch.setattr(NetworkTrainer, "_log_step", lambda self, run: (per_step.append(counter.frame_count),
                                                                        log_step(self, run)))  # fmt: skip
    compiled = run(tmp_path / "compiled", "train.compile=true")
    compiles = list(per_step)
    eager = run(tmp_path / "eager")
    assert compiled.history == eager.history
    assert len(compiles) == 8 and compiles[0] == 2 and max(compiles) == 4 and compiles[-4:] == [4] * 4, (
        compiles
    )


def test_generate_takes_the_same_switch(tmp_path, wan_model, capsys, monkeypatch):
    """`train.compile = true` in `tuner generate`: the same image, one compile for every block and step."""
    import numpy as np
    from PIL import Image

    from project import run

    config = make_project(tmp_path, wan_model)
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(
        memory, "compile_blocks", functools.partial(compile_module.compile_blocks, backend=counter)
    )

    def draw(name: str, *overrides: str) -> np.ndarray:
        code, out = run(capsys, "generate", "--config", config, "--prompt", "a red circle", "--size", "64x48",
                        "--frames", "1", "--steps", "3", "--guidance", "1", "--device", "cpu",
                        "--out", tmp_path / name, *overrides)  # fmt: skip
        assert code == 0, out
        return np.asarray(Image.open(tmp_path / name))

    compiled = draw("compiled.png", "--set", "train.compile=true")
    assert counter.frame_count == 1  # inference: no grad anywhere, one shape, so one graph for all
    assert np.array_equal(compiled, draw("eager.png"))
