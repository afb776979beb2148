"""`tuner lora info|convert|merge|extract|ema`: tools for adapter (and model) files, without training.

Each command is one library function in this package (`info.py`, `convert.py`, `merge.py`,
`extract.py`, `ema.py`); this module only declares their arguments. `add_lora_commands(subparsers)`
registers them under the `tuner` command; imports happen when a command runs, so `tuner --help` stays fast.
"""

from __future__ import annotations

import argparse

from tuner.errors import ConfigError
from tuner.registry import SAVE_FORMATS

_AUTO_HELP = "key layout; auto: the one training writes by default for the architecture (ComfyUI loads it; see `tuner lora info`)"
DTYPE_CHOICES = ("fp32", "bf16", "fp16")


def add_lora_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `lora` and its subcommands to the `tuner` command's subparsers."""
    lora = subparsers.add_parser("lora", help="inspect, convert, merge, extract and average adapter files")
    sub = lora.add_subparsers(dest="lora_command", required=True, metavar="WHAT")

    p = sub.add_parser("info", help="format, type, rank, alpha, targets and metadata of an adapter file")
    p.add_argument("file")
    p.set_defaults(func=_info)

    p = sub.add_parser("convert", help="rewrite an adapter file in another key layout")
    p.add_argument("src", metavar="IN")
    p.add_argument("dst", metavar="OUT")
    p.add_argument("--to", required=True, choices=SAVE_FORMATS, help=_AUTO_HELP)
    _arch_arg(p)
    p.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default=None, help="tensor precision (default: the input's)"
    )
    p.set_defaults(func=_convert)

    p = sub.add_parser("merge", help="merge adapters into a model single file (original layout)")
    p.add_argument(
        "--model", required=True, help="model single file (.safetensors; ComfyUI prefixes and fp8 ok)"
    )
    p.add_argument(
        "--lora", action="append", required=True, default=[], metavar="FILE[:STRENGTH]",
        help="adapter to merge, with an optional strength (repeatable; applied in order)",
    )  # fmt: skip
    p.add_argument("--out", required=True)
    p.add_argument(
        "--fp8", action="store_true", help="store weight matrices as scaled fp8 (ComfyUI's fp8_scaled)"
    )
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="recast the model's floating tensors")
    _arch_arg(p)
    p.set_defaults(func=_merge)

    p = sub.add_parser("extract", help="a LoRA from the difference of two checkpoints (SVD)")
    p.add_argument("--base", required=True, help="the original model single file")
    p.add_argument("--tuned", required=True, help="the fine-tuned (or merged) model single file")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=SAVE_FORMATS, default="comfy", help=_AUTO_HELP)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="fp32")
    p.add_argument("--device", default="cpu", help="where the SVDs run, e.g. cuda")
    p.add_argument(
        "--threshold", type=float, default=0.0, help="skip weights that change by at most this much"
    )
    _arch_arg(p)
    p.set_defaults(func=_extract)

    p = sub.add_parser("ema", help="exponential moving average of saved checkpoints of one run")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--out", required=True)
    p.add_argument("--beta", type=float, default=0.9, help="decay per checkpoint (0.9: about the last 10)")
    p.add_argument(
        "--order", choices=("steps", "given"), default="steps",
        help="steps: sort by the files' tuner.steps metadata; given: as listed",
    )  # fmt: skip
    p.set_defaults(func=_ema)


def _arch_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--arch", default=None, help="architecture of the files (default: from metadata or key names)"
    )


# --- handlers: thin wrappers around the library functions ----------------------------------------


def _info(args: argparse.Namespace) -> None:
    from tuner.tools.info import describe_adapter, format_info

    print(format_info(describe_adapter(args.file)))


def _convert(args: argparse.Namespace) -> None:
    from tuner.tools.convert import convert_adapter, convert_warning

    count, layout = convert_adapter(args.src, args.dst, args.to, arch=args.arch, dtype=args.dtype)
    print(f"wrote {args.dst}: {count} modules in the {layout} layout")
    if warning := convert_warning(args.dst, layout):
        print(warning)


def _merge(args: argparse.Namespace) -> None:
    from tuner.tools.merge import merge_adapters

    adapters = [parse_weighted_path(text) for text in args.lora]
    changed = merge_adapters(args.model, adapters, args.out, fp8=args.fp8, dtype=args.dtype, arch=args.arch)
    for (path, strength), count in zip(adapters, changed.values()):
        print(f"merged {path} × {strength}: {count} weights")
    print(f"wrote {args.out}")


def _extract(args: argparse.Namespace) -> None:
    from tuner.tools.extract import extract_lora

    counts = extract_lora(
        args.base, args.tuned, args.rank, args.out, format=args.format, arch=args.arch, dtype=args.dtype,
        device=args.device, threshold=args.threshold,
    )  # fmt: skip
    print(f"wrote {args.out}: rank {args.rank} LoRA of {counts['modules']} weight matrices")
    if counts["other_changed_tensors"]:
        print(
            f"note: {counts['other_changed_tensors']} changed tensors that are not weight matrices are not in it"
        )


def _ema(args: argparse.Namespace) -> None:
    from tuner.tools.ema import ema_checkpoints

    used = ema_checkpoints(args.files, args.out, beta=args.beta, order=args.order)
    print(
        f"wrote {args.out}: EMA (beta {args.beta}) of {len(used)} checkpoints, oldest first: {', '.join(used)}"
    )


def parse_weighted_path(text: str) -> tuple[str, float]:
    """`path.safetensors[:strength]` -> (path, strength); a colon that is part of the path (C:\\...) is kept."""
    path, sep, strength = text.rpartition(":")
    if sep and path and not strength.startswith(("\\", "/")):
        try:
            return path, float(strength)
        except ValueError:
            raise ConfigError(f"--lora {text!r}: the strength after ':' must be a number") from None
    return text, 1.0
