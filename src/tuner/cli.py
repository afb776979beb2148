"""The `tuner` command: one tool, many subcommands.

Each subcommand parses its arguments and calls one function in the library; no logic lives here.
Errors the user can fix (`TunerError`) print as one message without a traceback and exit with 2; a
training run stopped on request (SIGTERM, Ctrl-C) exits with 75 once its state is saved.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tuner.errors import TrainingStopped, TunerError
from tuner.tools import add_lora_commands


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


def _download(args) -> None:
    from tuner.hub.download import download

    print(download(args.architecture, args.variant, args.to, comfy=args.comfy), end="")
    print(f"(written to {args.to}/model.toml; paste it into your training TOML)")


def _caption(args) -> None:
    from tuner.caption import CaptionOptions, caption_folder, transformers_captioner

    opts = CaptionOptions(
        prompt=args.prompt, trigger=args.trigger, overwrite=args.overwrite, frames=args.frames
    )
    done = caption_folder(args.dir, transformers_captioner(args.model, args.device), opts)
    print(f"captioned {len(done['written'])} file(s), skipped {len(done['skipped'])} that had a caption")


def _cache_latents(args) -> None:
    from tuner.cache.commands import cache_latents

    cache_latents(_load(args), device=args.device, prune=args.prune, batch_size=args.batch_size)


def _cache_text(args) -> None:
    from tuner.cache.commands import cache_text

    cache_text(_load(args), device=args.device, prune=args.prune, batch_size=args.batch_size)


def _cache_info(args) -> None:
    from tuner.cache.plan import FAILED
    from tuner.cache.store import CacheStore, format_info

    store = CacheStore(args.dir, readonly=True)
    print(format_info(store.info()))
    failed = store.keys(FAILED)
    if failed:
        print(f"  {len(failed)} source(s) failed to decode (fix or remove them, then run caching again):")
        for key in failed:
            meta = store.meta(key)
            print(f"    {meta.get('source')}: {meta.get('error')}")


def _cache_verify(args) -> None:
    from tuner.cache.commands import verify_cache

    verify_cache(args.dir)


def _timesteps(args) -> None:
    from tuner.diffusion.histogram import plot_histogram
    from tuner.trainers import trainer_class

    cfg = _load(args)
    sampler = trainer_class(cfg.model.architecture)(cfg).timestep_sampler()
    plot_histogram(sampler, args.out, seq_len=args.seq_len)
    print(f"wrote {args.out}")


def _config_check(args) -> None:
    cfg = _load(args)
    # the number of processes training will run with: --num-processes, or the launcher's (a `tuner check`
    # run under accelerate launch / torchrun) as training reads it
    if args.num_processes < 0:
        raise SystemExit(f"tuner check: --num-processes {args.num_processes}: give a count of 1 or more")
    from tuner.distributed import launched_processes

    processes = args.num_processes or launched_processes()
    distributed = ""
    if processes > 1:  # the strategy's refusals, as training meets them before step 1
        from tuner.distributed import strategy_for
        from tuner.trainers import trainer_class

        strategy = strategy_for(cfg, processes)
        strategy.check(trainer_class(cfg.model.architecture)(cfg), processes)
        distributed = f", {strategy.name} on {processes} processes"
    print(
        f"{cfg.path}: ok ({len({s.index for s in cfg.datasets})} dataset(s), architecture {cfg.model.architecture}, "
        f"adapters saved in the {cfg.save.format} layout{distributed})"
    )


def _data_check(args) -> None:
    from tuner import registry
    from tuner.config import load_datasets
    from tuner.data.check import check_datasets
    from tuner.errors import DataError

    if args.config:
        cfg = _load(args)
        architecture, specs = cfg.model.architecture, cfg.datasets
    elif args.dataset and args.architecture:
        architecture, specs = args.architecture, load_datasets(args.dataset)
    else:
        raise SystemExit(
            "tuner data check: give --config TRAIN.toml, or --dataset DATASET.toml and --architecture"
        )
    reports = check_datasets(registry.architecture(architecture), specs)
    unusable = [r for r in reports if r.error]
    if unusable:
        raise DataError(f"{len(unusable)} of {len(reports)} datasets cannot be used (see above).")


def _train(args) -> None:
    from tuner.trainers import trainer_class

    cfg = _load(args)
    trainer_class(cfg.model.architecture)(cfg).train(resume=args.resume)


def _generate(args) -> None:
    from tuner.errors import ConfigError
    from tuner.generate import GenerateOptions, generate
    from tuner.tools import parse_weighted_path

    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--size {args.size!r}: expected WIDTHxHEIGHT, e.g. 832x480.") from None
    opts = GenerateOptions(
        prompt=args.prompt, out=args.out, negative_prompt=args.negative_prompt,
        loras=tuple(parse_weighted_path(x) for x in args.lora),
        loras_2=tuple(parse_weighted_path(x) for x in args.lora_2), controls=tuple(args.control), images=tuple(args.image),
        width=width, height=height, frames=args.frames,
        steps=args.steps, guidance_scale=args.guidance, embedded_guidance=args.embedded_guidance, shift=args.shift,
        sampler=args.sampler, seed=args.seed,
        device=args.device, guidance_method=args.guidance_method,
    )  # fmt: skip
    generate(_load(args), opts)


def build_parser() -> argparse.ArgumentParser:
    from tuner.registry import describe_architectures, describe_sampling

    known = f"architectures (model.architecture in a config):\n{describe_architectures()}"
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="tuner", description=__doc__.splitlines()[0], epilog=known, formatter_class=raw
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "fixtures", help="write a tiny random-weight model in the real checkpoint layouts", epilog=known,
        formatter_class=raw,
    )  # fmt: skip
    p.add_argument("architecture", help="architecture name (listed below)")
    p.add_argument("dir", help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_fixtures)

    p = sub.add_parser(
        "download", help="fetch an architecture's components from its official hub repository", epilog=known,
        formatter_class=raw,
    )  # fmt: skip
    p.add_argument("architecture", help="architecture name (listed below)")
    p.add_argument("variant", nargs="?", default="", help="e.g. 1.3B or 14B for wan (default: the first)")
    p.add_argument("--to", required=True, help="folder the pipeline is written to")
    p.add_argument(
        "--comfy", action="store_true",
        help="the repackaged single files ComfyUI users have (Comfy-Org's repositories) instead of the pipeline",
    )  # fmt: skip
    p.set_defaults(func=_download)

    from tuner.caption import DEFAULT_MODEL, DEFAULT_PROMPT

    p = sub.add_parser("caption", help="write a caption file beside every image and video of a folder")
    p.add_argument("dir", help="folder of images and videos")
    p.add_argument("--model", default=DEFAULT_MODEL, help="image-text-to-text model: hub id or folder")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="question asked; {kind} is image or video")
    p.add_argument("--trigger", default="", help="word(s) put before every caption")
    p.add_argument("--frames", type=int, default=4, help="frames shown of each video")
    p.add_argument("--overwrite", action="store_true", help="caption files that already have a caption")
    p.add_argument("--device", default="auto")
    p.set_defaults(func=_caption)

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
        p.set_defaults(func=func)
    p = csub.add_parser("info", help="what a cache store holds")
    p.add_argument("dir", help="cache directory")
    p.set_defaults(func=_cache_info)
    p = csub.add_parser("verify", help="check every entry's checksum; damaged ones are re-encoded by caching")
    p.add_argument("dir", help="cache directory")
    p.set_defaults(func=_cache_verify)

    p = sub.add_parser("timesteps", help="draw the configured timestep distribution as a PNG histogram")
    _config_args(p)
    p.add_argument("--out", required=True, help="output PNG")
    p.add_argument("--seq-len", type=int, default=None, help="image tokens, for resolution-dependent shifts")
    p.set_defaults(func=_timesteps)

    p = sub.add_parser("check", help="load and validate a config without running anything")
    _config_args(p)
    p.add_argument("--num-processes", type=int, default=0, metavar="N",
                   help="check it for training on N processes (default: WORLD_SIZE, else 1)")  # fmt: skip
    p.set_defaults(func=_config_check)

    data = sub.add_parser("data", help="look at datasets before caching them")
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="WHAT")
    p = dsub.add_parser(
        "check",
        help="per dataset: items, bucket histogram, frames per clip, items dropped and why; encodes nothing",
    )
    p.add_argument("--config", default=None, help="training TOML (its architecture and dataset TOML)")
    p.add_argument(
        "--dataset", default=None, help="a dataset TOML, with --architecture (instead of --config)"
    )
    p.add_argument("--architecture", default=None, help="model.architecture to plan for, with --dataset")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a training-config key (with --config)")  # fmt: skip
    p.set_defaults(func=_data_check)

    p = sub.add_parser(
        "train",
        help="train an adapter from the cache (run under `accelerate launch -m tuner`)",
        description="Train an adapter from the cache. SIGTERM or Ctrl-C (SIGINT) stops the run gracefully: "
        "the current step finishes, its state and adapter are saved, one line names the state and the "
        f"--resume latest command, and the exit code is {TrainingStopped.exit_code}. Exit codes: 0 done, "
        f"2 an error you can fix (the message says what), {TrainingStopped.exit_code} stopped on request "
        "(resumable).",
    )
    _config_args(p)
    p.add_argument(
        "--resume",
        default=None,
        metavar="DIR|latest",
        help="continue from a saved state folder, or the newest one in save.output_dir",
    )
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "generate", help="generate an image or video, optionally with LoRAs", formatter_class=raw,
        epilog=f"sampling defaults (what an unset --steps, --guidance, ... means):\n{describe_sampling()}",
    )  # fmt: skip
    _config_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default=None, help="default: the architecture's (listed below)")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="FILE[:STRENGTH]",
        help="LoRA file in comfy, kohya or diffusers layout, with an optional strength (repeatable); for "
        "two-expert models (Wan 2.2 A14B) the high-noise expert's (model.transformer)",
    )
    p.add_argument(
        "--lora-2",
        action="append",
        default=[],
        metavar="FILE[:STRENGTH]",
        help="two-expert models: a LoRA for the low-noise expert (model.transformer_2) (repeatable)",
    )
    p.add_argument(
        "--control",
        action="append",
        default=[],
        metavar="IMAGE",
        help="control / reference image for edit models (repeatable); Wan VACE: a control video of --frames or more, then optionally its mask video",
    )
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="IMAGE",
        help="first-frame image for image-to-video architectures (optional for Wan 2.2 TI2V-5B); "
        "first-last-frame ones take a second --image, the last frame",
    )
    p.add_argument("--size", default="832x480", help="WIDTHxHEIGHT")
    p.add_argument("--frames", type=int, default=81, help="frame count (1 for an image)")
    p.add_argument("--steps", type=int, default=None, help="default: the architecture's (listed below)")
    p.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="classifier-free guidance in the release's convention (its documented number; default below)",
    )
    p.add_argument(
        "--embedded-guidance",
        type=float,
        default=None,
        help="guidance-distilled models (FLUX.1-dev, HunyuanVideo, ...): the guidance embedding's value",
    )
    p.add_argument(
        "--shift",
        type=float,
        default=None,
        help="sampling flow shift (default: the architecture's; resolution-dependent for FLUX and Qwen)",
    )
    p.add_argument(
        "--sampler", choices=("euler", "dpm++2m"), default="euler", help="DDPM models (SDXL): the sampler"
    )
    p.add_argument(
        "--guidance-method", choices=("auto", "cfg", "apg"), default="auto",
        help="auto: as the release guides (adaptive projected guidance for HunyuanImage 2.1, else CFG)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True, help="output .mp4 or .png")
    p.set_defaults(func=_generate)

    add_lora_commands(sub)
    _add_ui_command(sub)
    return parser


def _add_ui_command(sub: argparse._SubParsersAction) -> None:
    """`tuner ui`'s arguments; `tuner.ui` itself is imported only when that command runs."""
    p = sub.add_parser(
        "ui", help="local web app: datasets, a config form, jobs, live loss and samples (extra: tuner[ui])"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on; other than loopback needs a token"
    )
    p.add_argument("--port", type=int, default=7860)
    p.add_argument(
        "--token", default=None, help="access token (default: generated when --host is not loopback)"
    )
    p.add_argument(
        "--root", action="append", default=[], metavar="DIR",
        help="a folder the UI may read and write (repeatable; default: the current folder)",
    )  # fmt: skip
    p.add_argument(
        "--runs", default="tuner_runs", help="folder of the job queue and its runs (always allowed)"
    )
    p.set_defaults(func=_ui)


def _ui(args) -> None:
    from tuner.ui.server import serve

    serve(args)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # diffusers imports bitsandbytes, whose CPU backend logs a harmless "Failed to load CPU
    # gemm_4bit_forward" on every start; keep it from looking like an error of ours
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except TunerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:  # the trainer has printed where it stands and how to continue
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
