"""What users wait for before anything useful happens: imports, a `tuner cache latents` with nothing to
do, the time to the first training step, and the training loop's overhead with the default
`data.num_workers`. One run measures everything on the tiny Wan fixture and generated images:

(a) import: seconds to import the caching path (the CLI, the cache commands, the Wan trainer) and the
    training path (that, plus what `tuner train` imports before it loads the model), over seconds to
    import torch alone, in fresh interpreters. Goal: at most 1.5. Also shown, not judged: what importing
    the diffusers model class then adds (diffusers imports all its models, torch._dynamo and, where
    peft is installed, bitsandbytes).
(b) per 1,000 items: wall time of a no-op `tuner cache latents` and of `tuner train` up to its first
    step, each from interpreter start, at the two item counts; the slope per 1,000 items and the fixed
    cost left at zero items. Goal: slope at most 0.15 s per 1,000 items.
(c) loop overhead: seconds per step of `tuner train` with the default `data.num_workers` over a bare
    PyTorch loop on the same batches, as `benchmarks/train_overhead.py --workers N` measures and prints
    it (run as a separate process). Goal: at most 1.03.

    python benchmarks/startup.py [--items 1000 8000] [--repeats 3] [--smoke]

`--smoke` runs everything at toy sizes (CI checks that it prints its ratios; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

CACHING_PATH = ("tuner.cli", "tuner.config", "tuner.cache.commands", "tuner.archs.wan.trainer")
TRAINING_PATH = (
    *CACHING_PATH,
    "accelerate",
    "tuner.cache.plan",
    "tuner.cache.batches",
    "tuner.memory",
    "tuner.networks.factory",
    "tuner.optimizers.build",
    "tuner.trainers.checkpoints",
)
HEAVY = ("bitsandbytes", "torch._dynamo", "diffusers", "transformers")

# Runs a command of the CLI and prints, as JSON, the seconds from interpreter start to its end and to
# the first optimizer step (if it trains).
DRIVER = """
import json, sys, time
start = time.perf_counter()
from tuner.trainers.base import NetworkTrainer
marks = {}
log_step = NetworkTrainer._log_step
def first_step(self, run):
    marks.setdefault("first_step", time.perf_counter() - start)
    log_step(self, run)
NetworkTrainer._log_step = first_step
from tuner.cli import main
code = main(sys.argv[1:])
marks["end"] = time.perf_counter() - start
print("MARKS " + json.dumps(marks))
sys.exit(code)
"""


def _python(code: str, *args: str) -> str:
    """stdout of `code` run in a fresh interpreter that imports tuner from this checkout."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{code[:60]!r} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return out.stdout


# --- (a) imports ------------------------------------------------------------------------------------


def import_seconds(modules: tuple[str, ...], then: str = "") -> dict:
    """Seconds for `import torch` and then for `modules` in one fresh interpreter (and for `then`)."""
    code = (
        "import sys, time, json\n"
        "t0 = time.perf_counter(); import torch; t1 = time.perf_counter()\n"
        + "".join(f"import {m}\n" for m in modules)
        + "t2 = time.perf_counter()\n"
        + (then + "\n" if then else "")
        + "t3 = time.perf_counter()\n"
        + f"print(json.dumps({{'torch': t1 - t0, 'path': t2 - t1, 'then': t3 - t2, "
        f"'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))"
    )
    return json.loads(_python(code).strip().splitlines()[-1])


def measure_imports(repeats: int, model_class: bool = True) -> None:
    then = "from diffusers import WanTransformer3DModel" if model_class else ""
    for name, modules in (("caching path", CACHING_PATH), ("training path", TRAINING_PATH)):
        runs = [import_seconds(modules, then) for _ in range(repeats)]
        torch_s = statistics.median(r["torch"] for r in runs)
        path_s = statistics.median(r["path"] for r in runs)
        then_s = statistics.median(r["then"] for r in runs)
        print(f"(a) import {name:<13} {path_s:6.2f} s after torch's {torch_s:5.2f} s: "
              f"ratio {(torch_s + path_s) / torch_s:5.2f}  (goal <= 1.5)")  # fmt: skip
    if model_class:
        print(f"    then the diffusers model class: +{then_s:.2f} s (diffusers imports every model class, "
              "torch._dynamo, and bitsandbytes through peft where peft is installed)")  # fmt: skip


# --- (b) per 1,000 items ------------------------------------------------------------------------------


