"""Peak VRAM and seconds per LoRA training step of Wan-shaped transformers under tuner's memory settings.

Random weights with the real shapes of Wan 2.1 1.3B and 14B (the configs shipped in
`tuner/models/configs/wan/transformer/`), one 480×832 video of 33 frames (latents 16×9×60×104, 14,040
tokens), 512 text tokens, LoRA rank 32 on the default Wan targets, AdamW, bf16 base and autocast. Every
combination of

    blocks_to_swap   0, half the blocks, all of them
    fp8_base         off, on
    checkpointing    plain (diffusers' gradient checkpointing), offload (activation_offload)

is built fresh, run for one warm-up step and `--steps` timed steps, and printed as one table row: peak
allocated memory (torch.cuda.max_memory_allocated, from the start of the warm-up step) and the median
seconds per step. A configuration that does not fit prints OOM.

    python benchmarks/gpu_memory.py                    # both models (needs a CUDA GPU)
    python benchmarks/gpu_memory.py --models 1.3B      # one of them
    python benchmarks/gpu_memory.py --tiny             # a 4-block toy on the CPU through the fake device

The tiny mode runs the same code path on the CPU with `FakeTransfer` standing in for the GPU; its "peak"
is the fake device's peak of weight bytes (the CPU has no allocator statistics). The test suite runs it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel

from tuner.memory import MemorySettings, apply_memory_settings
from tuner.networks import LoRANetwork, TargetSpec
from tuner.offload import FakeTransfer
from tuner.registry import ARCHITECTURES  # noqa: E402

WAN_TARGETS = ARCHITECTURES["wan"].default_targets

CONFIGS = (
    Path(__file__).resolve().parent.parent / "src" / "tuner" / "models" / "configs" / "wan" / "transformer"
)
MODELS = {"1.3B": CONFIGS / "t2v-1.3B", "14B": CONFIGS / "t2v-14B"}
TINY = {
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 32, "in_channels": 16,
    "out_channels": 16, "text_dim": 64, "freq_dim": 64, "ffn_dim": 128, "num_layers": 4, "rope_max_seq_len": 32,
}  # fmt: skip


def build(config: dict, device: torch.device, dtype: torch.dtype) -> WanTransformer3DModel:
    """The model with random weights (N(0, 0.02), norms 1), built straight on `device`."""
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(config)
    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name and p.ndim == 1:
                p.fill_(1.0)
            elif p.is_floating_point():
                p.normal_(0.0, 0.02, generator=generator)
    keep = set(model._keep_in_fp32_modules or [])
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if keep.intersection(name.split(".")) else dtype)
    # Buffers like the rotary tables are computed in __init__; meta init left them empty: recompute.
    with torch.device(device):
        model.rope = type(model.rope)(
            model.rope.attention_head_dim, model.rope.patch_size, model.rope.max_seq_len
        )
    return model.eval().requires_grad_(False)


def inputs(tiny: bool, device: torch.device, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
    g = torch.Generator(device).manual_seed(1)
    latents = (1, 16, 2, 8, 8) if tiny else (1, 16, 9, 60, 104)  # 480×832×33 through the 8×/4× VAE
    text = (1, 8, 64) if tiny else (1, 512, 4096)
    kwargs = {
        "hidden_states": torch.randn(latents, generator=g, device=device, dtype=dtype),
        "timestep": torch.tensor([500.0], device=device),
        "encoder_hidden_states": torch.randn(text, generator=g, device=device, dtype=dtype),
        "return_dict": False,
    }
    return kwargs, torch.randn(latents, generator=g, device=device, dtype=dtype)


def run_one(config: dict, swap: int, fp8: bool, checkpointing: str, steps: int, tiny: bool) -> dict:
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    model = build(config, device, dtype)
    if checkpointing == "plain":
        model.enable_gradient_checkpointing()
    model.train()  # diffusers checkpoints only in train mode; Wan has no dropout
    settings = MemorySettings(
        blocks_to_swap=swap, fp8_base=fp8, activation_offload=checkpointing == "offload"
    )
    transfer = FakeTransfer(lazy=False) if tiny else None
    if not tiny:
        torch.cuda.empty_cache()
    apply_memory_settings(model, settings, device, transfer=transfer)
    if not tiny:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    lora = LoRANetwork.apply_to(model, TargetSpec(WAN_TARGETS), rank=32).to(device)
    optimizer = torch.optim.AdamW(lora.parameters(), lr=1e-4)
    kwargs, target = inputs(tiny, device, dtype)

    def step() -> float:
        start = time.perf_counter()
        with torch.autocast(device.type, dtype, enabled=not tiny):
            loss = F.mse_loss(model(**kwargs)[0].float(), target.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not tiny:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # warm-up: kernels, allocator, optimizer state
    seconds = statistics.median(step() for _ in range(steps))
    peak = transfer.peak_bytes() if tiny else torch.cuda.max_memory_allocated()
    return {"seconds_per_step": seconds, "peak_bytes": peak}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["1.3B", "14B"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (median)")
    parser.add_argument("--tiny", action="store_true", help="a 4-block toy on the CPU (smoke run)")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --tiny)")

    models = (
        {"tiny": TINY}
        if args.tiny
        else {m: WanTransformer3DModel.load_config(MODELS[m]) for m in args.models}
    )
    rows = []
    unit, unit_bytes = ("MiB", 2**20) if args.tiny else ("GiB", 2**30)
    print(
        f"{'model':>6} {'blocks_to_swap':>14} {'fp8':>4} {'checkpointing':>13} {'peak ' + unit:>9} {'s/step':>7}"
    )
    for name, config in models.items():
        n = config["num_layers"]
        for swap in (0, n // 2, n):
            for fp8 in (False, True):
                for checkpointing in ("plain", "offload"):
                    try:
                        row = run_one(config, swap, fp8, checkpointing, args.steps, args.tiny)
                        shown = f"{row['peak_bytes'] / unit_bytes:9.2f} {row['seconds_per_step']:7.2f}"
                    except torch.cuda.OutOfMemoryError:
                        row, shown = (
                            {"seconds_per_step": float("nan"), "peak_bytes": -1},
                            f"{'OOM':>9} {'-':>7}",
                        )
                    row |= {"model": name, "blocks_to_swap": swap, "fp8": fp8, "checkpointing": checkpointing}
                    rows.append(row)
                    print(
                        f"{name:>6} {swap:>14} {'on' if fp8 else 'off':>4} {checkpointing:>13} {shown}",
                        flush=True,
                    )
                    if not args.tiny:
                        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
