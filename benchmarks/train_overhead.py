"""Seconds per training step through `tuner train` versus a bare PyTorch loop, in one process.

The question: how much does tuner's loop (cache reads, seeded noise and timesteps, accelerate, logging)
add to the work any training loop must do? The bare loop is that work and nothing else: it holds one
batch on the device and runs forward, loss, backward, clipping and the optimizer step.

What makes the comparison fair. Both loops
- train the same Wan transformer (random weights from one seed; `--dim`, `--layers`) in the same dtype
  and autocast, on the same device (CUDA when there is one), with the same intra-op thread count;
- attach the same adapter: `build_network` from the same `[network]` section (type, rank, alpha,
  targets), and build the optimizer with `build_optimizer` from the same `[train]` section;
- draw timesteps from the trainer's own sampler (`NetworkTrainer.timestep_sampler`, which resolves
  `timesteps.mode = "auto"`), call the model through the trainer's `predict` and use the same loss;
- see batches of the same shape (one bucket, `--batch-size` items, read from the same cache);
- are timed by the same clock: a forward pre-hook on the transformer that synchronizes the device and
  reads `time.perf_counter()` at the start of every forward. A step is the time from one forward to
  the next, so tuner's data loading and logging count, and its start-up and final save do not.
The hook also records the device, thread count, input shapes and number of adapted layers each loop
actually ran with, and the script stops if the two differ.

The loops run alternately for `--rounds` rounds (so machine load hits both alike); each round reports
the median step after `--warmup` steps. Prints both medians and the ratio tuner/bare with its goal,
`GOAL` (`benchmarks/startup.py` reprints both). The defaults are the Wan fixture's size (width 64,
2 blocks, the demo's 64x48 images, batches of 2): the smallest step, where the loop's own cost shows most.

    python benchmarks/train_overhead.py                                   # CPU or the first GPU
    python benchmarks/train_overhead.py --steps 3 --warmup 1 --dim 64 --layers 1 --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel
from diffusers.utils import logging as diffusers_logging
from torch import nn

from tuner.cache.plan import open_training_data
from tuner.cli import main as tuner
from tuner.config import Config, load_config
from tuner.demo import prepare
from tuner.diffusion.timesteps import add_noise, flow_loss, flow_target
from tuner.dtypes import DTYPES
from tuner.fixtures import write_fixture
from tuner.networks.factory import build_network
from tuner.optimizers.build import build_optimizer
from tuner.registry import ARCHITECTURES
from tuner.trainers import trainer_class

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also when loaded by path (tests)
from report import table  # noqa: E402

DATASET_TOML = """\
[general]
resolution = [{width}, {height}]
batch_size = {batch_size}
cache_directory = "cache"

