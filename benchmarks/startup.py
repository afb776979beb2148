"""What users wait for before anything useful happens: imports, a `tuner cache latents` with nothing to
do, the time to the first training step, and the training loop's overhead with the default
`data.num_workers`. One run measures everything on the tiny Wan fixture and generated images:

(a) imports: every module the process holds when it gets to work, imported again in that order in fresh
    interpreters and timed in CPU seconds, over the CPU seconds of `import torch` alone. The modules
    are the ones (b)'s runs held, not a list kept here, so nothing imported is left out: for
    `tuner train` when it logs step 1 (goal: at most 2.0), for a no-op `tuner cache latents` when it
    ends (goal: at most 1.5). The training ratio is measured twice: in this `[dev]` install (with peft,
    deepspeed, ...) and in a user install (`user_install`: tuner's dependencies only, linked from this
    one). Beside each: what importing the diffusers model module forces by itself however tuner imports
    it (`FORCED`: torch._dynamo, transformers, bitsandbytes, and peft where it is installed), each with
    its cost and the diffusers module that imports it, and the ratio the rest would give without it.
(b) per 1,000 items: wall time of a no-op `tuner cache latents` and of `tuner train` up to its first
    step, each from interpreter start, at the two item counts; the slope per 1,000 items and the fixed
    cost left at zero items. Goal: slope at most 0.15 s per 1,000 items.
(c) loop overhead: seconds per step of `tuner train` with the default `data.num_workers` over a bare
    PyTorch loop on the same batches, with the goal, as `benchmarks/train_overhead.py --workers N`
    measures and prints them (run as a separate process).

    python benchmarks/startup.py [--items 1000 8000] [--repeats 3] [--smoke]

`--smoke` runs everything at toy sizes (CI checks that it prints its ratios; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import collections
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

# What importing a diffusers model module imports whatever tuner does (diffusers 0.42), and which of
# diffusers' modules does it, in the order it does: each is timed as the next import after torch and
# those before it; the model module comes last (diffusers' own modules, the single-file tables).
FORCED = {
    "torch._dynamo": "diffusers.utils.torch_utils, at `import diffusers`; with torch._inductor, sympy",
    "transformers": "diffusers.quantizers.pipe_quant_config",
    "bitsandbytes": "diffusers.quantizers.bitsandbytes, where installed (a tuner dependency)",
    "peft": "diffusers.hooks.layerwise_casting, where installed ([dev])",
    "accelerate": "diffusers.quantizers.bfl",
}

# Runs a command of the CLI and prints, as JSON, the seconds from interpreter start to its end and to
# the first optimizer step (if it trains), and the modules it held then (at the step, else at the end).
DRIVER = """
import json, sys, time
start = time.perf_counter()
from tuner.trainers.base import NetworkTrainer
marks = {}
log_step = NetworkTrainer._log_step
def first_step(self, run):
    if "first_step" not in marks:
        marks["first_step"] = time.perf_counter() - start
        marks["modules"] = list(sys.modules)
    log_step(self, run)
NetworkTrainer._log_step = first_step
from tuner.cli import main
code = main(sys.argv[1:])
marks["end"] = time.perf_counter() - start
marks.setdefault("modules", list(sys.modules))
print("MARKS " + json.dumps(marks))
sys.exit(code)
"""

# Imports the modules named on stdin, in that order, after torch; prints the CPU seconds of both.
REPLAY = """
import importlib, json, sys, time
names = json.loads(sys.stdin.read())
start = time.process_time()
import torch
torch_s = time.process_time() - start
failed = []
for name in names:
    if name not in sys.modules and not name.startswith("__"):
        try:
            importlib.import_module(name)
        except Exception:
            failed.append(name)
print(json.dumps({"torch": torch_s, "all": time.process_time() - start, "failed": failed}))
"""

# Imports torch, then `FORCED` (those named on stdin) one by one, then the model module (argv[1]) as
# tuner does; prints the CPU seconds of each.
FORCED_COST = """
import importlib, json, sys, time
names = json.loads(sys.stdin.read())
import torch
costs = {}
for name in names + [sys.argv[1]]:
    start = time.process_time()
    importlib.import_module(name)
    costs[name] = time.process_time() - start