def make_project(root: Path, model: Path, items: int) -> Path:
    """A Wan project over `items` generated 32x32 images, cached; `data.num_workers` left at its default."""
    from tuner.cli import main as tuner
    from tuner.demo import prepare
    from tuner.fixtures.dataset import write_images

    config = prepare(root, model=model)
    config.write_text(re.sub(r"(?m)^num_workers = .*\n", "", config.read_text()))
    write_images(root / "many", items, (32, 32), seed=0)
    # A user's files are older than the caching run; files changed in the last 2 s are not remembered
    # (tuner.cache.memo's racy rule) and would be hashed and probed again at every start.
    hour_ago = time.time() - 3600
    for path in (root / "many").iterdir():
        os.utime(path, (hour_ago, hour_ago))
    (root / "dataset.toml").write_text(
        '[general]\nresolution = [32, 32]\ncaption_extension = ".txt"\nbatch_size = 1\n'
        'cache_directory = "cache"\n[[datasets]]\nimage_directory = "many"\n'
    )
    for kind in ("latents", "text"):
        assert tuner(["cache", kind, "--config", str(config), "--set", "cache.batch_size=64"]) == 0
    return config


def run_marks(*argv: str) -> dict:
    out = _python(DRIVER, *argv)
    return json.loads(out.rsplit("MARKS ", 1)[1].splitlines()[0])


def measure_items(root: Path, model: Path, counts: list[int], repeats: int) -> None:
    cache, first = {}, {}
    for n in counts:
        config = str(make_project(root / f"items{n}", model, n))
        cache[n] = statistics.median(
            run_marks("cache", "latents", "--config", config)["end"] for _ in range(repeats)
        )
        first[n] = statistics.median(
            run_marks("train", "--config", config, "--set", "train.max_steps=1", "--set", "log.tensorboard=false",
                      "--set", "save.save_state=false", "--set", f"save.output_dir='{root / f'out{n}_{i}'}'")[
                "first_step"
            ]
            for i in range(repeats)
        )  # fmt: skip
    low, high = counts[0], counts[-1]
    for name, seconds in (("no-op cache latents", cache), ("time to first step", first)):
        slope = (seconds[high] - seconds[low]) / ((high - low) / 1000)
        fixed = seconds[low] - slope * low / 1000
        at = ", ".join(f"{seconds[n]:.2f} s at {n}" for n in counts)
        print(
            f"(b) {name:<20} {at}: {slope:6.3f} s per 1,000 items above a fixed {fixed:.2f} s  (goal <= 0.15)"
        )


# --- (c) loop overhead --------------------------------------------------------------------------------


def measure_overhead(steps: int, rounds: int, smoke: bool) -> None:
    """Runs `train_overhead.py` with tuner's default worker count and reports its ratio."""
    from tuner.config.schema import DataConfig

    workers = DataConfig.__dataclass_fields__["num_workers"].default
    args = ["--steps", str(steps), "--rounds", str(rounds), "--workers", str(workers)]
    if smoke:
        args += ["--warmup", "1", "--dim", "64", "--layers", "1"]
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, str(HERE / "train_overhead.py"), *args], capture_output=True, text=True,
                         env=env)  # fmt: skip
    found = re.search(r"(?m)^ratio\s+([0-9.]+)", out.stdout)
    if out.returncode or not found:
        why = (out.stderr.strip().splitlines() or ["no ratio printed"])[-1]
        print(
            f"(c) loop overhead, num_workers = {workers}: not measured: train_overhead.py {' '.join(args)}: {why}"
        )
        return
    ms = dict(re.findall(r"(?m)^(bare loop|tuner train)\s+([0-9.]+) ms/step", out.stdout))
    print(f"(c) loop overhead, num_workers = {workers}: {ms.get('tuner train')} ms/step over a bare "
          f"{ms.get('bare loop')} ms/step: ratio {float(found[1]):5.3f}  (goal <= 1.03)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, nargs=2, default=[1000, 8000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="toy sizes, for CI: prints the ratios only")
    args = parser.parse_args()
    if args.smoke:
        args.items, args.repeats, args.steps, args.rounds = [4, 8], 1, 2, 1

    from tuner.fixtures import write_fixture

    measure_imports(args.repeats, model_class=not args.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_fixture("wan", root / "model")
        measure_items(root, root / "model", args.items, args.repeats)
    measure_overhead(args.steps, args.rounds, args.smoke)


if __name__ == "__main__":
    main()
