"""NetworkTrainer: the one training loop every architecture shares.

An architecture is a record in `tuner.registry` plus a subclass that says what differs (which
checkpoints to load, how to encode a batch for the cache, how to call its model) and never touches the
loop. The loop reads top to bottom:

    setup      accelerator, seed, cached batches (checked for staleness), model, adapter, optimizer
    resume     saved state, checked against its manifest (trainers/checkpoints.py) + our position
    loop       _step: noise, t (+ draw_conditions) → x_t → predict → the objective's loss (loss_mask)
               → backward (accumulate) → clip → step
               then _log_step (+ logs/metrics.jsonl), _maybe_sample, _maybe_validate, _maybe_save, and a
               stop on SIGTERM / Ctrl-C (trainers/stop.py: all processes stop after the same step, saved)
    finish     the final adapter (and state)

Everything random in a step (noise, timesteps, caption dropout, batch order) comes from generators
seeded by the config seed and the step's position, not from global RNG state. That is what makes a
resumed run identical to an uninterrupted one; the saved global RNG states cover the rest (dropout).
A step whose loss or gradient is NaN or infinite is not applied, and stops the run (`_nonfinite_step`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from tuner import registry
from tuner.config import Config
from tuner.dtypes import DTYPES
from tuner.errors import CheckpointError, ConfigError, TrainingError
from tuner.optim import averaged_weights, schedule_free
from tuner.trainers import board, report
from tuner.trainers.metrics import MetricsFile
from tuner.trainers.stop import StopRequest


@dataclass
class Position:
    """Where training stands; saved with every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch (0-based)
    batch: int = 0  # batches of the current epoch already consumed


@dataclass
class _Run:
    """What one call of `train` set up, handed from step to step."""

    accelerator: Any
    model: nn.Module
    trained: Any  # the adapter network, or the model itself for a full fine-tune
    optimizer: Any
    scheduler: Any
    data: Any
    held_out: Any
    sampler: Any
    checkpoints: Any
    samples: Any
    metadata: dict
    total_steps: int
    groups: list[tuple[int, int]]  # per batch index: its accumulation group [start, end)
    pos: Position
    log: Callable[[str], None]
    progress: Any = None
    recent: list[float] = field(default_factory=list)  # loss of every batch so far
    skipped: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    last_step_end: float = field(default_factory=time.perf_counter)
    ema: Any = None  # `tuner.ema.WeightEMA` with train.ema_decay
    fused: Any = None  # `tuner.fused_backward.FusedBackward` with train.fused_backward
    strategy: Any = None  # `tuner.distributed.Strategy`: how processes share the work
    metrics: Any = None  # `tuner.trainers.metrics.MetricsFile`: logs/metrics.jsonl


