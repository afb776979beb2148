"""Step-time comparisons on one Wan-shaped model: block-swap overlap, fp8 matmul, attention backends.

    swap         s/step with N blocks swapped ÷ s/step with none (base weights as loaded, plain
                 checkpointing): how well the copies hide behind compute; 1.00 is perfect overlap.
    fp8_matmul   s/step with fp8 base weights multiplied in fp8 (`fp8_matmul`) ÷ the same weights
                 dequantized for each matmul; bf16 base weights are shown for reference.
    attention    every attention backend installed and usable on this GPU: s/step of a training step
                 (backends with a backward pass) and s/pass of a forward without gradients (as in
                 generation), each ÷ sdpa's.

The model, inputs, LoRA, placement and timing are `gpu_memory.py`'s (`WanBench`): one warm-up, then the
median of `--steps`, synchronized. Each row is built fresh, so the rows of a comparison differ only in
the one setting compared.

    python benchmarks/gpu_speed.py --model 14B --compare swap --swap 20 40
    python benchmarks/gpu_speed.py --model 1.3B --compare fp8_matmul attention
    python benchmarks/gpu_speed.py --tiny                  # smoke run on the CPU

`--tiny` runs the same code on the CPU (gpu_memory's 8-block toy, `FakeTransfer` for the GPU, CPU
attention backends only). Its ratios are CPU timings of synchronous fake copies: NOT GPU measurements.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from tuner import fp8
from tuner.attention import BACKENDS, available_backends

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also when loaded by path (tests)
from gpu_memory import MODELS, TINY, WanBench, swap_counts  # noqa: E402
from report import TableOut  # noqa: E402

COMPARISONS = ("swap", "fp8_matmul", "attention")


def compare_swap(bench: WanBench, counts: list[int], steps: int, out: TableOut) -> dict[str, float]:
    base = bench.run(swap=0, steps=steps)["seconds_per_step"]
    out.add(["0 (reference)", f"{base:.3f}", "1.000"])
    ratios = {}
    for n in counts:
        seconds = bench.run(swap=n, steps=steps)["seconds_per_step"]
        ratios[f"swap {n} of {bench.layers} blocks ÷ none"] = seconds / base
        out.add([n, f"{seconds:.3f}", f"{seconds / base:.3f}"])
    return ratios


def compare_fp8_matmul(bench: WanBench, steps: int, out: TableOut) -> dict[str, float]:
    bf16 = bench.run(steps=steps)["seconds_per_step"]
    dequantized = bench.run(fp8_base=True, steps=steps)["seconds_per_step"]
    fp8_mm = bench.run(fp8_base=True, fp8_matmul=True, steps=steps)["seconds_per_step"]
    out.add(["base weights as loaded", f"{bf16:.3f}", f"{bf16 / dequantized:.3f}"])
    out.add(["fp8 base, dequantized matmul (reference)", f"{dequantized:.3f}", "1.000"])
    unsupported = "" if fp8.fp8_matmul_supported(bench.device) else " (not supported here: dequantized)"
    out.add([f"fp8 base, fp8 matmul{unsupported}", f"{fp8_mm:.3f}", f"{fp8_mm / dequantized:.3f}"])
    return {"fp8 matmul on ÷ off": fp8_mm / dequantized}


def compare_attention(bench: WanBench, steps: int, out: TableOut) -> dict[str, float]:
    names = available_backends(bench.device)
    measured: dict[str, tuple[float | str, float | str]] = {}
    for name in names:
        train: float | str = "no backward"
        try:
            if BACKENDS[name].backward:
                train = bench.run(attention=name, steps=steps)["seconds_per_step"]
            forward: float | str = bench.run(attention=name, steps=steps, train=False)["seconds_per_step"]
        except Exception as e:  # a backend that fails here is a finding, not the end of the suite
            train = forward = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        measured[name] = (train, forward)
    ref_train, ref_forward = measured["sdpa"]
    ratios = {}
    for name, (train, forward) in measured.items():
        cells = []
        for label, value, ref in (("training step", train, ref_train), ("forward", forward, ref_forward)):
            if isinstance(value, float) and isinstance(ref, float):
                ratios[f"{name} {label} ÷ sdpa"] = value / ref
                cells += [f"{value:.3f}", f"{value / ref:.3f}"]
            else:
                cells += [value, "-"]
        out.add([name, *cells])
    return ratios


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3B")
    parser.add_argument("--compare", nargs="+", choices=COMPARISONS, default=list(COMPARISONS))
    parser.add_argument("--swap", nargs="+", default=["half", "all"], help="blocks to swap: N, half, all")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (median)")
    parser.add_argument("--tiny", action="store_true", help="gpu_memory's toy on the CPU (smoke run)")
    parser.add_argument("--markdown-dir", type=Path, help="keep each table in DIR/<comparison>.md")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --tiny)")

    name = "tiny" if args.tiny else args.model
    bench = WanBench(TINY if args.tiny else WanTransformer3DModel.load_config(MODELS[args.model]), args.tiny)
    where = "CPU smoke run, NOT GPU measurements, fp32" if args.tiny else f"Wan {name}, 480×832×33, bf16"
    steps = f"median of {args.steps} step(s) after one warm-up"
    ratios: dict[str, float] = {}
    for comparison in args.compare:
        path = args.markdown_dir / f"{comparison}.md" if args.markdown_dir else None
        if comparison == "swap":
            out = TableOut(path, f"Block swap overlap ({where}; plain checkpointing; {steps}).",
                           ["blocks_to_swap", "s/step", "÷ no swap"])  # fmt: skip
            ratios |= compare_swap(bench, swap_counts(args.swap, bench.layers), args.steps, out)
        elif comparison == "fp8_matmul":
            out = TableOut(path, f"fp8 matmul ({where}; no swap, plain checkpointing; {steps}).",
                           ["base weights", "s/step", "÷ fp8 dequantized"])  # fmt: skip
            ratios |= compare_fp8_matmul(bench, args.steps, out)
        else:
            out = TableOut(path, f"Attention backends ({where}; no swap, plain checkpointing; {steps}).",
                           ["backend", "training s/step", "÷ sdpa", "forward s/pass", "÷ sdpa"])  # fmt: skip
            ratios |= compare_attention(bench, args.steps, out)
    print()
    for label, value in ratios.items():
        print(f"ratio {value:8.3f}  {label}")
    return ratios


if __name__ == "__main__":
    main()
