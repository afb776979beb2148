"""NetworkTrainer: the one training loop every architecture shares.

An architecture is a subclass that says what differs (which checkpoints to load, how to encode a batch
for the cache, how to call its model, its default adapter targets and export names) and never touches
the loop. The loop reads top to bottom:

    setup      accelerator, seed, cached batches (checked for staleness), model, adapter, optimizer
    resume     accelerate state + our position (step, epoch, batch within the epoch)
    loop       noise → x_t → predict → flow-matching loss → backward (accumulate) → clip → step
    log/save   progress bar, TensorBoard, adapter + full state every N steps/epochs, keep the last K

Everything random in a step (noise, timesteps, caption dropout, batch order) comes from generators
seeded by the config seed and the step's position, not from global RNG state. That is what makes a
resumed run identical to an uninterrupted one; accelerate's saved RNG states cover the rest (dropout).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from tuner.config import Config
from tuner.errors import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Position:
    """Where training stands; saved with every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch (0-based)
    batch: int = 0  # batches of the current epoch already consumed


class NetworkTrainer:
    """Base class: the training loop. Subclasses implement the architecture-specific methods below."""

    # --- what an architecture declares (data) ----------------------------------------------------
    architecture: ClassVar[str]
    spatial_step: ClassVar[int]  # pixels per latent token side (VAE factor × patch size)
    frame_multiple: ClassVar[int] = 1  # valid frame counts are frame_multiple·N + frame_remainder
    frame_remainder: ClassVar[int] = 0
    model_fps: ClassVar[float] = 16.0
    supports_video: ClassVar[bool] = False  # image-only models refuse video datasets at load time
    control_images: ClassVar[tuple[int, int]] = (0, 0)  # (fewest, most) control images per item (edit models)
    text_uses_controls: ClassVar[bool] = False  # the text encoder also sees the control images (Qwen-Edit)
    timestep_mode: ClassVar[str] = "shift"  # what timesteps.mode = "auto" means for this model
    sample_shift: ClassVar[float | str] = 3.0  # generate's default flow shift, or a RESOLUTION_SHIFTS name
    latent_patch: ClassVar[tuple[int, ...]] = (1, 2, 2)  # latent elements per token along (F, H, W)
    default_targets: ClassVar[tuple[str, ...]]  # regexes over diffusers module names
    cache_format_version: ClassVar[int] = 1

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.history: list[float] = []  # loss of each optimizer step, for tests and callers
        self.step_seconds: list[float] = []  # wall time of each optimizer step (data wait included)
        self.val_history: list[tuple[int, float]] = []  # (step, validation loss)

    # --- what an architecture implements -------------------------------------------------------
    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def load_text_encoder(self, device: torch.device, dtype: torch.dtype):
        """Return whatever `encode_text` needs (e.g. a (model, tokenizer) pair)."""
        raise NotImplementedError

    def encode_pixels(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, F, H, W] in [-1, 1] → normalized latents [B, ...]."""
        raise NotImplementedError

    def encode_latents(
        self, vae: nn.Module, pixels: torch.Tensor, controls: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """One latent cache entry per item, batched: the target `latents` plus one `control_<i>` per
        control/reference image (edit models). Each value is [B, ...]."""
        out = {"latents": self.encode_pixels(vae, pixels)}
        for i, control in enumerate(controls):
            out[f"control_{i}"] = self.encode_pixels(vae, control)
        return out

    def encode_text(
        self, encoder, captions: list[str], controls: list[list[torch.Tensor]] | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """Captions → one dict of tensors per caption, as stored in the cache. With
        `text_uses_controls`, `controls` holds each caption's control images ([3, 1, H, W] in [-1, 1])."""
        raise NotImplementedError

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """Model output for x_t at t ∈ [0, 1] (shape of `noisy`). `cond` holds what `collate_text`
        returned plus the batch's other latent tensors (e.g. `control_0`), all on the model's device."""
        raise NotImplementedError

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stack a batch of cached text entries into model inputs."""
        raise NotImplementedError

    def export_name(self, module_name: str) -> str:
        """diffusers module name → the original release's name used in saved adapters."""
        return module_name

    def import_name(self, original_name: str) -> str:
        """Inverse of `export_name`."""
        return original_name

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents → pixels [B, C, F, H, W] in [-1, 1]."""
        raise NotImplementedError

    def latent_shape(self, width: int, height: int, frames: int) -> tuple[int, ...]:
        """Latent shape (without batch) of a sample of this size."""
        raise NotImplementedError

    # --- shared helpers --------------------------------------------------------------------------
    @staticmethod
    def text_encoder_load_dtype(precision: str) -> torch.dtype:
        """The dtype to load a text encoder in for `cache.text_encoder_dtype`: as named, or bf16 before
        fp8 / int8 / nf4 quantization."""
        return DTYPES.get(precision, torch.bfloat16)

    @staticmethod
    def place_text_encoder(model: nn.Module, precision: str, device: torch.device) -> nn.Module:
        """Quantize a loaded text encoder when `precision` asks for it (fp8 / int8 / nf4), then move it."""
        if precision in ("fp8", "int8", "nf4"):
            from tuner.memory import quantize_text_encoder

            quantize_text_encoder(model, precision, device)
        return model.to(device)

    def valid_frame_count(self, n: int) -> bool:
        return n >= 1 and (n - self.frame_remainder) % self.frame_multiple == 0

    def weights_path(self, component: str) -> str:
        """Path of a model component from the config, with a clear error if it is not set."""
        path = getattr(self.cfg.model, component)
        if not path:
            raise CheckpointError(
                f"{self.cfg.path}: key 'model.{component}' is not set; this command needs it."
            )
        return path

    # --- the loop --------------------------------------------------------------------------------
    def train(self, resume: str | None = None, log: Callable[[str], None] = print) -> Path:
        """Train and return the path of the final adapter file."""
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        from tuner.cache.plan import open_training_data
        from tuner.memory import apply_memory_settings
        from tuner.networks.factory import build_network
        from tuner.optim import build_optimizer, build_scheduler
        from tuner.timesteps import add_noise, flow_loss, flow_target
        from tuner.trainers.checkpoints import Checkpoints

        cfg, tc = self.cfg, self.cfg.train
        out = Path(cfg.save.output_dir)

        # ---- setup ----
        accelerator = Accelerator(
            mixed_precision=tc.mixed_precision,
            log_with="tensorboard" if cfg.log.tensorboard else None,
            project_dir=str(out / "logs"),
        )
        set_seed(tc.seed)
        if not accelerator.is_main_process:  # one summary and one "saved" line, not one per process
            log = _silent
        # stops here, naming the command to run, if the cache is missing anything or stale
        data = open_training_data(self, cfg, log, accelerator.process_index, accelerator.num_processes)
        held_out = None
        if any(spec.validation for spec in cfg.datasets):
            held_out = open_training_data(self, cfg, log, validation=True)
        model = self.load_transformer(DTYPES[cfg.model.dtype])
        model.requires_grad_(False)
        if tc.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        # diffusers checkpoints only in train mode; these models have no dropout to switch on
        model.train(tc.gradient_checkpointing)
        # fp8 storage, attention backend, activation offload and block swap attach here and place the
        # model on the device; the adapter comes after, so it is never quantized or swapped
        memory = apply_memory_settings(
            model, cfg.memory, accelerator.device, fp8_source=cfg.model.transformer, name_map=self.import_name,
            probe_forwards=tc.gradient_accumulation_steps,
        )  # fmt: skip

        nc = cfg.network
        # the adapter (LoRA / LoHa / LoKr, optionally DoRA) or, for a full fine-tune, the weights themselves
        trained = build_network(model, self.default_targets, nc, self.export_name, seed=tc.seed)
        trained.to(accelerator.device)
        if nc.network_weights:
            trained.load_weights(nc.network_weights, self.import_name)
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
        # The adapter is not wrapped in DDP: the base model's forward calls it, never DDP's forward, so
        # DDP would not synchronize it. Its gradients are averaged explicitly at each optimizer step, and
        # it is registered so that accelerate's saved state includes it.
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
        accelerator.register_for_checkpointing(trained)
        sampler = self.timestep_sampler()
        identity = {"architecture": self.architecture, **{f"network.{k}": v for k, v in asdict(nc).items()
                                                           if k != "network_weights"}}  # fmt: skip
        checkpoints = Checkpoints(out, cfg.save, accelerator, identity)

        samples = None
        sc = cfg.sample
        if sc.prompts and (sc.every_n_steps or sc.at_start) and accelerator.is_main_process:
            from tuner.trainers.samples import TrainingSamples

            samples = TrainingSamples(self, cfg, accelerator.device, out / "samples")

        # ---- resume ----
        pos = Position()
        if not resume and checkpoints.complete_states():
            raise CheckpointError(
                f"{out} already holds a training run (saved states up to "
                f"{checkpoints.complete_states()[-1].name}); starting over would mix with and then delete them. "
                "Continue it with --resume latest, or set another save.output_dir."
            )
        if resume:
            pos = Position(**checkpoints.load(resume))
            log(f"resumed from {checkpoints.resolve(resume)} at step {pos.step}, epoch {pos.epoch + 1}")

        self._print_summary(log, trained, data, total_steps, steps_per_epoch, accelerator, memory.summary())
        for note in data.warnings():  # short buckets train as smaller batches; say so once
            log(f"note: {note}")
        if cfg.log.tensorboard:
            accelerator.init_trackers("tuner", config=_flat_scalars(cfg))

        # ---- loop ----
        metadata = self.adapter_metadata(data)
        if samples and sc.at_start and pos.step == 0:
            samples.draw(model, trained, 0, log)
        progress = _progress(total_steps, pos.step, accelerator.is_main_process)
        recent: list[float] = []
        last_step_end = time.perf_counter()
        while pos.step < total_steps:
            accum = _accumulation_groups(batches_per_epoch, tc.gradient_accumulation_steps)
            for batch in data.epoch(pos.epoch, start=pos.batch):
                group = accum[pos.batch]
                gen = torch.Generator().manual_seed(_mix(tc.seed, pos.epoch, pos.batch))
                x0, cond = self._inputs(batch, accelerator.device)
                noise = torch.randn(x0.shape, generator=gen).to(x0)
                t = sampler.sample(x0.shape[0], generator=gen, seq_len=self.seq_len(x0)).to(x0.device)
                last_of_group = pos.batch == group[1] - 1
                with accelerator.autocast():
                    pred = self.predict(model, add_noise(x0, noise, t).to(DTYPES[cfg.model.dtype]), t, cond)
                loss = flow_loss(
                    pred.float(), flow_target(x0, noise).float(), t, cfg.timesteps.loss_weighting
                )
                accelerator.backward(loss / (group[1] - group[0]))
                recent.append(loss.item())
                pos.batch += 1
                if not last_of_group:
                    continue
                _average_gradients(trained, accelerator)
                if tc.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(trained.parameters(), tc.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                pos.step += 1

                step_loss = sum(recent[-(group[1] - group[0]) :]) / (group[1] - group[0])
                self.history.append(step_loss)
                self.step_seconds.append(time.perf_counter() - last_step_end)
                last_step_end = time.perf_counter()
                lr = scheduler.get_last_lr()[0]
                progress.update(1)
                # refresh=False: the bar redraws on its own clock (mininterval), not on every step
                progress.set_postfix(
                    loss=f"{step_loss:.4f}",
                    avg=f"{sum(recent) / len(recent):.4f}",
                    lr=f"{lr:.2e}",
                    refresh=False,
                )
                if cfg.log.tensorboard and pos.step % cfg.log.every_n_steps == 0:
                    accelerator.log(
                        {"loss": step_loss, "lr": lr, "step_seconds": self.step_seconds[-1]}, step=pos.step
                    )
                if sc.every_n_steps and pos.step % sc.every_n_steps == 0 and sc.prompts:
                    if samples:
                        samples.draw(model, trained, pos.step, log)
                    accelerator.wait_for_everyone()
                every = tc.validate_every_n_steps
                if held_out and ((every and pos.step % every == 0) or pos.step >= total_steps):
                    val_loss = self.validation_loss(model, trained, held_out, accelerator)
                    self.val_history.append((pos.step, val_loss))
                    log(f"step {pos.step}: validation loss {val_loss:.4f}")
                    if cfg.log.tensorboard:
                        accelerator.log({"val_loss": val_loss}, step=pos.step)
                if pos.step >= total_steps:
                    break
                if cfg.save.every_n_steps and pos.step % cfg.save.every_n_steps == 0:
                    checkpoints.save(trained, pos, metadata, self.export_name)
            else:  # the epoch ran out
                pos.epoch, pos.batch = pos.epoch + 1, 0
                if (
                    cfg.save.every_n_epochs
                    and pos.epoch % cfg.save.every_n_epochs == 0
                    and pos.step < total_steps
                ):
                    checkpoints.save(trained, pos, metadata, self.export_name)

        # ---- finish ----
        progress.close()
        final = checkpoints.save(trained, pos, metadata, self.export_name, final=True)
        accelerator.end_training()
        log(f"saved {final}")
        return final

    def combine_guidance(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance as the model's own pipeline applies it (plain by default)."""
        return v_uncond + scale * (v_cond - v_uncond)

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

    def _inputs(self, batch: dict, device) -> tuple[torch.Tensor, dict]:
        """A cached batch as model inputs on `device`: clean latents, and cond (text + extra latents)."""
        cond = {**self.collate_text(batch["text"]), **batch["extra"]}
        return batch["latents"].to(device), {k: v.to(device) for k, v in cond.items()}

    def validation_loss(self, model: nn.Module, trained: nn.Module, held_out, accelerator) -> float:
        """Mean flow-matching loss on the held-out batches at fixed timesteps with fixed noise, so values
        at different steps compare. Draws nothing from the global random state."""
        from tuner.timesteps import add_noise, flow_loss, flow_target

        cfg = self.cfg
        trained.eval()
        losses = []
        with torch.no_grad():
            for i, batch in enumerate(held_out.epoch(0)):
                x0, cond = self._inputs(batch, accelerator.device)
                for j, t_value in enumerate(cfg.train.validation_timesteps):
                    noise = torch.randn(
                        x0.shape, generator=torch.Generator().manual_seed(_mix(cfg.train.seed, i, j))
                    )
                    t = torch.full((x0.shape[0],), t_value, device=x0.device)
                    noisy = add_noise(x0, noise.to(x0), t).to(DTYPES[cfg.model.dtype])
                    with accelerator.autocast():
                        pred = self.predict(model, noisy, t, cond)
                    target = flow_target(x0, noise.to(x0)).float()
                    losses.append(flow_loss(pred.float(), target, t, cfg.timesteps.loss_weighting).item())
        trained.train()
        return sum(losses) / len(losses)

    def seq_len(self, latents: torch.Tensor) -> int:
        """Tokens per sample (for resolution-dependent timestep shifts)."""
        return math.prod(latents.shape[2:]) // math.prod(self.latent_patch)

    def adapter_metadata(self, data) -> dict:
        """What a saved adapter records about how it was trained."""
        from tuner.cache.keys import fingerprint_weights

        cfg = self.cfg
        return {
            "tuner.architecture": self.architecture,
            "tuner.base_model": Path(cfg.model.transformer).name,
            "tuner.base_model_fingerprint": fingerprint_weights(cfg.model.transformer),
            "tuner.dataset": json.dumps(data.summary()),
            "tuner.training": json.dumps(
                {**asdict(cfg.train), "timesteps": asdict(cfg.timesteps), "network": asdict(cfg.network)}
            ),
        }

    def _print_summary(
        self, log, network, data, total_steps, steps_per_epoch, accelerator, memory: str
    ) -> None:
        cfg, tc = self.cfg, self.cfg.train
        trainable = sum(p.numel() for p in network.parameters() if p.requires_grad)
        nc = cfg.network
        full = nc.type == "full"
        what = "a full fine-tune" if full else (
            f"a {nc.type}{' + DoRA' if nc.dora else ''} (rank {nc.rank}, alpha {nc.alpha})"
        )  # fmt: skip
        batch = data.summary()
        log(
            "\n".join(
                [
                    f"tuner: training {what} on {self.architecture}",
                    f"  trainable parameters  {trainable:,} in {len(network)} modules",
                    f"  data                  {batch['samples']} samples, {batch['batches_per_epoch']} batches/epoch, "
                    f"buckets {', '.join(batch['buckets'])}",
                    f"  steps                 {total_steps} ({steps_per_epoch}/epoch), effective batch "
                    f"{batch['batch_size']} × {tc.gradient_accumulation_steps} accumulation × "
                    f"{accelerator.num_processes} process(es)",
                    f"  precision             base {cfg.model.dtype}, autocast {tc.mixed_precision}"
                    + ("" if full else ", adapter fp32"),
                    f"  memory                gradient checkpointing {'on' if tc.gradient_checkpointing else 'off'}; "
                    f"{memory}",
                    f"  device                {accelerator.device}",
                    f"  output                {cfg.save.output_dir}",
                ]
            )
        )


def _average_gradients(network: nn.Module, accelerator) -> None:
    """Average the trainable gradients over processes with one all-reduce of a flat buffer."""
    if accelerator.num_processes == 1:
        return
    grads = [p.grad for p in network.parameters() if p.requires_grad and p.grad is not None]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= accelerator.num_processes
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


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


def _flat_scalars(cfg: Config) -> dict:
    flat = {}
    for section in ("train", "network", "timesteps"):
        for k, v in asdict(getattr(cfg, section)).items():
            if isinstance(v, int | float | str | bool):
                flat[f"{section}.{k}"] = v
    return flat


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        desc="steps",
        dynamic_ncols=True,
        smoothing=0.1,
        mininterval=0.5,
    )
