"""What a one-process `tuner train` holds when it logs step 1: nothing that run does not use. DeepSpeed
(about 425 modules; accelerate's `unwrap_model` imports it wherever it is installed), the web UI and
its server, the video decoder of a run that trains from the cache, and every diffusers model module but
the one the run trains (`tuner.models.lazy_diffusers`) stay out. Subprocesses, since this test process
has long imported everything. peft, bitsandbytes, transformers and torch._dynamo are not on the list:
importing any diffusers model imports them (`benchmarks/startup.py` prints what that and the rest cost).

`lazy_diffusers` itself: the model module imports alone, and the package's real `__init__` runs the first
time anything asks it for another name, from any thread, so the rest of diffusers works as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from project import make_project, tuner

FORBIDDEN = ("deepspeed", "tuner.ui", "fastapi", "uvicorn", "starlette", "av", "tensorboard")
# The diffusers model modules a Wan run from the cache uses: its transformer and the package holding it.
DIFFUSERS_MODELS = ("diffusers.models.transformers", "diffusers.models.transformers.transformer_wan")
MODEL_PACKAGES = ("transformers", "autoencoders", "unets", "controlnets")

PROBE = """
import json, sys
from tuner.trainers.base import NetworkTrainer
log_step = NetworkTrainer._log_step
def first_step(self, run):
    if not hasattr(first_step, "seen"):
        kept = ("tuner", "diffusers.")  # whole names; of the rest, the top-level package
        first_step.seen = sorted({m if m.startswith(kept) else m.split(".")[0] for m in sys.modules})
        print("MODULES " + json.dumps(first_step.seen), flush=True)
    log_step(self, run)
NetworkTrainer._log_step = first_step
from tuner.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_one_process_train_imports_nothing_it_does_not_use(tmp_path, wan_model):
    config = make_project(tmp_path / "project", wan_model)
    # Files written a moment ago are probed again each run (their stamp may not have settled: the memo's
    # racy window); a user's data set is older than that.
    old = time.time() - 60
    for path in (tmp_path / "project").rglob("*"):
        os.utime(path, (old, old))
    assert tuner(["cache", "latents", "--config", str(config)]) == 0
    assert tuner(["cache", "text", "--config", str(config)]) == 0
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "train", "--config", str(config), "--set", "train.max_steps=1",
         "--set", "log.tensorboard=false", "--set", f"save.output_dir='{tmp_path / 'out'}'"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.split("MODULES ", 1)[1].splitlines()[0])
    held = [m for m in seen if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert held == []
    models = [m for m in seen if m.startswith(tuple(f"diffusers.models.{p}" for p in MODEL_PACKAGES))]
    assert sorted(models) == sorted(DIFFUSERS_MODELS)


LAZY = """
import sys, threading, types
from tuner.models.lazy_diffusers import diffusers_class
wan = diffusers_class("WanTransformer3DModel")
vae = diffusers_class("AutoencoderKLWan")
models = [m for m in sys.modules if m.startswith("diffusers.models.") and m.count(".") == 3]
# the two Wan modules and the few they import themselves (the VAE's blocks), of the ~150 the packages hold
assert wan.__module__ in models and vae.__module__ in models and len(models) <= 8, models
assert "diffusers.models.transformers.transformer_flux" not in models
import diffusers.models.autoencoders as autoencoders
import diffusers.models.transformers as transformers
assert type(transformers) is not types.ModuleType  # deferred: its __init__ has not run
found = []
threads = [threading.Thread(target=lambda: found.append(autoencoders.AutoencoderKL)) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
from diffusers import AutoencoderKL
assert found == [AutoencoderKL] * 4 and type(autoencoders) is types.ModuleType
assert "FluxTransformer2DModel" in dir(transformers) and type(transformers) is types.ModuleType
from diffusers.models.transformers import FluxTransformer2DModel, WanTransformer3DModel
from diffusers import WanPipeline
assert WanTransformer3DModel is wan and transformers.FluxTransformer2DModel is FluxTransformer2DModel
loader = transformers.__loader__  # the package's own again, as is its spec's
assert transformers.__spec__.loader is loader and not type(loader).__module__.startswith("tuner")
assert not any(type(f).__module__.startswith("tuner") for f in sys.meta_path)
try:
    transformers.NoSuchModel
except AttributeError as e:
    assert "NoSuchModel" in str(e)
else:
    raise AssertionError("NoSuchModel found")
print("OK")
"""


def test_a_diffusers_model_imports_without_its_package_which_still_works():
    out = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "OK"