class NetworkTrainer:
    """Base class: the training loop. Subclasses implement the architecture-specific methods below."""

    # --- what an architecture declares (data) ----------------------------------------------------
    architecture: ClassVar[str]  # its record in tuner.registry holds targets, key table, block lists
    spatial_step: ClassVar[int]  # pixels per latent token side (VAE factor × patch size)
    frame_multiple: ClassVar[int] = 1  # valid frame counts are frame_multiple·N + frame_remainder
    frame_remainder: ClassVar[int] = 0
    model_fps: ClassVar[float] = 16.0
    supports_video: ClassVar[bool] = False  # image-only models refuse video datasets at load time
    supports_images: ClassVar[bool] = True  # image-to-video models refuse image datasets at load time
    min_frames: ClassVar[int] = 1  # fewest frames per clip (first-last-frame models need two)
    frame_images: ClassVar[int] = 0  # frame images generation is given (image-to-video: first[, last])
    # config fields (`model.<name>`) whose weights shape latent entries; part of their cache key
    latent_encoders: ClassVar[tuple[str, ...]] = ("vae",)
    control_images: ClassVar[tuple[int, int]] = (0, 0)  # (fewest, most) control images per item (edit models)
    text_uses_controls: ClassVar[bool] = False  # the text encoder also sees the control images (Qwen-Edit)
    timestep_mode: ClassVar[str] = "shift"  # what timesteps.mode = "auto" means for this model
    sample_shift: ClassVar[float | str] = 3.0  # generate's default flow shift, or a RESOLUTION_SHIFTS name
    latent_patch: ClassVar[tuple[int, ...]] = (1, 2, 2)  # latent elements per token along (F, H, W)
    audio_format: ClassVar[tuple[int, int] | None] = (
        None  # (sample rate, channels) of models that learn sound
    )
    first_frame_image: ClassVar[bool] = False  # generate takes a first-frame image (--image; TI2V, LTX)
    # "flow" (flow matching, velocity at t) or "ddpm" (SD's discrete noise schedule; epsilon or v)
    objective: ClassVar[str] = "flow"
    cache_format_version: ClassVar[int] = 1
    text_encoder_trainable: ClassVar[bool] = False  # whether network.train_text_encoder is offered (SDXL)
    # generation without a negative prompt guides against zeros, not the empty prompt's encoding (SDXL, as
    # diffusers' `force_zeros_for_empty_prompt`: SDXL's caption dropout zeroed the conditioning)
    zero_empty_negative: ClassVar[bool] = False

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.record = registry.architecture(self.architecture)
        # diffusers module name -> the release's (a name map carrying the fused layers); `.inverse` goes
        # back. Saved adapters and full fine-tunes use the release's names, so they load in ComfyUI.
        self.layout = self.record.checkpoint_layout()
        self.history: list[float] = []  # loss of each optimizer step, for tests and callers
        self.step_seconds: list[float] = []  # wall time of each optimizer step (data wait included)
        self.val_history: list[tuple[int, float]] = []  # (step, validation loss)
        self._objective = None  # `training_objective()`, built on first use

    @property
    def default_targets(self) -> tuple[str, ...]:
        return self.record.default_targets

    # --- what an architecture implements -------------------------------------------------------
    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def load_text_encoder(self, device: torch.device, dtype: str):
        """Return whatever `encode_text` needs (e.g. a (model, tokenizer) pair)."""
        raise NotImplementedError

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, F, H, W] in [-1, 1] → normalized latents [B, ...]."""
        raise NotImplementedError

    def load_latent_encoder(self, device: torch.device, dtype: torch.dtype):
        """What `encode_latents` takes: the VAE, or the VAE with the models named in `latent_encoders`."""
        return self.load_vae(device, dtype)

    def encode_latents(
        self, vae: nn.Module, pixels: torch.Tensor, controls: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """One latent cache entry per item, batched: the target `latents` plus one `control_<i>` per
        control/reference image (edit models). Each value is [B, ...]. `vae` is `load_latent_encoder`'s."""
        out = {"latents": self.encode_pixels(vae, pixels)}
        for i, control in enumerate(controls):
            out[f"control_{i}"] = self.encode_pixels(vae, control)
        return out

    def latent_conditions(self, job) -> dict[str, torch.Tensor]:
        """Tensors an item's latent entry holds beside what `encode_latents` made, from how the item was
        sized (its `tuner.data.jobs.LatentJob`: source and crop); none by default. SDXL's size
        conditioning comes from here."""
        return {}

    def encode_audio(self, encoder, waveform: torch.Tensor) -> dict[str, torch.Tensor]:
        """Audio-video models (`audio_format` set): the latent entry's tensors for a clip's sound, float
        [channels, samples] at `audio_format`'s rate; `encoder` is what `load_latent_encoder` returned."""
        raise NotImplementedError(f"{self.architecture} learns no sound (audio_format is None)")

    def sound_latent_shape(self, frames: int) -> tuple[int, ...]:
        """Audio-video models: the shape (without batch) of the sound latents of a clip of `frames`
        frames, which generation denoises beside the video's."""
        raise NotImplementedError(f"{self.architecture} learns no sound (audio_format is None)")

    def predict_streams(self, model: nn.Module, noisy: torch.Tensor, noisy_sound: torch.Tensor, t: torch.Tensor,
                        cond: dict) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Audio-video models: the velocities of both streams at the same t (generation)."""
        raise NotImplementedError(f"{self.architecture} learns no sound (audio_format is None)")

    def decode_sound(self, latents: torch.Tensor, device: torch.device, dtype: torch.dtype):
        """Audio-video models: sound latents [1, ...] → (waveform [channels, samples] in [-1, 1], rate)."""
        raise NotImplementedError(f"{self.architecture} learns no sound (audio_format is None)")

    def encode_frame_images(
        self, encoder, images: list[torch.Tensor], frames: int
    ) -> dict[str, torch.Tensor]:
        """Image-to-video models (`frame_images` > 0): the latent-entry tensors other than `latents` that the
        given frame images ([B, 3, H, W] in [-1, 1]) of a `frames`-frame video make; generation uses it."""
        raise NotImplementedError

    def encode_text(
        self, encoder, captions: list[str], controls: list[list[torch.Tensor]] | None
    ) -> list[dict[str, torch.Tensor]]:
        """Captions → one dict of tensors per caption, as stored in the cache. `controls` holds each
        caption's control images ([3, 1, H, W] in [-1, 1]) for an architecture whose text encoder sees
        them (`text_uses_controls`), else None; other architectures ignore it."""
        raise NotImplementedError

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stack a batch of cached text entries into model inputs."""
        raise NotImplementedError

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """Model output for x_t at t ∈ [0, 1] (shape of `noisy`). `cond` holds what `collate_text`
        returned plus the batch's other latent tensors (e.g. `control_0`), all on the model's device."""
        raise NotImplementedError

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents → pixels [B, C, F, H, W] in [-1, 1]."""
        raise NotImplementedError

    def draw_conditions(self, x0: torch.Tensor, cond: dict, generator: torch.Generator) -> dict:
        """`cond` plus what a training batch draws beyond noise and t, from the step's seeded generator
        (nothing by default). Text-and-image-to-video models pick here which samples get a clean first
        frame."""
        return cond

    def first_frame_given(self, x0: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Image-to-video models' `draw_conditions`: which samples [B] (bool) are given their first frame,
        each with probability `train.first_frame_conditioning_p` (unset: the record's `first_frame`), drawn
        from the step's generator after everything the model drew before, so resumed runs draw the same."""
        p = self.cfg.train.first_frame_conditioning_p
        p = self.record.first_frame if p is None else p
        return (torch.rand(x0.shape[0], generator=generator) < p).to(x0.device)

    def loss_mask(self, x0: torch.Tensor, cond: dict) -> torch.Tensor | None:
        """0/1 weights broadcastable to `x0` for the elements the loss counts, or None for all of them:
        what the model is given rather than asked to predict (a clean first frame) is left out."""
        return None

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        """Latent shape (without batch) of a sample of this size."""
        raise NotImplementedError

    def combine_guidance(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance as the model's own pipeline applies it (plain by default)."""
        return v_uncond + scale * (v_cond - v_uncond)

    def sample_flow(self, model_fn, noise: torch.Tensor, sigmas: torch.Tensor, cond: dict, uncond: dict,
                    guidance_scale: float, progress: bool = False) -> torch.Tensor:  # fmt: skip
        """Generation's denoising of a flow model: Euler steps from `noise` along `sigmas` (one pass over the
        whole latent). Models that generate in parts (FramePack's sections) override it."""
        from tuner.sampling import euler_sample

        return euler_sample(model_fn, noise, sigmas, cond, uncond, guidance_scale, progress=progress,
                            combine=self.combine_guidance)  # fmt: skip

    def pipeline_parts(self, model: nn.Module):
        """The model's forward cut where pipeline stages may split it (`distributed.strategy = "pipeline"`):
        a `tuner.distributed.stages.PipelineParts` whose prologue, blocks and epilogue compute exactly
        what `predict` does, passing only tensors between blocks. Architectures that have one override this;
        a subclass whose `predict` differs sets it back to `NetworkTrainer.pipeline_parts`."""
        from tuner.distributed.stages import pipeline_unavailable

        raise ConfigError(pipeline_unavailable(self.architecture))

    # --- text encoders that train (`network.train_text_encoder`, SDXL) ---------------------------
    @property
    def trains_text_encoder(self) -> bool:
        """Whether the text encoders train: their outputs are then computed at every step, not cached.
        Every command that caches or trains asks, so a model that cannot is refused before any work."""
        nc = self.cfg.network
        if nc.train_text_encoder and (not self.text_encoder_trainable or nc.type == "full"):
            raise ConfigError(
                f"{self.cfg.path}: network.train_text_encoder: "
                + (f"{self.architecture} trains no text encoder adapter" if not self.text_encoder_trainable
                   else "a full fine-tune trains the denoiser only; use an adapter type")
            )  # fmt: skip
        return nc.train_text_encoder

    def load_text_cache_encoder(self, device: torch.device, dtype: str):
        """What `tuner cache text` encodes with: `load_text_encoder`'s, unless the text encoders train
        (then what makes their inputs, e.g. the tokenizers)."""
        return self.load_text_encoder(device, dtype)

    def encode_text_cache(self, encoder, captions: list[str], controls) -> list[dict[str, torch.Tensor]]:
        """The text cache entries of `captions`: `encode_text`'s, unless the text encoders train (then their
        inputs, e.g. token ids, which `collate_text` and `predict` take)."""
        return self.encode_text(encoder, captions, controls)

    def attach_adapter_file(self, model: nn.Module, path: str, strength: float):
        """generate: attach an adapter file to the denoiser (`tuner.networks.apply_adapter_file`)."""
        from tuner.networks.factory import apply_adapter_file

        return apply_adapter_file(model, path, strength, name_map=self.layout)

    def attach_text_adapters(self, encoder, loras: list[tuple[str, float]]) -> None:
        """generate: attach the text-encoder parts of adapter files to what `load_text_encoder` returned;
        an architecture whose files hold none does nothing."""

    # --- for the subclasses ----------------------------------------------------------------------
    def weights_path(self, component: str) -> str:
        """Path of a model component from the config, with a clear error if it is not set."""
        path = getattr(self.cfg.model, component)
        if not path:
            raise CheckpointError(
                f"{self.cfg.path}: key 'model.{component}' is not set; this command needs it."
            )
        return path

    # --- placing and adapting the loaded model (overridden by two-expert models: one call per expert) --
    def merge_base_adapters(self, model: nn.Module) -> None:
        """Fold `model.merge_adapters` (file, strength) into the freshly loaded base weights, in order,
        as `tuner lora merge` would into its file; fp8 storage, block swap and the trained adapter all
        come after and see the merged weights."""
        merges = self.cfg.model.adapter_merges()
        if merges and self.record.boundary is not None:
            raise TrainingError("model.merge_adapters is for one-transformer models; merge into each expert's "
                                "file with `tuner lora merge` instead.")  # fmt: skip
        from tuner.networks.factory import apply_adapter_file

        # building the adapters draws initial weights (then replaced) from the global generator, which
        # the trained adapter's initialization reads next: leave it as loading a merged file would
        with torch.random.fork_rng(devices=[]):
            for path, strength in merges:
                network = apply_adapter_file(
                    model, path, strength, self.layout, name_map_inverse=self.layout.inverse
                )
                network.merge_into_base()

    def apply_memory(self, model: nn.Module, settings, device, probe_forwards: int = 1):
        """`tuner.memory.apply_memory_settings` on what `load_transformer` returned; returns its handle."""
        from tuner.memory import apply_memory_settings

        return apply_memory_settings(
            model, settings, device, block_lists=self.record.block_lists, fp8_source=self.cfg.model.transformer,
            name_map=self.layout.inverse, probe_forwards=probe_forwards, compile=self.cfg.train.compile,
        )  # fmt: skip

    def export_layout(self):
        """The layout saved files are written through: the architecture's. SDXL's full fine-tunes write
        the bundled checkpoint UIs load (the UNet beside the VAE and both text encoders)."""
        return self.layout

    def build_trained(self, model: nn.Module):
        """What trains (`tuner.networks.build_network` from the `[network]` section) on that model."""
        from tuner.networks.factory import build_network

        cfg = self.cfg
        return build_network(
            model,
            self.default_targets,
            cfg.network,
            self.layout,
            seed=cfg.train.seed,
            save_format=cfg.save.format,
        )

    # --- the one loss ------------------------------------------------------------------------------
    def training_objective(self):
        """What the model is trained on: flow matching (`tuner.timesteps.FlowObjective`), or for
        `objective = "ddpm"` architectures the DDPM schedule with the configured prediction type and
        weights (`tuner.ddpm.DDPMObjective`)."""
        if self._objective is None:
            from tuner.ddpm import objective_from_config

            self._objective = objective_from_config(self.objective, self.cfg.timesteps, self.architecture)
        return self._objective

    def loss(self, model: nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, cond: dict,
             accelerator) -> torch.Tensor:  # fmt: skip
        """The loss of one batch at timesteps `t` with `noise` (the objective's: flow matching unless the
        architecture says otherwise): training and validation both call this."""
        noisy, t, inputs = self.noised_inputs(x0, noise, t, cond)
        with accelerator.autocast():
            # an engine that owns the model (tuner.distributed.PredictModule) runs `predict` inside itself
            runs_predict = getattr(model, "runs_predict", False)
            pred = model(noisy, t, inputs) if runs_predict else self.predict(model, noisy, t, inputs)
        return self.prediction_loss(pred, x0, noise, t, cond)

    def noised_inputs(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
                      cond: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:  # fmt: skip
        """`loss`'s first half: what `predict` is given (x_t, the objective's t, cond without the loss's
        own entries). Pipeline stages run it on every process and `prediction_loss` on the last."""
        objective = self.training_objective()
        t = objective.discretize(t)  # DDPM: the noise level the model is told is the one it gets
        noisy = objective.add_noise(x0, noise, t).to(DTYPES[self.cfg.model.dtype])
        return noisy, t, {k: v for k, v in cond.items() if k not in _LOSS_ENTRIES}

    def prediction_loss(self, pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
                        cond: dict) -> torch.Tensor:  # fmt: skip
        """`loss`'s second half: the objective's loss of `pred` (t as `noised_inputs` returned it)."""
        weights = cond.get("loss_mask")  # a dataset's cached loss mask (`tuner.data.masks`)
        factor = cond.get("loss_weight")  # a dataset's loss_weight (regularization sets), per sample
        mask = self.loss_mask(x0, {k: v for k, v in cond.items() if k not in _LOSS_ENTRIES})
        if weights is not None:  # [B, 1, *latent grid]: broadcasts over channels
            mask = weights if mask is None else mask * weights
        loss = self.training_objective().loss(pred.float(), x0, noise, t, mask=mask)
        return loss if factor is None else loss * factor.mean()  # a batch holds one dataset: one factor

    # --- the loop --------------------------------------------------------------------------------
    def train(self, resume: str | None = None, log: Callable[[str], None] = print) -> Path:
        """Train and return the path of the final adapter file."""
        with _gc_frozen_while_training(), StopRequest() as stop, contextlib.ExitStack() as cleanup:
            run = self._setup(resume, log)
            cleanup.callback(run.progress.close)  # a run ended by an error too: an open bar redraws at exit
            stop.arm()  # from here SIGTERM / Ctrl-C end the run after its current step (trainers/stop.py)
            while run.pos.step < run.total_steps:
                for batch in run.data.epoch(run.pos.epoch, start=run.pos.batch):
                    if not self._step(run, batch):
                        continue  # gradients accumulate until the group's last batch
                    self._log_step(run)
                    self._maybe_sample(run)
                    self._maybe_validate(run)
                    if run.pos.step >= run.total_steps:
                        break
                    stop.check(self, run, saved=self._maybe_save(run))  # saves and raises if asked to stop
                else:  # the epoch ran out
                    run.pos.epoch, run.pos.batch = run.pos.epoch + 1, 0
                    self._maybe_save(run, epoch_end=True)
            run.progress.close()
            final = self._save(run, final=True)
            _end(run)
            run.log(f"saved {', '.join(map(str, run.checkpoints.written))}")
            return final

    def _setup(self, resume: str | None, log: Callable[[str], None]) -> _Run:
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, set_seed

        from tuner.cache.plan import open_training_data
        from tuner.distributed import launched_processes, strategy_for
        from tuner.optim import build_optimizer, build_scheduler
        from tuner.trainers.checkpoints import Checkpoints, check_output_dir

        cfg, tc, nc = self.cfg, self.cfg.train, self.cfg.network
        out = Path(cfg.save.output_dir)
        check_output_dir(out)  # a file or a read-only folder is named now, not at the first save
        strategy = strategy_for(cfg, launched_processes())
        accelerator = Accelerator(
            mixed_precision=tc.mixed_precision,
            log_with="tensorboard" if cfg.log.tensorboard else None,
            project_dir=str(out / "logs"),
            # the schedule counts optimizer steps: accelerate otherwise steps it once per process per step
            # (it assumes its own loaders grew the batch N-fold; tuner shards the batches itself)
            dataloader_config=DataLoaderConfiguration(split_batches=True),
            **strategy.accelerator_kwargs(),
        )
        strategy.check(self, accelerator.num_processes)
        set_seed(tc.seed)
        _freeze_gc()  # the modules imported so far
        if not accelerator.is_main_process:  # one summary and one "saved" line, not one per process
            log = _silent
        # stops here, naming the command to run, if the cache is missing anything or stale
        pin = accelerator.device.type == "cuda"  # batches stacked into pinned memory, copied non-blocking
        data = open_training_data(self, cfg, log, *strategy.data_share(accelerator), pin_memory=pin)
        held_out = None
        if any(spec.validation for spec in cfg.datasets):
            held_out = open_training_data(self, cfg, log, validation=True, pin_memory=pin)

        model = self.load_transformer(DTYPES[cfg.model.dtype])
        self.merge_base_adapters(model)
        model.requires_grad_(False)
        if tc.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        # diffusers checkpoints only in train mode; these models have no dropout to switch on
        model.train(tc.gradient_checkpointing)
        # fp8 storage, attention backend, activation offload and block swap attach here and place the
        # model on the device; the adapter comes after, so it is never quantized or swapped
        with strategy.placing(self, model):  # pipeline stages place only their own blocks
            memory = self.apply_memory(model, cfg.memory, accelerator.device, tc.gradient_accumulation_steps)

        # the adapter (LoRA / LoHa / LoKr, optionally DoRA) or, for a full fine-tune, the weights themselves
        trained = self.build_trained(model)
        trained.to(accelerator.device)
        if nc.network_weights:
            trained.load_weights(nc.network_weights, self.layout.inverse)
        optimizer = trained.prepare_optimizer(
            build_optimizer(
                tc.optimizer, trained.param_groups(tc.learning_rate, nc.loraplus_lr_ratio), tc.learning_rate,
                tc.optimizer_args,
            )
        )  # fmt: skip
        batches_per_epoch = data.batches_per_epoch()
        steps_per_epoch = math.ceil(batches_per_epoch / tc.gradient_accumulation_steps)
        total_steps = tc.max_steps or tc.epochs * steps_per_epoch
        scheduler = build_scheduler(
            tc.lr_scheduler, optimizer, tc.lr_warmup_steps, total_steps, num_cycles=tc.lr_num_cycles
        )
        fused = None
        if tc.fused_backward:  # each parameter steps inside backward (tuner.fused_backward)
            if accelerator.num_processes > 1:
                raise TrainingError(
                    "train.fused_backward runs in one process: gradients are not averaged "
                    "across processes before each parameter steps. Turn it off or use one GPU."
                )
            from tuner.fused_backward import FusedBackward

            fused = FusedBackward(optimizer, trained.parameters())
        model, trained, optimizer = strategy.prepare(self, accelerator, model, trained, optimizer)
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
        identity = {"architecture": self.architecture, **{f"network.{k}": v for k, v in asdict(nc).items()
                                                           if k != "network_weights"}}  # fmt: skip
        schedule = {"total_steps": total_steps, "train.learning_rate": tc.learning_rate,
                    "train.lr_scheduler": tc.lr_scheduler, "train.lr_warmup_steps": tc.lr_warmup_steps,
                    "train.lr_num_cycles": tc.lr_num_cycles}  # fmt: skip
        parts = {"network": trained, "optimizer": optimizer, "scheduler": scheduler}
        if tc.ema_decay:  # part of the state, exported beside each adapter, and in the run's identity
            from tuner.ema import WeightEMA

            parts["ema"] = WeightEMA(trained.parameters(), tc.ema_decay, tc.ema_warmup, tc.ema_on_host)
            identity["train.ema_decay"] = tc.ema_decay
        checkpoints = Checkpoints(out, cfg.save, accelerator, identity, parts, schedule, strategy)
        if accelerator.is_main_process and (note := checkpoints.space_note(trained)):
            log(f"warning: {note}")
        samples = None
        sc = cfg.sample
        if sc.prompts and (sc.every_n_steps or sc.at_start) and accelerator.is_main_process:
            from tuner.trainers.samples import TrainingSamples

            samples = TrainingSamples(self, cfg, accelerator.device, out / "samples")

        # ---- resume ----
        pos = Position()
        if not resume and checkpoints.states():
            raise CheckpointError(
                f"{out} already holds a training run (saved states up to "
                f"{checkpoints.states()[-1].name}); starting over would mix with and then delete them. "
                "Continue it with --resume latest, or set another save.output_dir."
            )
        if resume:
            with strategy.whole_state(trained):
                pos = Position(**checkpoints.load(resume))
            path = checkpoints.resolve(resume)
            log(f"resumed from {path} at step {pos.step}, epoch {pos.epoch + 1}")
            if changes := checkpoints.schedule_changes(path):
                log(f"note: the schedule changed since this state was saved ({'; '.join(changes)}); the "
                    f"learning rate continues from step {pos.step} on the new schedule.")  # fmt: skip

        log(report.summary(self, trained, data, total_steps, steps_per_epoch, accelerator, memory.summary()))
        if plan := strategy.plan(self, accelerator, model, trained, optimizer):
            log(plan)
        for note in data.warnings():  # short buckets train as smaller batches; say so once
            log(f"note: {note}")
        if cfg.log.tensorboard:
            accelerator.init_trackers("tuner", config=report.flat_scalars(cfg))
            board.start(accelerator, out / "logs", log)
        run = _Run(
            accelerator, model, trained, optimizer, scheduler, data, held_out, self.timestep_sampler(),
            checkpoints, samples, report.adapter_metadata(self, data), total_steps,
            _accumulation_groups(batches_per_epoch, tc.gradient_accumulation_steps), pos, log,
        )  # fmt: skip
        if sf := schedule_free(optimizer):
            sf.train()  # schedule-free optimizers take their steps in train mode
        run.metrics = MetricsFile(
            out, cfg.log.every_n_steps, pos.step if resume else None, accelerator.is_main_process
        )
        if samples and sc.at_start and pos.step == 0:
            written = samples.draw(model, trained, 0, log)
            board.log_samples(accelerator, written, 0)
            run.metrics.samples(0, written, sc.prompts)
        run.ema, run.fused, run.strategy = parts.get("ema"), fused, strategy
        run.progress = _progress(total_steps, pos.step, accelerator.is_main_process)
        _freeze_gc()  # the model, data plan and optimizer: long-lived, never garbage
        return run

    def _step(self, run: _Run, batch: dict) -> bool:
        """Forward and backward one batch; at the end of its accumulation group, average the gradients
        over processes, clip, and step the optimizer. Returns whether an optimizer step was taken."""
        pos, tc = run.pos, self.cfg.train
        start, end = run.groups[pos.batch]
        # seeded by the batch's place in the epoch's shared plan (this process's n-th batch is the plan's
        # n·world + rank-th): N processes draw what one process accumulating N batches draws
        gen = torch.Generator().manual_seed(
            _mix(tc.seed, pos.epoch, pos.batch * run.data.world + run.data.rank)
        )
        x0, cond = self._inputs(batch, run.accelerator.device)
        noise = torch.randn(x0.shape, generator=gen).to(x0)
        t = run.sampler.sample(x0.shape[0], generator=gen, seq_len=self.seq_len(x0)).to(x0.device)
        if self.cfg.log.tensorboard and pos.step == 0 and pos.batch == 0:
            board.log_timesteps(run.accelerator, run.sampler, self.seq_len(x0))
        if self.cfg.timesteps.noise_offset:  # drawn after t, so runs without it draw what they always did
            from tuner.ddpm import offset_noise

            noise = offset_noise(noise, self.cfg.timesteps.noise_offset, gen)
        cond = self.draw_conditions(x0, cond, gen)
        with run.strategy.accumulating(run, last=pos.batch + 1 == end):
            loss = run.strategy.loss(self, run, x0, noise, t, cond)
            if run.fused is None:
                run.strategy.backward(run, loss / (end - start))
                run.recent.append(loss.item())  # the one sync per batch, for logging and the finite check
            else:  # backward steps the optimizer: check the loss first, as no update can be taken back
                run.recent.append(loss.item())
                if math.isfinite(run.recent[-1]):
                    run.strategy.backward(run, loss)
        pos.batch += 1
        if pos.batch != end:
            return False
        run.strategy.reduce_gradients(run)
        grad_norm = run.strategy.grad_norm(run, tc.max_grad_norm)
        step_loss = sum(run.recent[-(end - start) :]) / (end - start)
        if math.isfinite(step_loss) and (grad_norm is None or math.isfinite(grad_norm)):
            if run.fused is None:  # fused: every parameter has stepped inside backward
                run.optimizer.step()
            if run.ema:
                run.ema.update()
        else:  # the update is skipped; the schedule and the data move on as if it had been taken
            self._nonfinite_step(run, step_loss, grad_norm)
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        pos.step += 1
        self.history.append(step_loss)
        return True

    def _nonfinite_step(self, run: _Run, step_loss: float, grad_norm: float | None) -> None:
        """Count a step whose loss or gradient is NaN or infinite (its update is skipped); past the allowed
        count, stop the run without saving anything (the last save, if any, stays the newest)."""
        tc, step = self.cfg.train, run.pos.step + 1
        run.skipped += 1
        what = f"loss {step_loss}" if not math.isfinite(step_loss) else f"gradient norm {grad_norm}"
        if run.skipped <= tc.max_nonfinite_steps:
            run.log(
                f"step {step}: {what}; update skipped ({run.skipped} of {tc.max_nonfinite_steps} allowed)"
            )
            return
        finite = [(i + 1, v) for i, v in enumerate(self.history) if math.isfinite(v)]
        last = (
            f"the last finite loss was {finite[-1][1]:.4f} at step {finite[-1][0]}"
            if finite
            else "no step had a finite loss"
        )
        states = run.checkpoints.complete_states()
        saved = f"the last saved state is {states[-1]}" if states else "no state was saved"
        nc = self.cfg.network
        raise TrainingError(
            f"step {step}: {what}; training stopped ({last}; {saved}). Likely causes: a learning rate too "
            f"high for {tc.optimizer} (train.learning_rate = {tc.learning_rate:g}), a large adapter scale "
            f"(network.alpha / rank = {nc.alpha:g} / {nc.rank}), fp16 overflow (use bf16), or damaged cached "
            "latents. Set train.max_nonfinite_steps to skip a few such steps instead of stopping."
        )

    def _log_step(self, run: _Run) -> None:
        now = time.perf_counter()
        self.step_seconds.append(now - run.last_step_end)
        run.last_step_end = now
        step_loss, lr = self.history[-1], run.scheduler.get_last_lr()[0]
        inner = getattr(run.optimizer, "optimizer", run.optimizer)
        if hasattr(
            inner, "mean_lr"
        ):  # per-element rates (Automagic): their mean, the schedule's scale included
            lr = inner.mean_lr() * lr / inner.param_groups[0]["start_lr"]
        run.progress.update(1)
        # refresh=False: the bar redraws on its own clock (mininterval), not on every step
        finite = [v for v in run.recent if math.isfinite(v)]  # skipped NaN steps must not poison the mean
        avg = sum(finite) / max(1, len(finite))
        run.progress.set_postfix(loss=f"{step_loss:.4f}", avg=f"{avg:.4f}", lr=f"{lr:.2e}", refresh=False)
        run.metrics.step(run.pos.step, run.pos.epoch, run.total_steps, step_loss, avg, lr, self.step_seconds)
        if self.cfg.log.tensorboard and run.pos.step % self.cfg.log.every_n_steps == 0:
            metrics = {"loss": step_loss, "lr": lr, "step_seconds": self.step_seconds[-1]}
            run.accelerator.log(metrics, step=run.pos.step)

    def _maybe_sample(self, run: _Run) -> None:
        sc = self.cfg.sample
        if sc.every_n_steps and run.pos.step % sc.every_n_steps == 0 and sc.prompts:
            if run.samples:  # the main process draws; the others wait for it
                ema = run.ema.applied() if run.ema and sc.use_ema else contextlib.nullcontext()
                with averaged_weights(run.optimizer), ema:
                    written = run.samples.draw(run.model, run.trained, run.pos.step, run.log)
                    board.log_samples(run.accelerator, written, run.pos.step)
                    run.metrics.samples(run.pos.step, written, sc.prompts)
            run.accelerator.wait_for_everyone()

    def _maybe_validate(self, run: _Run) -> None:
        every, step = self.cfg.train.validate_every_n_steps, run.pos.step
        if run.held_out and ((every and step % every == 0) or step >= run.total_steps):
            with averaged_weights(run.optimizer):
                val_loss = self.validation_loss(run.model, run.trained, run.held_out, run.accelerator)
            self.val_history.append((step, val_loss))
            run.log(f"step {step}: validation loss {val_loss:.4f}")
            run.metrics.validation(step, val_loss)
            if self.cfg.log.tensorboard:
                run.accelerator.log({"val_loss": val_loss}, step=step)

    def _maybe_save(self, run: _Run, epoch_end: bool = False) -> bool:
        """Save every N steps, or every N epochs at an epoch's end (the final save is `train`'s); return
        whether it saved."""
        sc, pos = self.cfg.save, run.pos
        due = (sc.every_n_epochs and pos.epoch % sc.every_n_epochs == 0 and pos.step < run.total_steps
               if epoch_end else sc.every_n_steps and pos.step % sc.every_n_steps == 0)  # fmt: skip
        if due:
            self._save(run)
        return bool(due)

    def _save(self, run: _Run, final: bool = False) -> Path:
        """Save the state and the adapter at the current position, with every process's share of the
        trained weights and optimizer state gathered first (sharding and pipeline strategies)."""
        with run.strategy.whole_state(run.trained):
            return run.checkpoints.save(run.trained, run.pos, run.metadata, self.export_layout(), final=final)

    def validation_loss(self, model: nn.Module, trained: nn.Module, held_out, accelerator) -> float:
        """Mean loss on the held-out batches at fixed timesteps with fixed noise, so values
        at different steps compare. Draws nothing from the global random state."""
        cfg = self.cfg
        trained.eval()
        losses = []
        with torch.no_grad():
            for i, batch in enumerate(held_out.epoch(0)):
                x0, cond = self._inputs(batch, accelerator.device)
                for j, t_value in enumerate(cfg.train.validation_timesteps):
                    gen = torch.Generator().manual_seed(_mix(cfg.train.seed, i, j))
                    noise = torch.randn(x0.shape, generator=gen).to(x0)
                    t = torch.full((x0.shape[0],), t_value, device=x0.device)
                    drawn = self.draw_conditions(x0, cond, gen)
                    losses.append(self.loss(model, x0, noise, t, drawn, accelerator).item())
        trained.train()
        return sum(losses) / len(losses)

    # --- derived from the data above -------------------------------------------------------------
    def valid_frame_count(self, n: int) -> bool:
        return n >= 1 and (n - self.frame_remainder) % self.frame_multiple == 0

    def timestep_sampler(self):
        """The configured training-timestep sampler, with mode "auto" resolved to this model's usual one."""
        from dataclasses import replace

        from tuner.timesteps import sampler_from_config

        section = self.cfg.timesteps
        if section.mode == "auto":
            section = replace(section, mode=self.timestep_mode)
        return sampler_from_config(section)

    def default_sample_shift(self, latent_shape: tuple[int, ...]) -> float:
        """Flow shift for sampling a latent of this shape (without batch): a constant, or the model's
        resolution-dependent shift (FLUX.1, Qwen-Image) evaluated at its token count."""
        from tuner.timesteps import RESOLUTION_SHIFTS

        if isinstance(self.sample_shift, str):
            tokens = math.prod(latent_shape[1:]) // math.prod(self.latent_patch)
            return math.exp(RESOLUTION_SHIFTS[self.sample_shift].mu(tokens))
        return float(self.sample_shift)

    def seq_len(self, latents: torch.Tensor) -> int:
        """Tokens per sample (for resolution-dependent timestep shifts)."""
        return math.prod(latents.shape[2:]) // math.prod(self.latent_patch)

    def _inputs(self, batch: dict, device) -> tuple[torch.Tensor, dict]:
        """A cached batch as model inputs on `device`: clean latents, and cond (text + extra latents)."""
        cond = {**self.collate_text(batch["text"]), **batch["extra"]}
        # non_blocking: a pinned batch (see TrainingData) is copied while the host goes on; a no-op elsewhere
        return batch["latents"].to(device, non_blocking=True), {
            k: v.to(device, non_blocking=True) for k, v in cond.items()
        }


# entries of a batch's cond that the loss reads and the model is not given
_LOSS_ENTRIES = ("loss_mask", "loss_weight")


def _end(run: _Run) -> None:
    """Close the trackers and the process group, all processes together: a process that tears its gloo
    connections down while another still reads them makes that one abort ("terminate called without an
    active exception") after the run's work is done."""
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()


def _freeze_gc() -> None:
    """Move every object alive now out of the garbage collector's reach. torch, diffusers and a loaded
    model are millions of long-lived objects; without this, each full collection (set off by the
    per-item allocations of opening a large dataset: 0.17 s per 1,000 items before the first step,
    measured with benchmarks/startup.py; and now and then by a training step) walks all of them again.
    They are given back to the collector when training ends (`_gc_frozen_while_training`)."""
    import gc

    gc.freeze()


@contextlib.contextmanager
def _gc_frozen_while_training() -> Iterator[None]:
    import gc

    try:
        yield
    finally:
        gc.unfreeze()  # what was frozen and is garbage now (a caller's second run) is collected again


def _silent(_: str) -> None:
    pass


def _accumulation_groups(n_batches: int, accum: int) -> list[tuple[int, int]]:
    """For each batch index, the [start, end) range of its accumulation group; the last may be short."""
    groups = []
    for start in range(0, n_batches, accum):
        end = min(start + accum, n_batches)
        groups += [(start, end)] * (end - start)
    return groups


def _mix(*values: int) -> int:
    """A 63-bit seed from several integers (so nearby positions get unrelated streams)."""
    h = 1469598103934665603
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="steps", dynamic_ncols=True,
                smoothing=0.1, mininterval=0.5)  # fmt: skip
