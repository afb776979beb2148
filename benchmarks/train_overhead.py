"""Seconds per training step through `tuner train` versus a bare PyTorch loop, in one process.

Both train the same Wan transformer (random weights, a tiny-but-not-trivial config) with the same LoRA
on the same cached batch shapes; the bare loop does forward, loss, backward and optimizer step and
nothing else. Both report the median wall time of an optimizer step after a warm-up (tuner's loop
records its step times; loading and cache checks are not counted, data loading is). The two are run
alternately a few rounds, so machine load hits both alike. Prints both and the ratio (target: at
most 1.05).

    python benchmarks/train_overhead.py [--steps 30] [--dim 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from diffusers import WanTransformer3DModel  # noqa: E402

from tuner.cli import main as tuner  # noqa: E402
from tuner.config import load_config  # noqa: E402
from tuner.demo import prepare  # noqa: E402
from tuner.fixtures import write_fixture  # noqa: E402
from tuner.networks.lora import LoRANetwork  # noqa: E402
from tuner.networks.targets import TargetSpec  # noqa: E402
from tuner.timesteps import add_noise, flow_loss, flow_target, sampler_from_config  # noqa: E402
from tuner.trainers.wan import WanTrainer  # noqa: E402


def build_model(dim: int, layers: int) -> WanTransformer3DModel:
    torch.manual_seed(0)
    heads = dim // 64
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=64, in_channels=16, out_channels=16,
        text_dim=64, freq_dim=64, ffn_dim=dim * 4, num_layers=layers, cross_attn_norm=True, rope_max_seq_len=64,
    )  # fmt: skip


def tuner_seconds_per_step(config: Path, out: Path, steps: int, dim: int, layers: int) -> float:
    WanTrainer.load_transformer = lambda self, dtype: build_model(dim, layers).to(dtype)
    cfg = load_config(config, [f"train.max_steps={steps + 3}", f"save.output_dir='{out}'",
                               "log.tensorboard=false", "save.every_n_steps=0", "save.save_state=false"])  # fmt: skip
    trainer = WanTrainer(cfg)
    trainer.train(log=lambda s: None)
    return statistics.median(trainer.step_seconds[3:])


def bare_seconds_per_step(config: Path, steps: int, dim: int, layers: int) -> float:
    cfg = load_config(config)
    trainer = WanTrainer(cfg)
    from tuner.cache.plan import open_training_data

    data = open_training_data(trainer, cfg, log=lambda s: None)
    batch = next(iter(data.epoch(0)))
    model = build_model(dim, layers)
    model.requires_grad_(False)
    network = LoRANetwork.apply_to(model, TargetSpec(WanTrainer.default_targets), rank=cfg.network.rank,
                                   alpha=cfg.network.alpha)  # fmt: skip
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4)
    sampler = sampler_from_config(cfg.timesteps)
    x0 = batch["latents"]
    cond = {**trainer.collate_text(batch["text"]), **batch["extra"]}

    def step() -> None:
        noise = torch.randn_like(x0)
        t = sampler.sample(x0.shape[0])
        pred = trainer.predict(model, add_noise(x0, noise, t), t, cond)
        loss = flow_loss(pred, flow_target(x0, noise), t)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_fixture("wan", root / "model")
        config = prepare(root / "project", model=root / "model")
        # one bucket of 128x96 images, batch size 1 (the same shape in both loops)
        (root / "project" / "dataset.toml").write_text(
            '[general]\nresolution = [128, 96]\nbatch_size = 1\ncache_directory = "cache"\n'
            '[[datasets]]\nimage_directory = "data/images"\n'
        )
        assert tuner(["cache", "latents", "--config", str(config)]) == 0
        assert tuner(["cache", "text", "--config", str(config)]) == 0
        bares, ours_ = [], []
        for round_ in range(args.rounds):
            bares.append(bare_seconds_per_step(config, args.steps, args.dim, args.layers))
            ours_.append(
                tuner_seconds_per_step(config, root / f"out{round_}", args.steps, args.dim, args.layers)
            )
        bare, ours = statistics.median(bares), statistics.median(ours_)
    print(f"bare loop   {bare * 1000:8.1f} ms/step")
    print(f"tuner train {ours * 1000:8.1f} ms/step")
    print(f"ratio       {ours / bare:8.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
