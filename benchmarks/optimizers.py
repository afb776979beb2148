"""Every named optimizer on the demo task: optimizer state per trained parameter, and the loss reached.

Two figures per optimizer, measured in one run:
- state bytes per parameter: the bytes of every state tensor after one step over a 1024 × 1024 fp32
  matrix (what a LoRA's matrices look like to an optimizer; a bf16 weight adds Kahan's compensation),
  divided by its element count;
- the mean loss of the last `--tail` steps after `--steps` steps of a rank-8 LoRA on the tiny Wan demo
  (same seed, same data order and noise for all), each at its recommended learning rate.

    python benchmarks/optimizers.py                    # the table in docs/optimizers.md
    python benchmarks/optimizers.py --steps 4 --tail 2 --only adamw automagic   # smoke run
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

# (learning rate, optimizer_args) each optimizer runs at: its package's or paper's recommendation
RECOMMENDED = {
    "adamw": (1e-3, {}),
    "adamw8bit": (1e-3, {}),
    "paged_adamw8bit": (1e-3, {}),
    "adafactor": (1e-3, {}),
    "lion": (1e-4, {}),
    "lion8bit": (1e-4, {}),
    "paged_lion8bit": (1e-4, {}),
    "prodigy": (1.0, {}),
    "adamw_schedulefree": (2.5e-3, {}),
    "came": (1e-3, {}),
    "automagic": (1e-4, {"max_lr": 1e-2, "lr_bump": 1e-5}),
    "adamw8bitkahan": (1e-3, {}),
    "genericoptim": (1e-3, {"second_moment": "factored", "subspace": "galore", "rank": 4}),
}


def state_bytes_per_parameter(name: str) -> float:
    from tuner.optimizers.build import build_optimizer

    lr, kwargs = RECOMMENDED[name]
    weight = torch.nn.Parameter(torch.randn(1024, 1024))
    optimizer = build_optimizer(name, [weight], lr, dict(kwargs))
    if hasattr(optimizer, "train"):
        optimizer.train()
    weight.grad = torch.randn_like(weight)
    optimizer.step()
    total = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )
    return total / weight.numel()


def demo_loss(name: str, project: Path, out: Path, steps: int, tail: int) -> float:
    from tuner.config import load_config
    from tuner.trainers import trainer_class

    lr, kwargs = RECOMMENDED[name]
    args = ", ".join(f"{k} = {json.dumps(v)}" for k, v in kwargs.items())  # JSON scalars are TOML
    cfg = load_config(project, [
        f"save.output_dir='{out}'", "log.tensorboard=false", f"train.max_steps={steps}", "train.lr_warmup_steps=0",
        f"train.optimizer='{name}'", f"train.learning_rate={lr}", f"train.optimizer_args={{ {args} }}",
        "save.every_n_epochs=0", "save.save_state=false",
    ])  # fmt: skip
    trainer = trainer_class("wan")(cfg)
    trainer.train(log=lambda s: None)
    return sum(trainer.history[-tail:]) / tail


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tail", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=list(RECOMMENDED))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from tuner.cli import main as tuner
    from tuner.demo import prepare
    from tuner.fixtures import write_fixture

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_fixture("wan", root / "model")
        project = prepare(root / "project", steps=args.steps, model=root / "model", architecture="wan")
        assert tuner(["cache", "latents", "--config", str(project)]) == 0
        assert tuner(["cache", "text", "--config", str(project)]) == 0
        print(
            f"| optimizer | lr | state bytes / parameter | loss, mean of the last {args.tail} of {args.steps} steps |"
        )
        print("|---|---|---|---|")
        for name in args.only:
            loss = demo_loss(name, project, root / f"out_{name}", args.steps, args.tail)
            lr, kwargs = RECOMMENDED[name]
            extra = "".join(f", {k} {v}" for k, v in kwargs.items())
            print(
                f"| `{name}` | {lr:g}{extra} | {state_bytes_per_parameter(name):.2f} | {loss:.4f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