print(json.dumps(costs))
"""


def _python(code: str, *args: str, stdin: str | None = None, python: str = sys.executable) -> str:
    """stdout of `code` run in a fresh interpreter (`python`) that imports tuner from this checkout."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, env=env, input=stdin)
    if out.returncode:
        raise RuntimeError(f"{code[:60]!r} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return out.stdout


def _last_json(code: str, *args: str, stdin: str | None = None, python: str = sys.executable):
    return json.loads(_python(code, *args, stdin=stdin, python=python).strip().splitlines()[-1])


def user_install(root: Path) -> str:
    """A virtual environment holding what `pip install tuner` brings: tuner's dependencies and theirs,
    no extras (so no peft, deepspeed, pytest), each linked from this interpreter's site-packages, so the
    versions are the ones measured beside it. Returns its `python`."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = str(root / "bin" / "python")
    site = Path(_python("import sysconfig; print(sysconfig.get_paths()['purelib'])", python=python).strip())
    project = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]
    todo, seen = [(Requirement(r), "") for r in project["dependencies"]], set()
    while todo:
        req, extra = todo.pop()
        if (req.marker is not None and not req.marker.evaluate({"extra": extra})) or (
            req.name,
            extra,
        ) in seen:
            continue
        seen.add((req.name, extra))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:  # a dependency of a dependency that is not installed here
            continue
        for entry in {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}:
            if not (site / entry).exists():
                (site / entry).symlink_to(dist.locate_file(entry))
        todo += [(Requirement(r), e) for r in dist.requires or () for e in ("", *req.extras)]
    return python


# --- (a) imports ------------------------------------------------------------------------------------


def replay_seconds(
    modules: list[str], repeats: int, python: str = sys.executable
) -> tuple[float, float, int]:
    """Median CPU seconds of `import torch` and of importing all of `modules` after it (torch
    included), in fresh interpreters; and how many of `modules` could not be imported alone."""
    runs = [_last_json(REPLAY, stdin=json.dumps(modules), python=python) for _ in range(repeats)]
    torch_s = statistics.median(r["torch"] for r in runs)
    return torch_s, statistics.median(r["all"] for r in runs), len(runs[0]["failed"])


def forced_by(model_module: str, repeats: int, python: str) -> tuple[dict[str, float], set[str]]:
    """What importing `model_module` after torch imports by itself: the CPU seconds
    of each of `FORCED` it pulls in and of the rest (`model_module` itself, last), and every module it
    leaves loaded."""
    probe = f"import json, sys, torch\nimport {model_module}\nprint(json.dumps(list(sys.modules)))"
    loaded = set(_last_json(probe, python=python))
    forced = [name for name in FORCED if name in loaded]
    runs = [
        _last_json(FORCED_COST, model_module, stdin=json.dumps(forced), python=python) for _ in range(repeats)
    ]
    return {name: statistics.median(r[name] for r in runs) for name in runs[0]}, loaded


def measure_train_imports(
    install: str, python: str, modules: list[str], model_module: str, repeats: int
) -> None:
    """Prints the training ratio of one install, what importing `model_module` forces in it (each import
    with its cost and the diffusers module that imports it) and the ratio without that."""
    torch_s, total_s, failed = replay_seconds(modules, repeats, python)
    note = f"; {failed} not importable alone, left out" if failed else ""
    print(f"(a) imports at step 1 of tuner train, {install}: {len(modules):,} modules, {total_s:.2f} s CPU "
          f"over import torch's {torch_s:.2f} s: ratio {total_s / torch_s:5.2f}  (goal <= 2.0){note}")  # fmt: skip
    costs, loaded = forced_by(model_module, repeats, python)
    forced_s = sum(costs.values())
    print(f"    forced by importing {model_module} after torch, whatever tuner does: "
          f"{forced_s:.2f} s ({forced_s / torch_s:.2f} x torch)")  # fmt: skip
    for name, why in FORCED.items():
        cost = f"{costs[name]:5.2f} s" if name in costs else "   --  "
        print(f"      {name:<14} {cost}  {why}{'' if name in costs else ': not imported here'}")
    print(
        f"      {'diffusers':<14} {costs[model_module]:5.2f} s  the model module and diffusers' own modules"
    )
    rest = [m for m in modules if m not in loaded]
    packages = collections.Counter(m.split(".")[0] for m in rest).most_common(4)
    print(f"    the other {len(rest):,} modules ({', '.join(f'{p} {n}' for p, n in packages)}, ...): "
          f"about {total_s - torch_s - forced_s:.2f} s (the total less torch and the above: noisy)")  # fmt: skip
    print(
        f"    without what importing the model forces, the ratio would be {(total_s - forced_s) / torch_s:.2f}"
    )


def measure_cache_imports(modules: list[str], repeats: int) -> None:
    torch_s, total_s, failed = replay_seconds(modules, repeats)
    note = f"; {failed} not importable alone, left out" if failed else ""
    print(f"(a) imports of a no-op tuner cache latents: {len(modules):,} modules, {total_s:.2f} s CPU "
          f"over import torch's {torch_s:.2f} s: ratio {total_s / torch_s:5.2f}  (goal <= 1.5){note}")  # fmt: skip


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


def run_marks(*argv: str, python: str = sys.executable) -> dict:
    out = _python(DRIVER, *argv, python=python)
    return json.loads(out.rsplit("MARKS ", 1)[1].splitlines()[0])


def measure_items(
    root: Path, model: Path, counts: list[int], repeats: int, user: str
) -> dict[str, list[str]]:
    """Prints (b); returns the modules a no-op cache run held at its end and a training run at step 1
    (at the smallest item count, for (a)), and those of one more training run in the user install."""
    cache, first, modules = {}, {}, {}
    for n in counts:
        config = str(make_project(root / f"items{n}", model, n))
        runs = [run_marks("cache", "latents", "--config", config) for _ in range(repeats)]
        cache[n] = statistics.median(r["end"] for r in runs)
        modules.setdefault("cache", runs[0]["modules"])
        runs = [
            run_marks("train", "--config", config, "--set", "train.max_steps=1", "--set", "log.tensorboard=false",
                      "--set", "save.save_state=false", "--set", f"save.output_dir='{root / f'out{n}_{i}'}'")
            for i in range(repeats)
        ]  # fmt: skip
        first[n] = statistics.median(r["first_step"] for r in runs)
        if "train" not in modules:
            modules["train"] = runs[0]["modules"]
            modules["user train"] = run_marks(
                "train", "--config", config, "--set", "train.max_steps=1", "--set", "log.tensorboard=false",
                "--set", "save.save_state=false", "--set", f"save.output_dir='{root / 'out_user'}'", python=user,
            )["modules"]  # fmt: skip
    low, high = counts[0], counts[-1]
    for name, seconds in (("no-op cache latents", cache), ("time to first step", first)):
        slope = (seconds[high] - seconds[low]) / ((high - low) / 1000)
        fixed = seconds[low] - slope * low / 1000
        at = ", ".join(f"{seconds[n]:.2f} s at {n}" for n in counts)
        print(
            f"(b) {name:<20} {at}: {slope:6.3f} s per 1,000 items above a fixed {fixed:.2f} s  (goal <= 0.15)"
        )
    return modules


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
    goal = re.search(r"\(goal <= ([0-9.]+)\)", out.stdout)[1]  # train_overhead.GOAL, one goal for both
    print(f"(c) loop overhead, num_workers = {workers}: {ms.get('tuner train')} ms/step over a bare "
          f"{ms.get('bare loop')} ms/step: ratio {float(found[1]):5.3f}  (goal <= {goal})")  # fmt: skip


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

    from diffusers import WanTransformer3DModel

    from tuner.fixtures import write_fixture

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_fixture("wan", root / "model")
        user = user_install(root / "user")
        modules = measure_items(root, root / "model", args.items, args.repeats, user)
        model_module = WanTransformer3DModel.__module__
        for install, python, held in (
            ("[dev] install (this one)", sys.executable, modules["train"]),
            ("user install (tuner's dependencies only)", user, modules["user train"]),
        ):
            measure_train_imports(install, python, held, model_module, args.repeats)
    measure_cache_imports(modules["cache"], args.repeats)
    measure_overhead(args.steps, args.rounds, args.smoke)


if __name__ == "__main__":
    main()
