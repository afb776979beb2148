"""What a command imports before it needs a model: no diffusers or transformers model code, no
bitsandbytes and no torch._dynamo (together about 4.5 s on a busy 2-core machine; see
`benchmarks/startup.py`). Each check runs in a fresh interpreter, since this test process has long
imported everything."""

from __future__ import annotations

import json
import subprocess
import sys

from project import make_project
from tuner.cli import main
from tuner.registry import ARCHITECTURES

HEAVY = ("bitsandbytes", "torch._dynamo", "diffusers", "transformers", "peft")

# what `tuner cache ...`, `tuner train` (until the model loads) and `tuner generate` import
PATHS = (
    "tuner.cli",
    "tuner.config",
    "tuner.cache.commands",
    "tuner.cache.plan",
    "tuner.cache.batches",
    "tuner.memory",
    "tuner.compile",
    "tuner.networks.factory",
    "tuner.optimizers.build",
    "tuner.trainers.checkpoints",
    "tuner.trainers.samples",
    "tuner.generate",
    "accelerate",
)


def _heavy_after(code: str) -> list[str]:
    probe = f"{code}\nimport sys, json; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_command_paths_and_every_trainer_import_no_heavy_module():
    trainers = [record.family_class().__module__ for record in ARCHITECTURES.values()]
    code = "\n".join(f"import {m}" for m in (*PATHS, *trainers))
    assert _heavy_after(code) == []


def test_a_cache_run_with_nothing_to_do_imports_no_heavy_module(tmp_path, wan_model):
    config = make_project(tmp_path / "project", wan_model)
    assert main(["cache", "latents", "--config", str(config)]) == 0
    assert main(["cache", "text", "--config", str(config)]) == 0
    code = (
        "from tuner.cli import main\n"
        f"assert main(['cache', 'latents', '--config', {str(config)!r}]) == 0\n"
        f"assert main(['cache', 'text', '--config', {str(config)!r}]) == 0"
    )
    assert _heavy_after(code) == []


def test_caching_and_generation_import_no_trainer():
    """Caching, generation and the distributed accounting read the record and the family's
    `ArchitectureModel`; the training loop (`tuner.trainers`) is not theirs to import."""
    probe = (
        "import sys, json, tuner.cache.commands, tuner.cache.plan, tuner.generate, tuner.archs.stages, "
        "tuner.distributed.accounting, tuner.archs.model\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('tuner.trainers'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []
