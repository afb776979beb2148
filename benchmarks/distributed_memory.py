"""Expected per-process memory of each distributed strategy for the real models: the table in
docs/distributed.md, computed (not measured) from parameter counts.

The counts come from the model classes built from the configs tuner ships (on the meta device: no
memory, no download) and tuner's own default LoRA targets for the architecture, so they are the
weights tuner would train. Bytes per process, with P base parameters and A adapter parameters:

    bf16 base weights 2P; a LoRA: fp32 weights 4A + fp32 gradients 4A + AdamW's two fp32 moments 8A
    a full fine-tune: bf16 weights 2P + bf16 gradients 2P + AdamW's two fp32 moments 8P

    ddp        everything on every process
    fsdp       everything sharded: / N (plus the one block gathered at a time)
    zero2      weights whole; gradients and optimizer state / N (DeepSpeed keeps an fp32 master copy
               of bf16 trained weights with the optimizer state: + 4P / N for a full fine-tune)
    zero3      everything / N (with the fp32 master copy as zero2)
    pipeline   each stage 1 / N of the blocks, with their adapters, gradients and state

Activations, the CUDA context and the allocator's slack come on top.

    python benchmarks/distributed_memory.py              # the markdown table
    python benchmarks/distributed_memory.py --models wan # one model
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parent.parent / "src" / "tuner" / "archs"
# name -> (architecture, diffusers class, shipped config folder)
MODELS = {
    "wan": ("wan", "WanTransformer3DModel", "wan/configs/transformer/t2v-14B", "Wan 2.1 14B"),
    "flux2": ("flux2", "Flux2Transformer2DModel", "flux2/configs/transformer/dev", "FLUX.2 dev (32B)"),
}
RANK = 32
GIB = 2**30


def counts(name: str, rank: int = RANK) -> tuple[int, int]:
    """(base parameters, LoRA parameters at `rank` on tuner's default targets) of model `name`."""
    import diffusers

    from tuner import registry
    from tuner.config.schema import NetworkConfig
    from tuner.networks.factory import build_network

    architecture, cls, folder, _ = MODELS[name]
    config = json.loads((CONFIGS / folder / "config.json").read_text())
    with torch.device("meta"):
        model = getattr(diffusers, cls).from_config(config)
        network = build_network(
            model,
            registry.architecture(architecture).default_targets,
            NetworkConfig(rank=rank, alpha=rank),
            None,
        )
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in network.parameters())


def per_process(strategy: str, base: int, adapter: int, full: bool, n: int) -> float:
    """Bytes one of `n` processes holds (see the module docstring)."""
    weights, frozen = (2 * base, 0) if full else (4 * adapter, 2 * base)
    gradients = 2 * base if full else 4 * adapter
    state = 8 * base if full else 8 * adapter
    master = 4 * base if full else 0  # DeepSpeed's fp32 copy of bf16 trained weights
    if strategy == "ddp":
        return frozen + weights + gradients + state
    if strategy in ("fsdp", "pipeline"):
        return (frozen + weights + gradients + state) / n
    if strategy == "zero2":
        return frozen + weights + (gradients + state + master) / n
    if strategy == "zero3":
        return (frozen + weights + gradients + state + master) / n
    raise ValueError(strategy)


def table(models: list[str], processes=(2, 4, 8)) -> str:
    strategies = ("ddp", "fsdp", "zero2", "zero3", "pipeline")
    head = "| model | trained | strategy | " + " | ".join(f"{n} GPUs" for n in processes) + " |"
    rows = [head, "|" + "---|" * (3 + len(processes))]
    for name in models:
        base, adapter = counts(name)
        title = MODELS[name][3]
        for full in (False, True):
            what = "full fine-tune" if full else f"LoRA rank {RANK}"
            for strategy in strategies:
                cells = [f"{per_process(strategy, base, adapter, full, n) / GIB:.1f}" for n in processes]
                rows.append(f"| {title} | {what} | {strategy} | " + " | ".join(cells) + " |")
        rows.append(f"<!-- {title}: P = {base:,} base parameters, A = {adapter:,} LoRA parameters -->")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args(argv)
    print(table(args.models))


if __name__ == "__main__":
    main()
