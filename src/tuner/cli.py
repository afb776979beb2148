"""The `tuner` command: one tool, many subcommands.

Each subcommand parses its arguments and calls one function in the library; no logic lives here.
Errors the user can fix (`TunerError`) print as one message without a traceback and exit with 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from tuner.errors import TunerError


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="training TOML (see docs/config.md)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config key, e.g. --set train.learning_rate=1e-4 (repeatable)",
    )


def _load(args):
    from tuner.config import load_config

    return load_config(args.config, args.overrides)


# --- handlers: thin wrappers around library functions ----------------------------------------------


def _fixtures(args) -> None:
    from tuner.fixtures import write_fixture

    paths = write_fixture(args.architecture, args.dir, seed=args.seed)
    for name, path in paths.items():
        print(f"{name}: {path}")


def _cache_latents(args) -> None:
    from tuner.cache.commands import cache_latents

    cache_latents(_load(args), device=args.device, prune=args.prune, batch_size=args.batch_size)


def _cache_text(args) -> None:
    from tuner.cache.commands import cache_text

    cache_text(
        _load(args), device=args.device, prune=args.prune, batch_size=args.batch_size, dtype=args.dtype
    )


def _cache_info(args) -> None:
    from tuner.cache.store import CacheStore, format_info

    print(format_info(CacheStore(args.dir, readonly=True).info()))


def _timesteps(args) -> None:
    from tuner.timesteps import plot_histogram, sampler_from_config

    cfg = _load(args)
    plot_histogram(sampler_from_config(cfg.timesteps), args.out, seq_len=args.seq_len)
    print(f"wrote {args.out}")


def _config_check(args) -> None:
    cfg = _load(args)
    print(f"{cfg.path}: ok ({len(cfg.datasets)} dataset(s), architecture {cfg.model.architecture})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tuner", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("fixtures", help="write a tiny random-weight model in the real checkpoint layouts")
    p.add_argument("architecture", help="architecture name, e.g. wan")
    p.add_argument("dir", help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_fixtures)

    cache = sub.add_parser("cache", help="encode latents and text once, before training")
    csub = cache.add_subparsers(dest="cache_command", required=True, metavar="WHAT")
    for name, func, what in (
        ("latents", _cache_latents, "VAE latents"),
        ("text", _cache_text, "text-encoder outputs"),
    ):
        p = csub.add_parser(name, help=f"encode {what} of every dataset item that is missing or stale")
        _config_args(p)
        p.add_argument(
            "--device", default=None, help="encoder device (default: cache.device from the config)"
        )
        p.add_argument("--batch-size", type=int, default=None, help="items per encoder call")
        p.add_argument(
            "--prune", action="store_true", help="remove entries no dataset item refers to any more"
        )
        if name == "text":
            p.add_argument(
                "--dtype",
                default=None,
                choices=["fp32", "bf16", "fp16", "fp8"],
                help="text encoder precision (default: cache.text_encoder_dtype)",
            )
        p.set_defaults(func=func)
    p = csub.add_parser("info", help="what a cache store holds")
    p.add_argument("dir", help="cache directory")
    p.set_defaults(func=_cache_info)

    p = sub.add_parser("timesteps", help="draw the configured timestep distribution as a PNG histogram")
    _config_args(p)
    p.add_argument("--out", required=True, help="output PNG")
    p.add_argument("--seq-len", type=int, default=None, help="image tokens, for resolution-dependent shifts")
    p.set_defaults(func=_timesteps)

    p = sub.add_parser("check", help="load and validate a config without running anything")
    _config_args(p)
    p.set_defaults(func=_config_check)

    _add_training_commands(sub)
    return parser


def _add_training_commands(sub) -> None:
    try:
        from tuner.trainers.cli import add_commands
    except ImportError:  # the training commands land with the trainer
        return
    add_commands(sub, _config_args)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except TunerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
