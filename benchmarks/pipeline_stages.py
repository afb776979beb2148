"""What each pipeline stage holds for the real model sizes (`distributed.strategy = "pipeline"`).

Builds the shipped transformer config of each model on the meta device (no memory, no weights), cuts
its blocks into 2, 4 and 8 stages exactly as training does (`cut_stages`: balanced by parameter count;
the embeddings before the blocks on the first stage, the output layers after them on every stage), puts
the default-target LoRA on it, and prints per stage count the largest stage's bytes: frozen weights in
bf16 and in fp8 (the linear layers of the blocks in fp8, the rest in bf16, as `memory.fp8_base` stores
them), the stage's LoRA weights + gradients + AdamW state (fp32: 4 + 4 + 8 bytes per weight), and the
fp32 copy of the whole LoRA every process keeps for the saves. Activations come on top and depend on the resolution, frames,
micro-batches and checkpointing.

    python benchmarks/pipeline_stages.py                # Wan 2.1 14B and FLUX.1 dev, rank 32
    python benchmarks/pipeline_stages.py --rank 16
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from tuner.archs.stages import cut_stages
from tuner.registry import ARCHITECTURES

MODELS = (("wan", "t2v-14B", "Wan 2.1 T2V 14B"), ("flux", "dev", "FLUX.1 dev"))


def meta_model(architecture: str, variant: str) -> nn.Module:
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    cls = {"wan": WanTransformer3DModel, "flux": FluxTransformer2DModel}[architecture]
    with torch.device("meta"):
        return cls.from_config(
            cls.load_config(ARCHITECTURES[architecture].variant_dir / "transformer" / variant)
        )


def stage_bytes(architecture: str, variant: str, rank: int, stages: int) -> dict[str, float]:
    """The largest stage's frozen bytes (bf16, fp8) and LoRA training bytes, in GiB."""
    from tuner.networks.lora import LoRANetwork
    from tuner.networks.targets import TargetSpec

    record = ARCHITECTURES[architecture]
    model = meta_model(architecture, variant)
    family = record.family_class()
    parts = family.__new__(family).pipeline_parts(model)  # only pipeline_parts is called
    blocks = parts.blocks
    network = LoRANetwork.apply_to(
        model, TargetSpec(record.default_targets), rank, rank, name_map=record.key_table()
    )
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    prologue = sum(p.numel() for m in parts.prologue_modules for p in m.parameters())
    shared = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks) - prologue  # every stage
    runs = cut_stages(parts, stages)
    names = {id(m): n for n, m in model.named_modules()}
    worst = {
        "bf16": 0.0,
        "fp8": 0.0,
        "lora": 0.0,
        "copies": sum(p.numel() for p in network.parameters()) * 4 / 2**30,
    }
    for stage, run in enumerate(runs):
        held = [blocks[i] for i in run]
        linear = sum(m.weight.numel() for b in held for m in b.modules() if isinstance(m, nn.Linear))
        total = sum(p.numel() for b in held for p in b.parameters())
        prefixes = tuple(names[id(b)] + "." for b in held)
        lora = sum(p.numel() for a in network if a.name.startswith(prefixes) for p in a.parameters())
        outside = (shared + prologue * (stage == 0)) * 2  # bf16
        figures = {"bf16": outside + total * 2, "fp8": outside + total * 2 - linear, "lora": lora * 16}
        worst.update({k: max(worst[k], v / 2**30) for k, v in figures.items()})
    return worst


def main(argv: list[str] | None = None) -> dict[tuple[str, int], dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args(argv)
    table = {}
    print(f"largest stage, GiB (LoRA rank {args.rank}: weights + gradients + AdamW state in fp32)")
    print(
        f"{'model':18} {'stages':>6} {'frozen bf16':>12} {'frozen fp8':>11} {'LoRA training':>14} {'LoRA copy':>10}"
    )
    for architecture, variant, label in MODELS:
        for stages in (1, 2, 4, 8):
            w = table[label, stages] = stage_bytes(architecture, variant, args.rank, stages)
            print(
                f"{label:18} {stages:>6} {w['bf16']:>12.2f} {w['fp8']:>11.2f} {w['lora']:>14.3f} {w['copies']:>10.3f}"
            )
    return table


if __name__ == "__main__":
    main()
