"""`tuner cache latents` and `tuner cache text`: encode what is missing or stale, reuse the rest.

Both commands plan the cache keys exactly as training will (`tuner.cache.plan`), ask the store which
are missing or damaged, load the encoder only if something is, and encode in batches (latents of one
bucket stack; captions batch freely). Each ends with `encoded N, reused M, pruned K`.

Resuming. Entries are written through the store's atomic shard writer, which commits at least every
`cache.commit_every_seconds` (default 30) and when the command stops on SIGINT or SIGTERM (the signal
becomes an exception, so the writer's exit commits what is buffered). A run killed at any point,
even by SIGKILL, keeps what was committed and the next run resumes from there.

Checking. Entries the run would reuse are checked first, as reads check them (`tuner.cache.shards`:
checksums in shards whose file changed since they were last known good, sizes everywhere); damaged
ones are re-encoded like missing ones and named in the output.

One run at a time. A run holds `caching-<kind>.lock` in the store from before it asks what is missing
until it has committed everything, so a second `tuner cache latents` on the same store waits (saying
so) and then reuses the first run's entries instead of encoding them again. Latents and text may be
cached in parallel: they never share entries.

Several processes. Started by `accelerate launch --num_processes N` or `torchrun`, the processes split
the batches of one run between them (`tuner.cache.processes`): the same entries, in one store.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from tqdm.auto import tqdm

from tuner import registry
from tuner.archs.parts.size_conditioning import size_conditions
from tuner.archs.parts.text_encoder_training import encode_text_cache, text_cache_encoder
from tuner.cache.plan import (
    FAILED,
    LATENT,
    TEXT,
    TextRequest,
    latent_encoder,
    latent_keys,
    plan_datasets,
    stores_of,
    text_encoder,
    text_requests,
    torch_device,
)
from tuner.cache.processes import CachingProcesses
from tuner.cache.store import CacheStore, VerifyReport
from tuner.cache.writer import WriterLock
from tuner.data.jobs import load_control_pixels, load_job_audio, load_job_pixels
from tuner.data.masks import load_job_mask, to_latent_grid
from tuner.dtypes import DTYPES
from tuner.errors import CacheError, DataError


def _silent(_: str) -> None:
    pass


def _summary(encoded: int, reused: int, pruned: int) -> str:
    return f"encoded {encoded}, reused {reused}, pruned {pruned}"


class CachingInterrupted(CacheError):
    """SIGINT or SIGTERM arrived during a caching run (raised from the signal handler)."""


@contextlib.contextmanager
def _stop_on_signals(command: str) -> Iterator[None]:
    """Turn the first SIGINT or SIGTERM into `CachingInterrupted`, so that `with store.writer()`
    commits what is buffered on the way out; a second signal acts as usual (kills)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def stop(signum, frame):
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise CachingInterrupted(
            f"interrupted by {signal.Signals(signum).name}: what was encoded so far is committed; "
            f"run `{command}` again to encode the rest."
        )

    for sig in signals:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _one_run_at_a_time(
    store: CacheStore, kind: str, command: str, log: Callable[[str], None], procs: CachingProcesses
) -> Iterator[None]:
    """Hold the store's caching lock for `kind`, waiting (with a message) while another run holds it.
    With several processes, process 0 holds it for all of them: the others wait for it to, and it lets
    go once every process is done."""
    if not procs.main:
        procs.barrier()
        yield
        procs.barrier()
        return
    lock = WriterLock(store.root, f"caching-{kind}.lock")
    try:
        if not lock.try_exclusive():
            holder = lock.path.read_text().strip() or "?"
            log(
                f"another `{command}` run (pid {holder}) is writing {store.root}; waiting for it to finish, "
                f"then this run encodes only what it left out"
            )
            lock.exclusive()
        lock.path.write_text(f"{os.getpid()}\n")
        procs.barrier()
        yield
        procs.barrier()
    finally:
        lock.release()


