"""`ArchitectureModel`: what an architecture computes, apart from any training loop.

A family folder (`tuner/archs/<family>/`) subclasses it: how to load its checkpoints, encode a batch for
the cache, build the model's inputs and call it, decode, and shape generation's noise. Everything else
about the architecture is data on its record (`tuner.archs.record.Architecture`: spatial step, frame
rule, timestep mode, objective, ...), which the helpers here read. Caching (`tuner.cache`) and
generation (`tuner.generate`) build one with `record.family_model(cfg)`; training combines it with the
loop (`tuner.trainers.trainer_class`: `NetworkTrainer` over the family's class). Nothing here imports
`tuner.trainers`.
"""

from __future__ import annotations

import math
import warnings
from typing import ClassVar

import torch
from torch import nn

from tuner import registry
from tuner.archs.parts import experts, text_encoder_training
from tuner.archs.record import SamplingDefaults
from tuner.config import Config
from tuner.dtypes import DTYPES
from tuner.errors import CheckpointError, ConfigError, TrainingError
from tuner.memory import place_text_encoder

# entries of a batch's cond that the loss reads and the model is not given
_LOSS_ENTRIES = ("loss_mask", "loss_weight")


class ArchitectureModel:
    """What one architecture computes; family classes implement the methods without a default."""

    architecture: ClassVar[str]  # the name of its record in tuner.registry

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.record = registry.architecture(self.architecture)
        # diffusers module name -> the release's (a name map carrying the fused layers); `.inverse` goes
        # back. Saved adapters and full fine-tunes use the release's names, so they load in ComfyUI.
        self.layout = self.record.checkpoint_layout()
        self._objective = None  # `training_objective()`, built on first use
        # the text encoders training adapts (`tuner.archs.parts.text_encoder_training`), once built
        self.trained_text: nn.Module | None = None

    @property
    def default_targets(self) -> tuple[str, ...]:
        return self.record.default_targets

    @property
    def boundary(self) -> float | None:
        """Two-expert models (`tuner.archs.parts.experts`): the t where denoising switches experts
        (`model.boundary`, else the record's); None for models with one transformer."""
        if self.record.boundary is None:
            return None
        return self.cfg.model.boundary or self.record.boundary

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
        return {"latents": self.encode_pixels(vae, pixels), **self.encode_controls(vae, controls)}

    def encode_controls(self, vae: nn.Module, controls: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The cached `control_<i>` of a batch's control images or videos (each [B, 3, F, H, W] in [-1, 1];
        caching and generation): their latents, or what the record's `control_encoder` makes of them."""
        if (encode := self.record.control_encoder_function()) is not None:
            return encode(self, vae, controls)
        return {f"control_{i}": self.encode_pixels(vae, control) for i, control in enumerate(controls)}

    def sound_stream(self):
        """Audio-video models (`audio_format` set): the record's `sound_stream` (`tuner.archs.parts.audio`)
        for this model."""
        stream = self.record.sound_stream_class()
        if stream is None:
            raise NotImplementedError(f"{self.architecture} learns no sound (audio_format is None)")
        return stream(self)

    def encode_frame_images(
        self, encoder, images: list[torch.Tensor], frames: int
    ) -> dict[str, torch.Tensor]:
        """Image-to-video models (`frame_images` > 0): the latent-entry tensors other than `latents` that the
        given frame images ([B, 3, H, W] in [-1, 1]) of a `frames`-frame video make; generation uses it.
        One-frame models laid out as "frames" (`Architecture.one_frame`) take their reference images here."""
        raise NotImplementedError

    def encode_text(
        self, encoder, captions: list[str], controls: list[list[torch.Tensor]] | None
    ) -> list[dict[str, torch.Tensor]]:
        """Captions → one dict of tensors per caption, as stored in the cache. `controls` holds each
        caption's control images ([3, 1, H, W] in [-1, 1]) for an architecture whose text encoder sees
        them (`text_uses_controls`), else None; other architectures ignore it."""
        raise NotImplementedError

    def collate_text(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A batch of cached text entries as model inputs: each tensor stacked, for entries of one length
        (padded to `cache.text_max_length`, which is part of their cache key). Families whose entries keep
        their prompt's length pad them here."""
        return {name: torch.stack([e[name] for e in entries]) for name in entries[0]}

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
                    guidance_scale: float, progress: bool = False,
                    guidance_method: str = "auto") -> torch.Tensor:  # fmt: skip
        """Generation's denoising of a flow model: Euler steps from `noise` along `sigmas`, in one pass over
        the whole latent or in the parts the record's `flow_sampler` cuts it into (FramePack's sections);
        a record's `flow_schedule` replaces `sigmas` by its own levels, as many steps. `guidance_method`
        "auto" guides as the release does (the record's `sample_guidance` APG, else CFG), "cfg" with
        classifier-free guidance."""
        from tuner.diffusion.guidance import AdaptiveProjectedGuidance, ProjectedGuidance
        from tuner.diffusion.sampling import euler_sample

        if (schedule := self.record.flow_schedule_function()) is not None:
            sigmas = schedule(len(sigmas) - 1, noise).to(sigmas.device)
        if self.record.flow_prediction == "x0":  # networks predicting x0: sampled along their velocity
            objective = self.training_objective()
            predict, noise = model_fn, objective.initial_noise(noise)

            def model_fn(x: torch.Tensor, t: torch.Tensor, c: dict) -> torch.Tensor:
                return objective.velocity(x, t / 1000, predict(x, t, c))

        settings = self.record.sample_guidance if guidance_method != "cfg" else ()
        apg = ProjectedGuidance(**dict(settings)) if settings else None

        def denoise(noise: torch.Tensor, cond: dict, uncond: dict) -> torch.Tensor:
            combine = self.combine_guidance if apg is None else AdaptiveProjectedGuidance(apg)
            return euler_sample(model_fn, noise, sigmas, cond, uncond, guidance_scale, progress=progress,
                                combine=combine, next_time=self.record.flow_next_time)  # fmt: skip

        in_parts = self.record.flow_sampler_function()
        return denoise(noise, cond, uncond) if in_parts is None else in_parts(denoise, noise, cond, uncond)

    def pipeline_parts(self, model: nn.Module):
        """The model's forward cut where pipeline stages may split it (`distributed.strategy = "pipeline"`):
        a `tuner.archs.stages.PipelineParts` whose prologue, blocks and epilogue compute exactly
        what `predict` does, passing only tensors between blocks. Architectures that have one override this;
        one that cannot keeps this refusal and says why in its record (`Architecture.pipeline_refused`),
        and a subclass whose `predict` differs cuts its own or sets it back to `ArchitectureModel.pipeline_parts`."""
        raise ConfigError(pipeline_unavailable(self.architecture))

    # --- text encoders that train (`network.train_text_encoder`, SDXL) ---------------------------
    def text_encoders(self):
        """Models whose text encoders may train: the record's `text_encoder_training`
        (`tuner.archs.parts.text_encoder_training`) for this model."""
        part = self.record.text_encoder_training_class()
        if part is None:
            raise NotImplementedError(f"{self.architecture} trains no text encoder")
        return part(self)

    @property
    def trains_text_encoder(self) -> bool:
        """Whether the text encoders train: their outputs are then computed at every step, not cached.
        Every command that caches or trains asks, so a model that cannot is refused before any work."""
        nc = self.cfg.network
        trainable = bool(self.record.text_encoder_training)
        if nc.train_text_encoder and (not trainable or nc.type == "full"):
            raise ConfigError(
                f"{self.cfg.path}: network.train_text_encoder: "
                + (f"{self.architecture} trains no text encoder adapter" if not trainable
                   else "a full fine-tune trains the denoiser only; use an adapter type")
            )  # fmt: skip
        return nc.train_text_encoder

    # --- for the subclasses ----------------------------------------------------------------------
    def weights_path(self, component: str) -> str:
        """Path of a model component from the config, with a clear error if it is not set."""
        path = getattr(self.cfg.model, component)
        if not path:
            raise CheckpointError(
                f"{self.cfg.path}: key 'model.{component}' is not set; this command needs it."
            )
        return path

    def place_text_encoders(self, dtype: str, device: torch.device, *models: nn.Module | None) -> None:
        """Quantize and place loaded text encoders to encode prompts (`tuner.memory.place_text_encoder`, streaming
        `cache.text_encoder_blocks_to_swap` layers); absent ones (None) are skipped."""
        for model in models:
            if model is not None:
                place_text_encoder(model, dtype, device, self.cfg.cache.text_encoder_blocks_to_swap)

    def single_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, 1, H, W] → the images [B, C, H, W] an image model encodes; a clip of more frames is
        refused."""
        if pixels.shape[2] != 1:
            raise ConfigError(f"{self.architecture} encodes single images, got {pixels.shape[2]} frames.")
        return pixels[:, :, 0]

    # --- placing and adapting the loaded model (two experts: once per expert) -------------------------
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
        """`tuner.memory.apply_memory_settings` on what `load_transformer` returned (on each of two
        experts); returns its handle."""
        from tuner.memory import apply_memory_settings

        def apply(module: nn.Module, field: str = "transformer"):
            return apply_memory_settings(
                module, settings, device, block_lists=self.record.block_lists,
                fp8_source=getattr(self.cfg.model, field), name_map=self.layout.inverse,
                probe_forwards=probe_forwards, compile=self.cfg.train.compile,
            )  # fmt: skip

        if isinstance(model, experts.TimestepExperts):
            return experts.apply_memory_per_expert(model, apply, settings.blocks_to_swap, device)
        return apply(model)

    def export_layout(self):
        """The layout saved files are written through: the architecture's, or for a full fine-tune the
        record's `full_layout` (SDXL's bundled checkpoint UIs load, the UNet beside the VAE and both text
        encoders)."""
        full = self.cfg.network.type == "full" and self.cfg.save.format != "diffusers"
        return self.record.full_layout_function()(self) if full and self.record.full_layout else self.layout

    def build_trained(self, model: nn.Module):
        """What trains (`tuner.networks.build_network` from the `[network]` section) on that model: one
        adapter per expert on two experts (`model.expert = "both"`), after the record's `training_warning`;
        with `network.train_text_encoder` joined with one on the text encoders
        (`tuner.archs.parts.text_encoder_training`)."""
        from tuner.networks.factory import build_network

        if isinstance(model, experts.TimestepExperts):
            return experts.ExpertAdapters(*(self.build_trained(model.expert(n)) for n in experts.EXPERTS))
        cfg = self.cfg
        check = self.record.training_warning_function()
        if check is not None and (message := check(cfg)):
            warnings.warn(message, UserWarning, stacklevel=2)
        network = build_network(
            model,
            self.default_targets,
            cfg.network,
            self.layout,
            seed=cfg.train.seed,
            save_format=cfg.save.format,
        )
        if not self.trains_text_encoder:
            return network
        return text_encoder_training.join_text_adapters(self, network, next(model.parameters()).device)

    # --- the one loss ------------------------------------------------------------------------------
    def training_objective(self):
        """What the model is trained on: flow matching (`tuner.diffusion.timesteps.FlowObjective`; for
        networks predicting x0, `X0FlowObjective` with the record's noise scale), or for
        `objective = "ddpm"` architectures the DDPM schedule with the configured prediction type and
        weights (`tuner.diffusion.ddpm.DDPMObjective`), for `"edm"` ones EDM's (`tuner.diffusion.edm`)."""
        if self._objective is None:
            from dataclasses import fields

            from tuner.diffusion.ddpm import objective_from_config
            from tuner.diffusion.timesteps import X0FlowObjective

            objective = objective_from_config(self.record.objective, self.cfg.timesteps, self.architecture)
            if self.record.flow_prediction == "x0":
                scale, clip = self.record.noise_scale(self.cfg.model.transformer)
                given = {f.name: getattr(objective, f.name) for f in fields(objective)}
                objective = X0FlowObjective(**given, noise_scale=scale, noise_clip_std=clip)
            self._objective = objective
        return self._objective

    def loss(self, model: nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, cond: dict,
             accelerator) -> torch.Tensor:  # fmt: skip
        """The loss of one batch at timesteps `t` with `noise` (the objective's: flow matching unless the
        architecture says otherwise; both streams' for audio-video models): training and validation both
        call this."""
        if self.record.sound_stream:
            from tuner.archs.parts.audio import two_stream_loss

            return two_stream_loss(self, self.sound_stream(), model, x0, noise, t, cond, accelerator)
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

    # --- derived from the record ----------------------------------------------------------------
    def valid_frame_count(self, n: int) -> bool:
        return n >= 1 and (n - self.record.frame_remainder) % self.record.frame_multiple == 0

    def timestep_sampler(self):
        """The configured training-timestep sampler, with mode "auto" resolved to this model's usual one
        (and narrowed to the trained expert's range on two experts)."""
        from dataclasses import replace

        from tuner.diffusion.timesteps import sampler_from_config

        section = self.cfg.timesteps
        if section.mode == "auto":
            section = replace(section, mode=self.record.timestep_mode)
        sampler = sampler_from_config(section)
        if self.boundary is None:
            return sampler
        return experts.expert_sampler(sampler, self.cfg.model.expert, self.boundary)

    def sampling_defaults(self) -> SamplingDefaults:
        """The record's sampling defaults for the configured transformer (its file name picks a `by_name`
        entry: HiDream Dev, Kandinsky 5 distilled, Krea 2 Turbo)."""
        return self.record.sampling.for_transformer(self.cfg.model.transformer)

    def default_sample_shift(self, latent_shape: tuple[int, ...], steps: int | None = None) -> float | None:
        """Flow shift for sampling a latent of this shape (without batch) in `steps` steps: the defaults'
        constant, or the model's resolution-dependent shift (FLUX.1, Qwen-Image) evaluated at its token count
        (FLUX.2's at the step count too); None for DDPM."""
        from tuner.diffusion.timesteps import RESOLUTION_SHIFTS, STEP_SHIFTS

        shift = self.sampling_defaults().shift
        if isinstance(shift, str):
            tokens = math.prod(latent_shape[1:]) // math.prod(self.record.latent_patch)
            if shift in STEP_SHIFTS:
                return math.exp(STEP_SHIFTS[shift](tokens, steps or self.sampling_defaults().steps))
            return math.exp(RESOLUTION_SHIFTS[shift].mu(tokens))
        return None if shift is None else float(shift)

    def seq_len(self, latents: torch.Tensor) -> int:
        """Tokens per sample (for resolution-dependent timestep shifts)."""
        return math.prod(latents.shape[2:]) // math.prod(self.record.latent_patch)


def padded_prompts(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A `collate_text` for entries kept at their caption's length (`prompt_embeds` [L, ...]): padded with
    zeros to the batch's longest, and `prompt_mask` [B, L] marking each caption's real rows."""
    embeds, mask = padded_rows([entry["prompt_embeds"] for entry in entries])
    return {"prompt_embeds": embeds, "prompt_mask": mask}


def padded_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensors [L_i, ...] padded with zeros to the longest, [B, L, ...], and the mask [B, L] of real rows."""
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = torch.zeros(padded.shape[:2], dtype=torch.bool)
    for i, r in enumerate(rows):
        mask[i, : r.shape[0]] = True
    return padded, mask


def pipeline_architectures() -> list[str]:
    """The architectures whose model cuts its forward into `PipelineParts`."""
    from tuner import registry

    return [name for name, record in registry.ARCHITECTURES.items()
            if record.family_class().pipeline_parts is not ArchitectureModel.pipeline_parts]  # fmt: skip


def pipeline_unavailable(architecture: str) -> str:
    from tuner import registry

    why = registry.ARCHITECTURES[architecture].pipeline_refused or "its forward has not been cut into stages"
    return (
        f"key 'distributed.strategy': pipeline stages are not available for {architecture} ({why}); "
        f"available for {', '.join(pipeline_architectures())}. Use strategy = "
        '"fsdp" or "deepspeed" to split this model across processes.'
    )
