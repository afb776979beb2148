"""Peak VRAM and seconds per LoRA training step of Wan-shaped transformers under tuner's memory settings.

Random weights with the real shapes of Wan 2.1 1.3B and 14B (the configs shipped in
`tuner/archs/wan/configs/transformer/`), one 480×832 video of 33 frames (latents 16×9×60×104, 14,040
tokens), 512 text tokens, LoRA rank 32 on the default Wan targets, AdamW, bf16 base and autocast. One
row per combination of

    blocks_to_swap   --swap            0, half the blocks, all of them (or numbers)
    fp8_base         --fp8             off, on
    checkpointing    --checkpointing   none, plain (diffusers' gradient checkpointing),
                                       offload (activation_offload)

Every row is built the way training builds a model, so it runs on the card its peak says it needs: the
model is created on the meta device and given host (CPU) tensors, and `apply_memory_settings` places it
(everything on the GPU, or the swapped blocks' weights in pinned host memory); the model is never put
on the GPU whole first. The peak (torch.cuda.max_memory_allocated) runs from before that placement to
the end of the timed steps, so it includes the placement peak (weights arriving), which is also shown on
its own. Steps: one warm-up, then the median of `--steps`.

Host weights are made once per model and shared by its rows (placement copies them; nothing writes to
them). With fp8, the block Linear weights are quantized once per model by `tuner.fp8.quantize_linears`,
the call `apply_memory_settings` makes, one block at a time on the GPU; every fp8 row starts from those
fp8 tensors on the host, which `apply_memory_settings` then places as it would its own. (Quantizing 14B
weights on the CPU for every row would take most of the suite's time; the result is the same.)

After the table, every pair of rows that differ in one switch is checked: the row with more saving on
(fp8 on, more blocks swapped, checkpointing none → plain → offload) must have the lower peak (a row that
does not fit counts as infinite). The script exits with status 1 when one does not.

    python benchmarks/gpu_memory.py                          # both models (needs a CUDA GPU)
    python benchmarks/gpu_memory.py --models 1.3B --checkpointing none plain offload
    python benchmarks/gpu_memory.py --models 14B --rows 0/off/plain 0/on/plain all/on/offload
    python benchmarks/gpu_memory.py --tiny                   # smoke run on the CPU

`--tiny` runs the same code on the CPU: an 8-block toy in fp32, with `FakeTransfer` standing in for the
GPU. It measures no GPU memory: its "peak" is the fake device's peak of weight bytes (activations are
not counted, so only fp8 and block swap are checked) and its seconds are CPU seconds. The tests run it.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from torch import nn

from tuner import fp8
from tuner.memory import MemorySettings, apply_memory_settings, block_lists_of
from tuner.networks import LoRANetwork, TargetSpec
from tuner.offload import FakeTransfer
from tuner.registry import ARCHITECTURES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also when loaded by path (tests)
from report import TableOut  # noqa: E402

CONFIGS = (
    Path(__file__).resolve().parent.parent / "src" / "tuner" / "archs" / "wan" / "configs" / "transformer"
)
MODELS = {"1.3B": CONFIGS / "t2v-1.3B", "14B": CONFIGS / "t2v-14B"}
TINY = {
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 32, "in_channels": 16,
    "out_channels": 16, "text_dim": 64, "freq_dim": 64, "ffn_dim": 128, "num_layers": 8, "rope_max_seq_len": 32,
}  # fmt: skip
CHECKPOINTING = ("none", "plain", "offload")  # in order of memory saved
CARDS_GIB = (8, 12, 16, 24, 32, 48, 80, 96, 141)
CONTEXT_GIB = 1.0  # the CUDA context and allocator slack, which torch's statistics do not count
OOM = float("inf")


# --- the model -------------------------------------------------------------------------------------


def meta_model(config: dict, dtype: torch.dtype) -> WanTransformer3DModel:
    """The model on the meta device (no memory), in `dtype` except its `_keep_in_fp32_modules`."""
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(config)
    keep = set(model._keep_in_fp32_modules or [])
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if keep.intersection(name.split(".")) else dtype)
    return model


def host_weights(config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model on the host, with ordinary values: N(0, 0.02) (norm
    weights 1) cut from one pool of random numbers at varying offsets. Drawing 14B numbers one by one
    takes minutes on a CPU; memory and speed do not care whether the values are independent."""
    model = meta_model(config, dtype)
    model.to_empty(device="cpu")
    pool = torch.empty(1 << 24).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if "norm" in name and p.ndim == 1:
                p.fill_(1.0)
            else:
                _fill(p.view(-1), pool, offset=i * 7919)
        # Buffers computed in __init__ (the rotary tables) were left empty by the meta device.
        model.rope = type(model.rope)(
            model.rope.attention_head_dim, model.rope.patch_size, model.rope.max_seq_len
        )
    return {name: t.detach() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def _fill(flat: torch.Tensor, pool: torch.Tensor, offset: int) -> None:
    done = 0
    while done < flat.numel():
        start = (offset + done) % pool.numel()
        n = min(flat.numel() - done, pool.numel() - start)
        flat[done : done + n].copy_(pool[start : start + n])
        done += n


def fresh_model(config: dict, host: dict[str, torch.Tensor], dtype: torch.dtype) -> WanTransformer3DModel:
    """A new frozen model whose tensors are the host tensors themselves (no copy)."""
    model = meta_model(config, dtype)
    for name, tensor in host.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        is_param = isinstance(getattr(module, attr), nn.Parameter)
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False) if is_param else tensor)
    return model.requires_grad_(False)


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