[[datasets]]
image_directory = "data/images"
num_repeats = {repeats}
"""
GOAL = 1.05  # tuner/bare, at the defaults with the default data.num_workers
DEMO_IMAGES = 4  # what `tuner.demo.prepare` writes; all of them fall into one bucket


def build_model(dim: int, layers: int, dtype: torch.dtype) -> WanTransformer3DModel:
    """A Wan transformer with random weights from seed 0 (text_dim matches the fixture's text encoder)."""
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=max(dim // 64, 1), attention_head_dim=min(dim, 64),
        in_channels=16, out_channels=16, text_dim=64, freq_dim=64, ffn_dim=dim * 4, num_layers=layers,
        cross_attn_norm=True, rope_max_seq_len=1024,
    )  # fmt: skip
    return model.to(dtype)


class StepClock:
    """Forward pre-hook on the transformer: synchronizes the device, then reads the clock. It also
    notes what the loop really ran with, so the two loops can be checked to match."""

    def __init__(self) -> None:
        self.marks: list[float] = []
        self.seen: set[tuple] = set()

    def attach(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs["hidden_states"]
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        self.marks.append(time.perf_counter())
        if len(self.marks) == 1:  # once: walking the modules every step would add to both loops
            adapted = sum(isinstance(m, nn.Linear) and "forward" in m.__dict__ for m in model.modules())
            self.seen.add(
                (str(x.device), torch.get_num_threads(), tuple(x.shape),
                 tuple(kwargs["encoder_hidden_states"].shape), str(x.dtype), adapted)
            )  # fmt: skip

    def median_step(self, warmup: int) -> float:
        steps = [b - a for a, b in zip(self.marks, self.marks[1:])][warmup:]
        return statistics.median(steps)


class BenchTrainer(trainer_class("wan")):
    """The Wan trainer with a random-weight transformer of the benchmark's size, timed by `clock`."""

    def __init__(self, cfg: Config, dim: int, layers: int, clock: StepClock):
        super().__init__(cfg)
        self.dim, self.layers, self.clock = dim, layers, clock

    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        model = build_model(self.dim, self.layers, dtype)
        self.clock.attach(model)
        return model


def tuner_loop(cfg: Config, dim: int, layers: int) -> StepClock:
    """`tuner train`'s loop (the trainer the CLI builds, with the benchmark's transformer)."""
    clock = StepClock()
    BenchTrainer(cfg, dim, layers, clock).train(log=lambda s: None)
    return clock


def bare_loop(cfg: Config, dim: int, layers: int, steps: int, device: torch.device) -> StepClock:
    """Forward, loss, backward, clip, step on one batch held on the device; nothing else."""
    trainer = ARCHITECTURES["wan"].family_model(
        cfg
    )  # for its model-specific calls only: collate_text, predict, timestep_sampler
    tc = cfg.train
    batch = next(iter(open_training_data(trainer, cfg, log=lambda s: None).epoch(0)))
    x0 = batch["latents"].to(device)
    cond = {k: v.to(device) for k, v in {**trainer.collate_text(batch["text"]), **batch["extra"]}.items()}
    dtype = DTYPES[cfg.model.dtype]
    model = build_model(dim, layers, dtype).to(device).requires_grad_(False)
    model.train(tc.gradient_checkpointing)  # as the trainer sets it
    network = build_network(model, trainer.default_targets, cfg.network, None, seed=tc.seed).to(device)
    optimizer = build_optimizer(tc.optimizer, network.parameters(), tc.learning_rate, tc.optimizer_args)
    sampler = trainer.timestep_sampler()
    autocast = DTYPES.get(tc.mixed_precision)
    clock = StepClock()
    clock.attach(model)
    for _ in range(steps):
        noise = torch.randn_like(x0)
        t = sampler.sample(x0.shape[0], device=device, seq_len=trainer.seq_len(x0))
        with torch.autocast(device.type, autocast or dtype, enabled=autocast is not None):
            pred = trainer.predict(model, add_noise(x0, noise, t).to(dtype), t, cond)
        loss = flow_loss(pred.float(), flow_target(x0, noise).float(), t, cfg.timesteps.loss_weighting)
        loss.backward()
        if tc.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(network.parameters(), tc.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return clock


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per loop and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median reported)")
    parser.add_argument("--dim", type=int, default=64, help="transformer width (heads of 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--resolution", default="64,48", help="image width,height (one bucket)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16 also autocasts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--workers", type=int, default=0, help="tuner's data.num_workers")
    parser.add_argument("--markdown", type=Path, help="also write the result as a markdown table here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    diffusers_logging.set_verbosity_error()  # the fp32-modules note on every `.to(dtype)`
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # what accelerate picks
    width, height = (int(s) for s in args.resolution.split(","))
    forwards = args.warmup + args.steps + 1  # n + 1 forward starts bound n steps
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_fixture("wan", root / "model")
        config = prepare(root / "project", model=root / "model")
        # enough repeats that every timed step falls in the first epoch
        repeats = math.ceil(forwards * args.batch_size / DEMO_IMAGES)
        (root / "project" / "dataset.toml").write_text(
            DATASET_TOML.format(width=width, height=height, batch_size=args.batch_size, repeats=repeats)
        )
        assert tuner(["cache", "latents", "--config", str(config)]) == 0
        assert tuner(["cache", "text", "--config", str(config)]) == 0
        common = [
            f"model.dtype='{args.dtype}'",
            f"train.mixed_precision='{'no' if args.dtype == 'fp32' else args.dtype}'",
            f"data.num_workers={args.workers}",
        ]
        bares, ours, seen = [], [], set()
        for round_ in range(args.rounds):
            cfg = load_config(config, [
                *common, f"train.max_steps={forwards}", f"save.output_dir='{root / f'out{round_}'}'",
                "log.tensorboard=false", "save.every_n_steps=0", "save.every_n_epochs=0", "save.save_state=false",
            ])  # fmt: skip
            # alternate which loop goes first, so a trend in machine load hits both alike
            for which in ("bare", "tuner") if round_ % 2 == 0 else ("tuner", "bare"):
                if which == "bare":
                    clock = bare_loop(cfg, args.dim, args.layers, forwards, device)
                    bares.append(clock.median_step(args.warmup))
                else:
                    clock = tuner_loop(cfg, args.dim, args.layers)
                    ours.append(clock.median_step(args.warmup))
                seen |= clock.seen
            print(
                f"round {round_}: bare loop {bares[-1] * 1000:.2f} ms/step, tuner train {ours[-1] * 1000:.2f} ms/step"
            )
    if len(seen) != 1:
        raise SystemExit(f"the two loops did not run the same setup: {sorted(seen)}")
    ran_on, threads, latents, text, dtype, adapted = seen.pop()
    bare, tuned = statistics.median(bares), statistics.median(ours)
    print(
        f"device {ran_on}, {threads} threads, latents {list(latents)} {dtype}, text {list(text)}, "
        f"{adapted} adapted layers, width {args.dim} × {args.layers} blocks"
    )
    print(f"median of {args.rounds} round(s) × {args.steps} steps after {args.warmup} warm-up")
    print(f"bare loop   {bare * 1000:8.2f} ms/step")
    print(f"tuner train {tuned * 1000:8.2f} ms/step")
    print(f"ratio       {tuned / bare:8.3f}  tuner/bare (goal <= {GOAL})")
    if args.markdown:
        setup = (
            f"{ran_on}, {threads} threads, width {args.dim} × {args.layers} blocks, latents {list(latents)}"
        )
        cells = [f"{setup}, {dtype}", f"{bare * 1000:.2f}", f"{tuned * 1000:.2f}", f"{tuned / bare:.3f}"]
        text = table(["setup", "bare loop ms/step", "tuner train ms/step", "tuner ÷ bare"], [cells])
        runs = f"Median of {args.rounds} round(s) × {args.steps} steps after {args.warmup} warm-up."
        args.markdown.write_text(f"{text}\n\n{runs}\n")
    return {"bare_seconds": bare, "tuner_seconds": tuned, "ratio": tuned / bare}


if __name__ == "__main__":
    main()
