"""`tuner cache latents` and `tuner cache text`: encode what is missing or stale, reuse the rest.

Both commands plan the cache keys exactly as training will (`tuner.cache.plan`), ask the store which
are missing, load the encoder only if something is, and encode in batches (latents of one bucket
stack; captions batch freely). Entries are written through the store's atomic shard writer, so a run
killed at any point resumes where it stopped. Each ends with `encoded N, reused M, pruned K`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from tuner.cache.plan import (
    FAILED,
    LATENT,
    TEXT,
    TextRequest,
    latent_encoder,
    latent_key,
    plan_datasets,
    stores_of,
    text_encoder,
    text_requests,
    torch_device,
)
from tuner.data.jobs import load_control_pixels, load_job_pixels
from tuner.dtypes import DTYPES
from tuner.errors import DataError
from tuner.trainers import trainer_class


def _summary(encoded: int, reused: int, pruned: int) -> str:
    return f"encoded {encoded}, reused {reused}, pruned {pruned}"


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def cache_latents(cfg, device: str | None = None, prune: bool = False, batch_size: int | None = None,
                  log: Callable[[str], None] = print) -> tuple[int, int, int]:  # fmt: skip
    """Encode the latents of every dataset item that is not cached yet; return (encoded, reused, pruned).

    A file that cannot be decoded stops the command (`on_error = "stop"`), or is reported and recorded
    as a failed entry (`"skip"`), which training then leaves out; fixing the file changes its key, so
    the next run encodes it."""
    trainer = trainer_class(cfg.model.architecture)(cfg)
    plans = plan_datasets(trainer, cfg, log)
    specs = {plan.spec.index: plan.spec for plan in plans}
    encoder = latent_encoder(trainer)
    batch_size = batch_size or cfg.cache.batch_size
    dev = torch_device(device or cfg.cache.device)
    vae_dtype = DTYPES[cfg.model.vae_dtype]
    encoded = reused = pruned = skipped = 0
    vae = None
    for cache_dir, store in stores_of(plans, readonly=False).items():
        todo: dict[str, object] = {}
        for plan in plans:
            if plan.spec.cache_directory == cache_dir:
                for job in plan.jobs:
                    todo.setdefault(latent_key(store, job, encoder), job)
        missing = set(store.missing(list(todo)))
        reused += len(todo) - len(missing)
        by_bucket: dict[str, list] = defaultdict(list)
        for key in missing:
            by_bucket[todo[key].bucket_key].append((key, todo[key]))
        if missing and vae is None:
            vae = trainer.load_vae(dev, vae_dtype).eval()
        with (
            store.writer() as writer,
            tqdm(total=len(missing), desc=f"latents → {cache_dir}", unit="item") as bar,
        ):
            for bucket in sorted(by_bucket):
                for chunk in _chunks(sorted(by_bucket[bucket], key=lambda kj: kj[1].source), batch_size):
                    loaded = []
                    for key, job in chunk:
                        try:
                            loaded.append((key, job, load_job_pixels(job), load_control_pixels(job)))
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
                        latents = trainer.encode_latents(vae, pixels, controls)
                    for i, (key, job, _, _) in enumerate(loaded):
                        tensors = {name: t[i].detach().to("cpu").contiguous() for name, t in latents.items()}
                        meta = {"bucket": job.bucket_key, "encoder": encoder.label(), "source": job.source}
                        writer.put(key, LATENT, tensors, meta)
                    encoded += len(loaded)
                    bar.update(len(loaded))
        if prune:
            pruned += store.prune(set(todo) | set(store.keys(TEXT)))
    log(_summary(encoded, reused, pruned) + (f", skipped {skipped}" if skipped else ""))
    return encoded, reused, pruned


def cache_text(cfg, device: str | None = None, prune: bool = False, batch_size: int | None = None,
               log: Callable[[str], None] = print) -> tuple[int, int, int]:  # fmt: skip
    """Encode every distinct caption (and the empty one) not cached yet; return (encoded, reused, pruned)."""
    trainer = trainer_class(cfg.model.architecture)(cfg)
    plans = plan_datasets(trainer, cfg, log)
    encoder = text_encoder(trainer)
    max_len = cfg.cache.text_max_length
    batch_size = batch_size or cfg.cache.batch_size
    dev = torch_device(device or cfg.cache.device)
    encoded = reused = pruned = 0
    te = None
    for cache_dir, store in stores_of(plans, readonly=False).items():
        wanted: dict[str, TextRequest] = {}
        for plan in plans:
            if plan.spec.cache_directory == cache_dir:
                wanted.update(text_requests(trainer, store, plan, encoder, max_len)[1])
        missing = set(store.missing(list(wanted)))
        reused += len(wanted) - len(missing)
        if missing and te is None:
            te = trainer.load_text_encoder(dev, cfg.cache.text_encoder_dtype)
        todo = sorted(missing, key=lambda k: (wanted[k].caption, k))
        with (
            store.writer() as writer,
            tqdm(total=len(todo), desc=f"text → {cache_dir}", unit="caption") as bar,
        ):
            for chunk in _chunks(todo, batch_size):
                requests = [wanted[k] for k in chunk]
                captions = [r.caption for r in requests]
                with torch.no_grad():
                    controls = None
                    if trainer.text_uses_controls:
                        controls = [load_control_pixels(r.job) for r in requests]
                    outputs = trainer.encode_text(te, captions, controls)
                for key, request, out in zip(chunk, requests, outputs):
                    tensors = {name: t.detach().to("cpu").contiguous() for name, t in out.items()}
                    writer.put(key, TEXT, tensors, {"encoder": encoder.label(), "caption": request.caption})
                encoded += len(chunk)
                bar.update(len(chunk))
        if prune:
            pruned += store.prune(set(wanted) | set(store.keys(LATENT)))
    log(_summary(encoded, reused, pruned))
    return encoded, reused, pruned