def _missing_or_damaged(
    store: CacheStore, keys: list[str], log: Callable[[str], None]
) -> tuple[set[str], int]:
    """The keys to encode: those without an entry and those whose entry is damaged (named in the log).
    Returns them and the number of damaged ones."""
    absent = set(store.missing(keys))
    report = store.verify([k for k in keys if k not in absent], trust_stamps=True)
    for i, (key, problem) in enumerate(sorted(report.damaged.items())):
        if i == 10:
            log(f"... and {len(report.damaged) - 10} more damaged entries")
            break
        log(f"damaged, re-encoding: {store.describe(key)}: {problem}")
    if report.unverified:
        log(
            f"note: {report.unverified} entries in {store.root} were cached by an older tuner and carry no "
            f"checksum; they are reused unverified (only their size is checked)."
        )
    return absent | set(report.damaged), len(report.damaged)


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def cache_latents(cfg, device: str | None = None, prune: bool = False, batch_size: int | None = None,
                  log: Callable[[str], None] = print) -> tuple[int, int, int]:  # fmt: skip
    """Encode the latents of every dataset item that is not cached yet (or whose entry is damaged);
    return (encoded, reused, pruned).

    A file that cannot be decoded stops the command (`on_error = "stop"`), or is reported and recorded
    as a failed entry (`"skip"`), which training then leaves out; fixing the file changes its key, so
    the next run encodes it."""
    procs = CachingProcesses()
    model = registry.architecture(cfg.model.architecture).family_model(cfg)
    plans = plan_datasets(model, cfg, log if procs.main else _silent)
    specs = {plan.spec.index: plan.spec for plan in plans}
    encoder = latent_encoder(model)
    batch_size = batch_size or cfg.cache.batch_size
    dev = torch_device(procs.device(device or cfg.cache.device))
    vae_dtype = DTYPES[cfg.model.vae_dtype]
    encoded = reused = pruned = skipped = repaired = 0
    vae = None
    for cache_dir, store in procs.first(lambda: stores_of(plans, readonly=False)).items():
        todo: dict[str, object] = {}
        for plan in plans:
            if plan.spec.cache_directory == cache_dir:
                for key, job in zip(latent_keys(store, plan.jobs, encoder), plan.jobs):
                    todo.setdefault(key, job)
        with (
            _one_run_at_a_time(store, LATENT, "tuner cache latents", log, procs),
            _stop_on_signals(cfg.command("cache latents")),
        ):
            missing, damaged = _missing_or_damaged(store, list(todo), log)
            procs.barrier()  # every process knows the work before any writes
            reused += len(todo) - len(missing)
            repaired += damaged
            by_bucket: dict[str, list] = defaultdict(list)
            for key in missing:
                by_bucket[todo[key].bucket_key].append((key, todo[key]))
            # the batches a one-process run encodes, every N-th of them to this process
            batches = procs.mine([chunk for bucket in sorted(by_bucket) for chunk in
                                  _chunks(sorted(by_bucket[bucket], key=lambda kj: kj[1].source), batch_size)])  # fmt: skip
            if batches and vae is None:
                vae = model.load_latent_encoder(dev, vae_dtype).eval()
            with (
                store.writer(commit_every_seconds=cfg.cache.commit_every_seconds) as writer,
                tqdm(
                    total=sum(map(len, batches)),
                    desc=f"latents → {cache_dir}",
                    unit="item",
                    disable=not procs.main,
                ) as bar,  # fmt: skip
            ):
                for chunk in batches:
                    loaded = []
                    for key, job in chunk:
                        try:
                            mask = load_job_mask(job) if job.mask else None  # unreadable: on_error too
                            audio = load_job_audio(
                                job
                            )  # the clip's sound (audio-video models); bad sound too
                            loaded.append(
                                (key, job, load_job_pixels(job), load_control_pixels(job), mask, audio)
                            )
                        except DataError as e:
                            if specs[job.dataset_index].on_error == "stop":
                                raise
                            log(f"skipped: {e}")
                            meta = {"source": job.source, "error": str(e), "encoder": encoder.label()}
                            writer.put(key, FAILED, {"failed": torch.zeros(0)}, meta)
                            skipped += 1
                            bar.update(1)
                    if not loaded:
                        continue
                    pixels = torch.stack([item[2] for item in loaded]).to(dev, vae_dtype)
                    # jobs of one bucket key have the same number of controls, so they stack too
                    controls = [torch.stack(c).to(dev, vae_dtype) for c in zip(*(item[3] for item in loaded))]
                    with torch.no_grad():
                        latents = model.encode_latents(vae, pixels, controls)
                    for i, (key, job, _, _, mask, audio) in enumerate(loaded):
                        tensors = {
                            name: t[i].detach().to("cpu").contiguous() for name, t in latents.items()
                        } | (size_conditions(job) if model.record.size_conditioning else {})
                        if mask is not None:  # the loss mask on the latents' grid (`tuner.data.masks`)
                            grid = tuple(tensors["latents"].shape[1:])
                            tensors["loss_mask"] = to_latent_grid(mask, grid, job.mask_min_weight)
                        if audio is not None:  # the clip's sound (audio-video models)
                            with torch.no_grad():
                                sound = model.sound_stream().encode(vae, audio.to(dev, vae_dtype))
                            tensors |= {name: t.detach().to("cpu").contiguous() for name, t in sound.items()}
                        meta = {
                            "bucket": job.bucket_key,
                            "encoder": encoder.label(),
                            "source": job.source,
                        }
                        writer.put(key, LATENT, tensors, meta)
                    encoded += len(loaded)
                    bar.update(len(loaded))
        if prune and procs.main:
            pruned += store.prune(set(todo) | set(store.keys(TEXT)))
    encoded, skipped = procs.total(encoded, skipped)
    if not procs.main:
        return encoded, reused, pruned
    log(
        _summary(encoded, reused, pruned)
        + (f", skipped {skipped}" if skipped else "")
        + (f" (re-encoded {repaired} damaged)" if repaired else "")
    )
    return encoded, reused, pruned