# --- one row ---------------------------------------------------------------------------------------


class WanBench:
    """One Wan-shaped model on the GPU (or, tiny, on the CPU's fake device): host weights made once,
    a fresh model for every row."""

    def __init__(self, config: dict, tiny: bool):
        self.config, self.tiny = config, tiny
        self.device = torch.device("cpu" if tiny else "cuda")
        self.dtype = torch.float32 if tiny else torch.bfloat16
        self.host = host_weights(config, self.dtype)
        self.layers = config["num_layers"]
        self._fp8: dict[bool, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    def fp8_weights(self, matmul: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{layer: (fp8 weight, scales)} on the host, as `apply_memory_settings(fp8_base=True)` stores
        them, quantized once, block by block on the device (see the module docstring)."""
        if matmul not in self._fp8:
            model = fresh_model(self.config, self.host, self.dtype)
            for list_name in block_lists_of(model):
                for i, block in enumerate(getattr(model, list_name)):
                    block.to(self.device)
                    fp8.quantize_linears(model, prefixes=[f"{list_name}.{i}"], fp8_matmul=matmul)
                    block.to("cpu")
            layers = {name: model.get_submodule(name) for name in fp8.fp8_linear_names(model)}
            self._fp8[matmul] = {
                name: (layer.weight.detach(), getattr(layer, fp8.SCALE_KEY)) for name, layer in layers.items()
            }
        return self._fp8[matmul]

    def run(
        self,
        *,
        swap: int = 0,
        fp8_base: bool = False,
        checkpointing: str = "plain",
        fp8_matmul: bool = False,
        attention: str = "sdpa",
        steps: int = 3,
        train: bool = True,
    ) -> dict:
        """Build, place and time one configuration: a warm-up step, then the median of `steps`
        (training steps, or with `train=False` forward passes without gradients, as in generation).
        Returns the peaks in bytes and the seconds per step."""
        cuda = not self.tiny
        if cuda:  # what earlier rows left (reference cycles through patched forwards) goes first
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model = fresh_model(self.config, self.host, self.dtype)
        matmul = fp8_matmul and fp8.fp8_matmul_supported(self.device)  # as apply_memory_settings decides
        if fp8_base:
            for name, (w8, scale) in self.fp8_weights(matmul).items():
                fp8.store_linear_fp8(model.get_submodule(name), w8, scale, fp8_matmul=matmul, name=name)
        if checkpointing == "plain":
            model.enable_gradient_checkpointing()
        model.train()  # diffusers checkpoints only in train mode; Wan has no dropout
        settings = MemorySettings(
            blocks_to_swap=swap, fp8_base=fp8_base, fp8_matmul=fp8_matmul,
            activation_offload=checkpointing == "offload", attention=attention,
        )  # fmt: skip
        transfer = FakeTransfer(lazy=False) if self.tiny else None

        def peaks() -> tuple[int, int]:
            if cuda:
                return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            return transfer.peak_bytes(), 0

        apply_memory_settings(model, settings, self.device, transfer=transfer)
        lora = LoRANetwork.apply_to(model, TargetSpec(ARCHITECTURES["wan"].default_targets), rank=32).to(
            self.device
        )
        optimizer = torch.optim.AdamW(lora.parameters(), lr=1e-4)
        kwargs, target = inputs(self.tiny, self.device, self.dtype)
        placement = peaks()  # block swap resets the statistics at the first forward: read them now

        def step() -> float:
            start = time.perf_counter()
            with torch.autocast(self.device.type, self.dtype, enabled=cuda), torch.set_grad_enabled(train):
                out = model(**kwargs)[0]
                if train:
                    F.mse_loss(out.float(), target.float()).backward()
            if train:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - start

        step()  # warm-up: kernels, allocator, optimizer state
        seconds = statistics.median(step() for _ in range(steps))
        after = peaks()
        return {
            "placement_bytes": placement[0],
            "peak_bytes": max(placement[0], after[0]),
            "reserved_bytes": max(placement[1], after[1]),
            "seconds_per_step": seconds,
        }


def card_for(reserved_bytes: int) -> str:
    """The smallest common card size that holds this peak plus the CUDA context."""
    need = reserved_bytes / 2**30 + CONTEXT_GIB
    return next((f"{c} GB" for c in CARDS_GIB if need <= c), "none")


# --- the check -------------------------------------------------------------------------------------


def check_savings(rows: list[dict], switches: tuple[str, ...]) -> tuple[int, list[str]]:
    """For every pair of rows of one model that differ only in one of `switches`, the row saving more
    must peak lower. Returns (pairs checked, failures)."""
    saving = {
        "blocks_to_swap": lambda r: r["blocks_to_swap"],
        "fp8": lambda r: r["fp8"],
        "checkpointing": lambda r: CHECKPOINTING.index(r["checkpointing"]),
    }
    checked, failures = 0, []
    for a, b in itertools.combinations(rows, 2):
        differ = [k for k in saving if a[k] != b[k]]
        if a["model"] != b["model"] or len(differ) != 1 or differ[0] not in switches:
            continue
        less, more = sorted((a, b), key=saving[differ[0]])
        if less["peak_bytes"] == OOM and more["peak_bytes"] == OOM:
            continue
        checked += 1
        if not more["peak_bytes"] < less["peak_bytes"]:
            switch = f"{differ[0]} {less[differ[0]]} → {more[differ[0]]}"
            failures.append(f"{switch} did not lower the peak: {_describe(less)} vs {_describe(more)}")
    return checked, failures


def _describe(row: dict) -> str:
    peak = "OOM" if row["peak_bytes"] == OOM else f"{row['peak_bytes'] / 2**30:.3f} GiB"
    return f"({row['model']}, swap {row['blocks_to_swap']}, fp8 {row['fp8']}, {row['checkpointing']}) {peak}"


# --- the table -------------------------------------------------------------------------------------


def swap_counts(tokens: list[str], layers: int) -> list[int]:
    """ "half", "all" or numbers → block counts for a model with `layers` blocks (no repeats)."""
    named = {"half": layers // 2, "all": layers}
    return list(dict.fromkeys(named[t] if t in named else int(t) for t in tokens))


def plan(args: argparse.Namespace, layers: int) -> list[tuple[int, str, str]]:
    """The rows to measure: (blocks_to_swap, fp8, checkpointing), from --rows or the product."""
    if args.rows:
        rows = [tuple(r.split("/")) for r in args.rows]
        for row in rows:
            if len(row) != 3 or row[1] not in ("off", "on") or row[2] not in CHECKPOINTING:
                raise SystemExit(
                    f"--rows: {'/'.join(row)} is not SWAP/FP8/CHECKPOINTING, e.g. all/on/offload"
                )
        return [(swap_counts([swap], layers)[0], fp8_on, ckpt) for swap, fp8_on, ckpt in rows]
    return list(itertools.product(swap_counts(args.swap, layers), args.fp8, args.checkpointing))


def measure(
    bench: WanBench, swap: int, fp8_on: str, checkpointing: str, steps: int
) -> tuple[dict, list[str]]:
    """One row's numbers (bytes, seconds) and its table cells; a row that does not fit is OOM."""
    unit = 2**20 if bench.tiny else 2**30
    try:
        row = bench.run(swap=swap, fp8_base=fp8_on == "on", checkpointing=checkpointing, steps=steps)
    except torch.cuda.OutOfMemoryError:
        row = {"placement_bytes": OOM, "peak_bytes": OOM, "reserved_bytes": OOM, "seconds_per_step": math.nan}
        return row, ["OOM", "OOM", "-", "-", "-"]
    cells = [f"{row['placement_bytes'] / unit:.2f}", f"{row['peak_bytes'] / unit:.2f}"]
    if bench.tiny:
        cells += ["-", "-"]
    else:
        cells += [f"{row['reserved_bytes'] / unit:.2f}", card_for(row["reserved_bytes"])]
    return row, [*cells, f"{row['seconds_per_step']:.3f}"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["1.3B", "14B"])
    parser.add_argument(
        "--swap", nargs="+", default=["0", "half", "all"], help="blocks to swap: N, half, all"
    )
    parser.add_argument("--fp8", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--checkpointing", nargs="+", choices=CHECKPOINTING, default=["plain", "offload"])
    parser.add_argument(
        "--rows", nargs="+", metavar="SWAP/FP8/CKPT", help="these rows instead (e.g. all/on/offload)"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (median)")
    parser.add_argument("--tiny", action="store_true", help="an 8-block toy on the CPU (smoke run)")
    parser.add_argument(
        "--markdown", type=Path, help="keep the table in this file (rewritten after each row)"
    )
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --tiny)")

    if args.tiny:
        models = {"tiny": TINY}
    else:
        models = {m: WanTransformer3DModel.load_config(MODELS[m]) for m in args.models}
    unit = "MiB" if args.tiny else "GiB"
    if args.tiny:
        title = (
            "Smoke run on the CPU: NOT GPU measurements. Peak = weight bytes on the fake device (activations "
            "not counted); s/step = CPU seconds."
        )
    else:
        title = (
            "Peak allocated VRAM (placement included), peak reserved VRAM and seconds per training step, "
            f"{args.steps} timed step(s) after one warm-up. A card needs the reserved peak plus about "
            f"{CONTEXT_GIB:.0f} GiB for the CUDA context."
        )
    out = TableOut(args.markdown, title, [
        "model", "blocks_to_swap", "fp8", "checkpointing", f"placement peak {unit}", f"peak {unit}",
        f"reserved {unit}", "needs a card of", "s/step",
    ])  # fmt: skip
    rows = []
    for name, config in models.items():
        bench = WanBench(config, args.tiny)
        for swap, fp8_on, checkpointing in plan(args, config["num_layers"]):
            row, cells = measure(bench, swap, fp8_on, checkpointing, args.steps)
            rows.append(
                dict(model=name, blocks_to_swap=swap, fp8=fp8_on == "on", checkpointing=checkpointing, **row)
            )
            out.add([name, swap, fp8_on, checkpointing, *cells])
        del bench
        gc.collect()

    switches = ("blocks_to_swap", "fp8") if args.tiny else ("blocks_to_swap", "fp8", "checkpointing")
    checked, failures = check_savings(rows, switches)
    unchecked = " Checkpointing is not checked in the smoke run (activations are not counted)."
    out.note(
        f"Check: each memory switch lowers the peak: {checked - len(failures)} of {checked} pairs of rows that "
        f"differ in one switch ({', '.join(switches)}) agree." + (unchecked if args.tiny else "")
    )
    for failure in failures:
        out.note(f"FAILED: {failure}")
    if failures:
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
