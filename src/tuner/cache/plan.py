"""What the cache must hold for a config, computed the same way by the caching commands and training.

Both sides walk the datasets (`plan_datasets`), turn every latent job and caption into a cache key
(`latent_keys`, `text_key`), and compare with the store. The caching commands encode what is missing;
training refuses to start while anything is missing, naming the command that fixes it. Because a key
covers the source file's contents, every parameter of the encode and the encoder's identity, "missing"
also means "stale": an edited caption, a new resolution or another VAE simply produce other keys.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tuner.cache.index import INDEX_NAME
from tuner.cache.keys import EncoderIdentity, canonical_json, entry_key, fingerprint_weights
from tuner.cache.store import CacheStore
from tuner.config.dataset import DatasetSpec
from tuner.data.datasets import discover_items
from tuner.data.frames import FrameRule
from tuner.data.jobs import LatentJob, plan_latent_jobs
from tuner.data.media import VideoInfo, probe_media
from tuner.errors import CacheError, ConfigError

LATENT, TEXT = "latent", "text"
FAILED = "failed"  # a source that could not be decoded while caching with on_error = "skip"


@dataclass
class DatasetPlan:
    spec: DatasetSpec
    jobs: list[LatentJob]
    problems: list[str] = field(default_factory=list)


def plan_datasets(
    model, cfg, log: Callable[[str], None] = print, readonly: bool = False
) -> list[DatasetPlan]:
    """Discover and probe every dataset; report problems (missing captions, skipped files) by name.

    Probes are remembered in each dataset's cache store (`MemoizedProbe`); with `readonly`
    (training) the stores are only read, and a dataset whose store does not exist yet is probed
    without memo."""
    plans = []
    rule = FrameRule(model.record.frame_multiple, model.record.frame_remainder)
    for spec in cfg.datasets:
        if spec.kind == "video" and not model.record.supports_video:
            raise ConfigError(
                f"{cfg.data.dataset_config}: datasets[{spec.index}] is a video dataset, but "
                f"{model.architecture} is an image model. Use image_directory or image_jsonl_file."
            )
        if spec.kind == "image" and not model.record.supports_images:
            raise ConfigError(
                f"{cfg.data.dataset_config}: datasets[{spec.index}] is an image dataset, but "
                f"{model.architecture} is an image-to-video model: it learns a clip from its first frame, "
                "so a single image has nothing to learn. Use video_directory or video_jsonl_file."
            )
        items, problems = discover_items(spec)
        store = None
        if not readonly or (Path(spec.cache_directory) / INDEX_NAME).exists():
            store = CacheStore(spec.cache_directory, readonly=readonly)
        probe = MemoizedProbe(store, [p for item in items for p in (item.path, *item.control_paths)])
        jobs, more = plan_latent_jobs(
            spec,
            items,
            model.record.spatial_step,
            rule,
            model.record.model_fps,
            probe=probe,
            audio_format=model.record.audio_format,
        )
        probe.save()
        _check_controls(model, spec, jobs, cfg)
        _check_frames(model, spec, jobs, cfg)
        plans.append(DatasetPlan(spec, jobs, problems + more))
        # a table's further resolutions (`part` > 0) found the same items: say their problems once
        for problem in (problems if spec.part == 0 else []) + more:
            log(f"warning: {problem}")
    return plans


_PROBE_TAG = "probe-v1:"  # bump when probing changes what it reports


class MemoizedProbe:
    """`probe_media` remembered in `store`'s index by (path, size, mtime, inode): a re-run stats
    each file and probes only new or changed ones. `paths` are looked up at once (one query per
    500). Frame folders are probed each time (editing a frame does not change the folder's mtime).
    `save()` stores the new answers in one transaction."""

    def __init__(self, store: CacheStore | None, paths: list[str]):
        self._memo = store.memo("probes", tag=_PROBE_TAG) if store is not None else None
        if self._memo is not None:
            self._memo.preload(p for p in paths if not os.path.isdir(p))

    def __call__(self, path: str, video: bool) -> VideoInfo:
        if self._memo is None or os.path.isdir(path):
            return probe_media(path, video)
        value = self._memo.get(path, lambda p: json.dumps(list(probe_media(p, video))))
        return VideoInfo(*json.loads(value))

    def save(self) -> None:
        if self._memo is not None:
            self._memo.save()


def _check_controls(model, spec: DatasetSpec, jobs: list[LatentJob], cfg) -> None:
    """Edit models need their control images; the others must not be given any."""
    low, high = model.record.control_images
    for job in jobs:
        n = len(job.control_paths)
        if not low <= n <= high:
            if high == 0:
                fix = f"{model.architecture} takes no control images: remove control_directory"
            else:
                fix = (
                    f"{model.architecture} needs {low}" + (f" to {high}" if high > low else "") + " per item"
                )
            raise ConfigError(
                f"{cfg.data.dataset_config}: datasets[{spec.index}]: {job.source} has {n} control image(s); {fix}."
            )


def _check_frames(model, spec: DatasetSpec, jobs: list[LatentJob], cfg) -> None:
    """Clips shorter than the record's `min_frames` (first-last-frame models need two frames)."""
    for job in jobs:
        if job.bucket[2] < model.record.min_frames:
            raise ConfigError(
                f"{cfg.data.dataset_config}: datasets[{spec.index}]: {job.source} gives a clip of "
                f"{job.bucket[2]} frame(s); {model.architecture} needs at least {model.record.min_frames} (its "
                "first and last frame are the conditions). Set target_frames to 5 or more."
            )


_TEXT_FOLDERS = (
    "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3",
    "text_encoder_4", "tokenizer_4", "processor",
)  # fmt: skip


def _fingerprint(path: str, components: tuple[str, ...]) -> str:
    """Fingerprint of what an encoder loads from `path`: for a diffusers pipeline root only the named
    component folders, so retraining-irrelevant parts (a new transformer) do not invalidate the cache."""
    root = Path(path)
    if root.is_dir() and not (root / "config.json").is_file():
        found = [root / c for c in components if (root / c).is_dir()]
        if found:
            return "+".join(fingerprint_weights(f) for f in found)
    return fingerprint_weights(root)


# what each model field of `latent_encoders` loads from a diffusers pipeline root (audio-video models
# encode sound with the `audio_vae/` beside `vae/`; other pipelines have none, so their keys stay)
_LATENT_FOLDERS = {"vae": ("vae", "audio_vae"), "image_encoder": ("image_encoder", "image_processor")}


def latent_encoder(model) -> EncoderIdentity:
    """The identity of what a latent entry holds (the record's `latent_space`: a VAE's latents, or a
    pixel-space model's resized pictures) and of every model that shapes it (the record's `latent_encoders`:
    the VAE, plus e.g. the CLIP image encoder of image-to-video models; none for pixels); all run in
    `model.vae_dtype`."""
    cfg = model.cfg
    fingerprints = [
        _fingerprint(model.weights_path(name), _LATENT_FOLDERS.get(name, (name,)))
        for name in model.record.latent_encoders
    ]
    order = ""  # one-frame models caching their frames in time order (`one_frame = "frames"`): that order
    if model.record.one_frame == "frames":
        one = cfg.one_frame
        order = canonical_json(
            {"clean_indices": list(one.clean_indices), "target_index": one.target("frames")}
        )
    return EncoderIdentity(
        architecture=f"{model.architecture}-{model.record.latent_space}{order}",
        weights_fingerprint="+".join(fingerprints),
        dtype=cfg.model.vae_dtype,
        format_version=model.record.cache_format_version,
    )


def text_encoder(model) -> EncoderIdentity:
    cfg = model.cfg
    # every file that shapes the text embeddings: every encoder (FLUX.1 has CLIP-L and T5, SD 3.5 three,
    # HiDream four) and tokenizer
    m = cfg.model
    parts = [model.weights_path("text_encoder")]
    parts += [
        p
        for p in (m.text_encoder_2, m.text_encoder_3, m.text_encoder_4, m.tokenizer, m.tokenizer_2, m.tokenizer_3,
                  m.tokenizer_4)
        if p
    ]  # fmt: skip
    # and what the text encoding reads besides (FramePack one-frame: SigLIP tokens of the reference image)
    extra = [
        _fingerprint(model.weights_path(name), _LATENT_FOLDERS.get(name, (name,)))
        for name in model.record.text_extra_encoders
    ]
    return EncoderIdentity(  # while the text encoders train, entries hold their inputs (token ids)
        architecture=f"{model.architecture}-{'tokens' if model.trains_text_encoder else 'text'}",
        weights_fingerprint="+".join([*(_fingerprint(p, _TEXT_FOLDERS) for p in parts), *extra]),
        dtype=cfg.cache.text_encoder_dtype,
        format_version=model.record.cache_format_version,
    )


def latent_keys(store: CacheStore, jobs: list[LatentJob], encoder: EncoderIdentity) -> list[str]:
    """The cache key of each job. Source hashes come from the store's memo in one query per 500
    files (`CacheStore.hash_sources`), not one per file."""
    hashes = store.hash_sources(p for job in jobs for p in job.input_paths)
    return [
        entry_key(LATENT, "+".join(hashes[p] for p in job.input_paths), job.params(), encoder) for job in jobs
    ]


def text_key(caption: str, encoder: EncoderIdentity, max_length: int, controls: dict | None = None) -> str:
    params = {"max_length": max_length, **({"controls": controls} if controls else {})}
    return entry_key(TEXT, caption, params, encoder)


@dataclass(frozen=True)
class TextRequest:
    """One text-encoder input: a caption, and the job whose control images the encoder also sees
    (edit models whose text encoder is a vision-language model); None otherwise."""

    caption: str
    job: LatentJob | None = None


def text_requests(
    model, store: CacheStore, plan: DatasetPlan, encoder: EncoderIdentity, max_length: int
) -> tuple[list[tuple[tuple[str, ...], str]], dict[str, TextRequest]]:
    """(text keys, empty-caption key) for each job of `plan`, and what each key encodes. A job has one
    text key per caption variant (`tuner.data.captions`; usually one), the first being its plain caption.

    Usually a text entry depends on the caption alone and is shared by every item with that caption.
    When the architecture's text encoder also looks at the control images, the entry is keyed by their
    contents and crops too, and the empty caption (for caption dropout) is encoded with them as well."""
    per_job, requests = [], {}
    hashes = {}
    if model.record.text_uses_controls:
        hashes = store.hash_sources(p for job in plan.jobs for p in job.control_paths)
    plain: dict[str, str] = {}  # caption -> key when there are no controls: one digest per caption
    for job in plan.jobs:
        controls = None
        if model.record.text_uses_controls:
            controls = {
                "sources": [hashes[p] for p in job.control_paths],
                "crops": job.params()["controls"],
            }
        keys = []
        for caption in (*(job.captions or (job.caption,)), ""):
            if controls is None:
                if caption not in plain:
                    plain[caption] = text_key(caption, encoder, max_length)
                key = plain[caption]
            else:
                key = text_key(caption, encoder, max_length, controls)
            requests.setdefault(key, TextRequest(caption, job if controls else None))
            keys.append(key)
        per_job.append((tuple(keys[:-1]), keys[-1]))
    return per_job, requests


def stores_of(plans: list[DatasetPlan], readonly: bool) -> dict[str, CacheStore]:
    return {d: CacheStore(d, readonly=readonly) for d in dict.fromkeys(p.spec.cache_directory for p in plans)}


def require_cached(store: CacheStore, keys: list[str], what: str, command: str, cfg) -> None:
    """Raise CacheError naming the command to run when any key is not in the store."""
    missing = store.missing(keys)
    if missing:
        raise CacheError(
            f"{len(missing)} of {len(set(keys))} {what} entries are missing or stale in {store.root} "
            f"(new or changed files, captions, resolution, frames or model). "
            f"Run: {cfg.command(command)}"
        )


def open_training_data(
    model,
    cfg,
    log: Callable[[str], None] = print,
    rank: int = 0,
    world: int = 1,
    validation: bool = False,
    pin_memory: bool = False,
):
    """Plan the datasets, check that the cache is complete and current, and return the batches of the
    training datasets, or with `validation` those of the held-out ones (no caption dropout). With
    `pin_memory` (training on CUDA) batches are stacked into pinned memory."""
    from tuner.cache.batches import TrainingData, TrainingSample

    plans = plan_datasets(model, cfg, log, readonly=True)
    for plan in plans:
        if not (Path(plan.spec.cache_directory) / INDEX_NAME).exists():
            raise CacheError(
                f"nothing is cached in {plan.spec.cache_directory} yet. "
                f"Run: {cfg.command('cache latents')} and {cfg.command('cache text')}"
            )
    # Read-only: training writes nothing to the store, so a cache on a read-only mount works.
    stores = stores_of(plans, readonly=True)
    for store in stores.values():
        if unverified := store.unverified_entries():
            log(
                f"note: {unverified} entries in {store.root} were cached by an older tuner and carry no "
                f"checksum; they are read unverified (re-cache into a new directory to have them checked)."
            )
    lat_enc, txt_enc = latent_encoder(model), text_encoder(model)
    max_len = cfg.cache.text_max_length
    samples: list[TrainingSample] = []
    for plan in plans:
        if plan.spec.validation != validation:
            continue
        store = stores[plan.spec.cache_directory]
        lat_keys = latent_keys(store, plan.jobs, lat_enc)
        txt_keys, requests = text_requests(model, store, plan, txt_enc, max_len)
        require_cached(store, lat_keys, "latent", "cache latents", cfg)
        what = "text (token ids: the text encoders train, their outputs are not cached)" if (
            model.trains_text_encoder) else "text"  # fmt: skip
        require_cached(store, list(requests), what, "cache text", cfg)
        failed = set(store.keys(FAILED))
        for job, key, (texts, empty) in zip(plan.jobs, lat_keys, txt_keys):
            if key in failed:
                if plan.spec.on_error == "stop":
                    raise CacheError(
                        f"{job.source} could not be decoded when it was cached: {store.meta(key)['error']} "
                        'Fix or remove the file and run caching again, or set on_error = "skip".'
                    )
                log(f"warning: left out {job.source}: {store.meta(key)['error']}")
                continue
            samples.append(
                TrainingSample(
                    cache_dir=plan.spec.cache_directory,
                    latent_key=key,
                    text_key=texts[0],
                    empty_text_key=empty,
                    variant_text_keys=texts if len(texts) > 1 else (),
                    bucket_key=job.bucket_key,
                    dataset_index=plan.spec.uid,
                )
            )
    if not samples:
        which = "validation = true" if validation else "training (validation = false)"
        raise ConfigError(f"{cfg.data.dataset_config}: no {which} dataset has any item left to use.")
    return TrainingData(
        samples,
        cfg.datasets,
        cfg.train.seed,
        cfg.data.num_workers,
        rank,
        world,
        caption_dropout=not validation,
        pin_memory=pin_memory,
    )


def torch_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