def cache_text(cfg, device: str | None = None, prune: bool = False, batch_size: int | None = None,
               log: Callable[[str], None] = print) -> tuple[int, int, int]:  # fmt: skip
    """Encode every distinct caption (and the empty one) not cached yet, or whose entry is damaged;
    return (encoded, reused, pruned)."""
    procs = CachingProcesses()
    model = registry.architecture(cfg.model.architecture).family_model(cfg)
    plans = plan_datasets(model, cfg, log if procs.main else _silent)
    encoder = text_encoder(model)
    max_len = cfg.cache.text_max_length
    batch_size = batch_size or cfg.cache.batch_size
    dev = torch_device(procs.device(device or cfg.cache.device))
    encoded = reused = pruned = repaired = 0
    te = None
    if model.trains_text_encoder and procs.main:
        log("network.train_text_encoder: the text encoders train, so their outputs are computed at every "
            "training step and not cached; caching the captions' token ids only.")  # fmt: skip
    for cache_dir, store in procs.first(lambda: stores_of(plans, readonly=False)).items():
        wanted: dict[str, TextRequest] = {}
        for plan in plans:
            if plan.spec.cache_directory == cache_dir:
                wanted.update(text_requests(model, store, plan, encoder, max_len)[1])
        with (
            _one_run_at_a_time(store, TEXT, "tuner cache text", log, procs),
            _stop_on_signals(cfg.command("cache text")),
        ):
            missing, damaged = _missing_or_damaged(store, list(wanted), log)
            procs.barrier()  # every process knows the work before any writes
            reused += len(wanted) - len(missing)
            repaired += damaged
            todo = sorted(missing, key=lambda k: (wanted[k].caption, k))
            batches = procs.mine(list(_chunks(todo, batch_size)))  # every N-th of a one-process run's
            if batches and te is None:
                te = text_cache_encoder(model, dev, cfg.cache.text_encoder_dtype)
            with (
                store.writer(commit_every_seconds=cfg.cache.commit_every_seconds) as writer,
                tqdm(
                    total=sum(map(len, batches)),
                    desc=f"text → {cache_dir}",
                    unit="caption",
                    disable=not procs.main,
                ) as bar,  # fmt: skip
            ):
                for chunk in batches:
                    requests = [wanted[k] for k in chunk]
                    captions = [r.caption for r in requests]
                    with torch.no_grad():
                        controls = None
                        if model.record.text_uses_controls:
                            controls = [load_control_pixels(r.job) for r in requests]
                        outputs = encode_text_cache(model, te, captions, controls)
                    for key, request, out in zip(chunk, requests, outputs):
                        tensors = {name: t.detach().to("cpu").contiguous() for name, t in out.items()}
                        meta = {"encoder": encoder.label(), "caption": request.caption}
                        writer.put(key, TEXT, tensors, meta)
                    encoded += len(chunk)
                    bar.update(len(chunk))
        if prune and procs.main:
            pruned += store.prune(set(wanted) | set(store.keys(LATENT)))
    (encoded,) = procs.total(encoded)
    if procs.main:
        log(_summary(encoded, reused, pruned) + (f" (re-encoded {repaired} damaged)" if repaired else ""))
    return encoded, reused, pruned


def verify_cache(directory: str, log: Callable[[str], None] = print) -> VerifyReport:
    """`tuner cache verify DIR`: check every entry (reads every byte); list the damaged ones and
    raise CacheError naming the commands that re-encode them if there are any."""
    store = CacheStore(directory, readonly=True)
    start = time.perf_counter()
    report = store.verify()
    seconds = time.perf_counter() - start
    for key, problem in sorted(report.damaged.items()):
        log(f"damaged: {store.describe(key)} (key {key[:16]}...): {problem}")
    log(
        f"checked {report.checked} entries ({report.bytes_read / 2**20:.1f} MiB read) in {seconds:.1f} s: "
        f"{len(report.damaged)} damaged"
        + (
            f", {report.unverified} without checksums (cached by an older tuner; only their size was checked)"
            if report.unverified
            else ""
        )
    )
    if report.damaged:
        raise CacheError(
            f"{len(report.damaged)} damaged entries in {directory}. Run `tuner cache latents --config ...` "
            f"and `tuner cache text --config ...` with the configs that use this cache: they re-encode "
            f"exactly the damaged entries."
        )
    return report
