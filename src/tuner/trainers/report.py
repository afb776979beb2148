"""What a training run tells: the start-up summary, the metadata saved with every adapter, and the config
scalars logged to TensorBoard."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from tuner.config import Config


def summary(trainer, network, data, total_steps: int, steps_per_epoch: int, accelerator, memory: str) -> str:
    """The lines printed before the first step: what trains, on what data, for how long, where."""
    cfg, tc, nc = trainer.cfg, trainer.cfg.train, trainer.cfg.network
    # ds_numel: the whole size of a weight DeepSpeed's ZeRO-3 has partitioned (its own numel is its share)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in network.parameters() if p.requires_grad)
    full = nc.type == "full"
    what = "a full fine-tune" if full else (
        f"a {nc.type}{' + DoRA' if nc.dora else ''} (rank {nc.rank}, alpha {nc.alpha})"
    )  # fmt: skip
    batch = data.summary()
    text = []
    if trainer.trains_text_encoder:
        text = [f"  text encoders         trained too (lr {nc.text_encoder_lr or tc.learning_rate:g}): their outputs "
                "are computed at every step; cached text outputs are not used"]  # fmt: skip
    return "\n".join(
        [
            f"tuner: training {what} on {trainer.architecture}",
            *text,
            f"  trainable parameters  {trainable:,} in {len(network)} modules",
            f"  data                  {batch['samples']} samples, {batch['batches_per_epoch']} batches/epoch, "
            f"buckets {', '.join(batch['buckets'])}",
            f"  steps                 {total_steps} ({steps_per_epoch}/epoch), effective batch "
            f"{_batch_size(data)} × {tc.gradient_accumulation_steps} accumulation × "
            f"{data.world} process(es)",  # the processes reading their own batches (pipeline stages share)
            f"  precision             base {cfg.model.dtype}, autocast {tc.mixed_precision}"
            + ("" if full else ", adapter fp32"),
            f"  memory                gradient checkpointing {'on' if tc.gradient_checkpointing else 'off'}; "
            f"{memory}",
            f"  device                {accelerator.device}",
            f"  output                {cfg.save.output_dir}",
        ]
    )


def _batch_size(data) -> str:
    """The batch size as trained: each dataset's batch_size, capped by its largest bucket (a batch_size
    larger than the data trains smaller batches than the config says)."""
    sizes, capped = set(), []
    for index, buckets in sorted(data.by_dataset.items()):
        size, largest = data.specs[index].batch_size, max(len(items) for items in buckets.values())
        sizes.add(min(size, largest))
        if largest < size:
            capped.append(
                f"datasets[{data.specs[index].index}] has batch_size {size} but at most {largest} items per bucket"
            )
    text = "/".join(str(s) for s in sorted(sizes))
    return f"{text} ({'; '.join(capped)})" if capped else text


def adapter_metadata(trainer, data) -> dict[str, str]:
    """What a saved adapter records about how it was trained."""
    from tuner.cache.keys import fingerprint_weights

    cfg = trainer.cfg
    merged = {}  # adapters merged into the base first (`model.merge_adapters`): what this one builds on
    if merges := cfg.model.adapter_merges():
        merged = {
            "tuner.merged_adapters": json.dumps([[Path(path).name, strength] for path, strength in merges])
        }
    return {
        **modelspec(cfg),
        **merged,
        "tuner.architecture": trainer.architecture,
        "tuner.dataset_size": str(data.summary()["samples"]),
        "tuner.base_model": Path(cfg.model.transformer).name,
        "tuner.base_model_fingerprint": fingerprint_weights(cfg.model.transformer),
        "tuner.dataset": json.dumps(data.summary()),
        "tuner.training": json.dumps(
            {**asdict(cfg.train), "timesteps": asdict(cfg.timesteps), "network": asdict(cfg.network)}
        ),
    }


# what each saved layout is loaded by (ModelSpec's `implementation`)
_IMPLEMENTATIONS = {
    "comfy": "https://github.com/comfyanonymous/ComfyUI",
    "comfy_folded": "https://github.com/comfyanonymous/ComfyUI",
    "diffusers": "https://github.com/huggingface/diffusers",
    "kohya": "https://github.com/kohya-ss/sd-scripts",
    "musubi": "https://github.com/kohya-ss/musubi-tuner",
}


def modelspec(cfg: Config, now: datetime | None = None) -> dict[str, str]:
    """The ModelSpec keys (`modelspec.*`) that galleries and UIs read from a saved adapter, plus the
    adapter's rank and alpha under `tuner.*`."""
    nc = cfg.network
    training = [d for d in cfg.datasets if not d.validation] or list(cfg.datasets)
    width, height = training[0].resolution if training else (0, 0)
    full = nc.type == "full"
    spec = {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": cfg.model.architecture if full else f"{cfg.model.architecture}/{nc.type}",
        "modelspec.title": cfg.save.output_name,
        "modelspec.resolution": f"{width}x{height}",
        "modelspec.date": (now or datetime.now(timezone.utc)).isoformat(timespec="seconds"),
        "modelspec.implementation": _IMPLEMENTATIONS[cfg.save.format],
        **({"modelspec.trigger_phrase": cfg.save.trigger_phrase} if cfg.save.trigger_phrase else {}),
    }
    if not full:
        spec |= {"tuner.rank": str(nc.rank), "tuner.alpha": str(nc.alpha)}
    return spec


def flat_scalars(cfg: Config) -> dict[str, int | float | str | bool]:
    """The scalar settings of the train, network and timesteps sections, for TensorBoard's hparams."""
    flat = {}
    for section in ("train", "network", "timesteps"):
        for k, v in asdict(getattr(cfg, section)).items():
            if isinstance(v, int | float | str | bool):
                flat[f"{section}.{k}"] = v
    return flat
