"""`Architecture`: the record of one architecture, everything shared code needs to know about it.

Each family folder (`tuner/archs/<family>/record.py`) declares its records as `RECORDS`; `tuner.registry`
lists the families, tells each record its `folder` and is the one view of all records. The record is plain
data. Code it points to (the model class, the key layout, the fixture, ...) lives in its folder and is named
relative to it: an attribute of the module the field reads by default (`trainer.py`, `keys.py`,
`fixture.py`), or `"module:attribute"` for another module of the folder. It is imported only when asked
for, so reading a config or printing `--help` loads no model code. Its `SamplingDefaults` are generation's
numbers, each record citing where they come from. The `default_targets` regexes and the `diffusers_reads`
outcomes several families share are named here once.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ARCHS = Path(__file__).parent

# `default_targets` shared by families: those built on diffusers' dual-stream (MM-DiT) blocks ...
DUAL_STREAM_ATTENTION = (
    r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
)
"""The joint attention's linears of both streams: the image stream's q/k/v/out, the text stream's `add_*`."""
DUAL_STREAM_FEED_FORWARD = r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.(0\.proj|2)"
"""The MLP input and output of both streams."""
SINGLE_STREAM = r"single_transformer_blocks\.\d+\.(attn\.to_q|attn\.to_k|attn\.to_v|proj_mlp|proj_out)"
"""q/k/v, MLP input and output of FLUX.1-style single-stream blocks (the release's fused `linear1`)."""
# ... and of those whose blocks attend to the image (`attn1`) and the text (`attn2`), then feed forward
SELF_AND_CROSS_ATTENTION = r"transformer_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)"
"""q/k/v/out of the self-attention (`attn1`) and the cross-attention to the text (`attn2`)."""
FEED_FORWARD = r"transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)"
"""The MLP input and output."""

# `diffusers_reads` shared by families: what a pipeline's `load_lora_weights` does with each tuner layout
ALPHA_REFUSED = "refuses: `.alpha` keys (its check wants 'lora' in every key)"
ALPHA_LEFT_OVER = "refuses: its converter leaves the `.alpha` keys over"
ALPHA_CHUNKED = "refuses: its converter cuts the fused layers' `.alpha` (`chunk` of a scalar)"
RELEASE_SIZES = (
    "refuses: its converter cuts the fused layers at the release's sizes (the tiny fixture's differ)"
)
LOADS_EVERY_LAYOUT = {"comfy": "loads", "comfy_folded": "loads", "kohya": "loads", "musubi": "loads",
                      "diffusers": "loads"}  # fmt: skip
"""A loader that converts every layout tuner writes."""
DIFFUSERS_ONLY = {"comfy": ALPHA_REFUSED, "comfy_folded": "ignores", "kohya": "ignores", "musubi": "ignores",
                  "diffusers": "loads"}  # fmt: skip
"""A loader that converts no foreign layout: diffusers' names load, the others name no `transformer.` one."""
CONVERTS_FOLDED = {**DIFFUSERS_ONLY, "comfy_folded": "loads"}
"""A loader that converts the release's names under `diffusion_model.`, without `.alpha` keys."""


CFG_FORMS = {
    "plain": "uncond + g·(cond − uncond)",
    "cond_plus": "cond + g·(cond − uncond), i.e. plain CFG at g + 1 (0 disables it)",
}
"""How a release's documented guidance number g combines the two passes (`SamplingDefaults.cfg_form`)."""


@dataclass(frozen=True, kw_only=True)
class SamplingDefaults:
    """Generation's defaults for one architecture (or, in `by_name`, for the files a pattern names): what
    `tuner generate` and the samples drawn in training use for each setting they are not given. Every
    number is the release's, so a user types the number its model card or pipeline documents."""

    steps: int
    """Denoising steps (the pipeline's `num_inference_steps` default, or the release's recommendation)."""
    guidance: float
    """Classifier-free guidance in the release's own convention (`cfg_form`); 1 (plain) or 0 (cond_plus)
    runs the conditional pass alone."""
    cfg_form: str = "plain"
    """A `CFG_FORMS` name: how `guidance` combines the conditional and unconditional predictions."""
    shift: float | str | None = 3.0
    """The flow shift, or a `tuner.diffusion.timesteps.RESOLUTION_SHIFTS` or `STEP_SHIFTS` name (a shift that grows with the
    token count); None for DDPM models, which sample their trained schedule."""
    shift_terminal: float | None = None
    """Where the release's scheduler stretches the shifted times to end at this one before 0 (diffusers'
    `shift_terminal`); None: no stretch."""
    embedded_guidance: float | None = None
    """Guidance-distilled models: the value fed to the guidance embedding while sampling (training feeds
    `model.guidance`); None for models without one."""
    negative_prompt: str = ""
    """The negative prompt of the unconditional pass."""
    zero_empty_negative: bool = False
    """Without a negative prompt, guide against zeros, not the empty prompt's encoding (SDXL, as diffusers'
    `force_zeros_for_empty_prompt`)."""
    source: str
    """Where the numbers come from (the pipeline's `__call__` defaults and scheduler config, the model card,
    the release's inference code)."""
    by_name: tuple[tuple[str, SamplingDefaults], ...] = ()
    """(regex, defaults) used instead when the regex is found (case-insensitive) in `model.transformer`'s
    file or folder name: releases of one shape told apart by name only (distilled, Turbo, Dev)."""

    def named(self, pattern: str, **changes: Any) -> SamplingDefaults:
        """These defaults with `changes` for the transformer files `pattern` finds (added to `by_name`)."""
        return replace(self, by_name=(*self.by_name, (pattern, replace(self, by_name=(), **changes))))

    def for_transformer(self, path: str | Path | None) -> SamplingDefaults:
        """The defaults of the transformer file or folder `path`: the first `by_name` entry it matches."""
        for pattern, defaults in self.by_name:
            if re.search(pattern, str(path or ""), re.IGNORECASE):
                return defaults
        return self

    def plain_guidance(self, guidance: float) -> float:
        """`guidance` in this release's convention as the plain CFG scale the sampler applies."""
        return guidance + 1.0 if self.cfg_form == "cond_plus" else guidance

    def summary(self) -> str:
        """One line: the numbers, as `tuner generate --help` and the log show them."""
        parts = [f"{self.steps} steps", f"guidance {self.guidance:g}" + _FORM_NOTE[self.cfg_form]]
        if self.embedded_guidance is not None:
            parts.append(f"embedded guidance {self.embedded_guidance:g}")
        if self.shift is not None:
            parts.append(f"shift {self.shift}" if isinstance(self.shift, str) else f"shift {self.shift:g}")
        if self.shift_terminal is not None:
            parts.append(f"stretched to end at {self.shift_terminal:g}")
        if self.negative_prompt:
            short = (
                self.negative_prompt if len(self.negative_prompt) <= 24 else self.negative_prompt[:21] + "..."
            )
            parts.append(f"negative prompt {short!r}")
        return ", ".join(parts)


_FORM_NOTE = {"plain": "", "cond_plus": " (cond + g·(cond − uncond))"}

PIPELINE_DIFFERENCES = {
    "sigmas": "the pipeline is given tuner's sigmas (evenly spaced from 1 to 1/steps, then shifted)",
    "euler": "the pipeline's scheduler is diffusers' flow-matching Euler at the same shift",
    "boolean_text_mask": "the pipeline is given its own text embeddings with its text masks as booleans",
    "area": "the pipeline's default size (which it scales every asked size to, keeping the aspect) is the asked one",
}
"""What a `ReferencePipeline.differs` name makes the generate-equals-pipeline test give the pipeline."""


@dataclass(frozen=True)
class ReferencePipeline:
    """The diffusers pipeline `tuner generate` equals: on the same seed, steps, guidance, shift and size it
    draws the same image within float tolerance, with and without a LoRA (tests/test_contract_generate.py)."""

    name: str
    """Its class in `diffusers`, as the diffusers folder's `model_index.json` names it."""
    differs: tuple[tuple[str, str], ...] = ()
    """(a `PIPELINE_DIFFERENCES` name, why): where tuner samples otherwise on purpose. The test gives the
    pipeline exactly that difference and then asks for the same image."""


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """One architecture (a config's `model.architecture`)."""

    name: str
    """The config name, e.g. `wan`."""
    title: str
    """What it trains, in a few words (shown by `tuner --help` and `tuner fixtures --help`)."""
    family: str
    """Its `ArchitectureModel` subclass (`tuner.archs.model`), a class of its folder's `trainer.py`
    (`module:Class` in another module of the folder): what it computes. Training runs the loop over it
    (`tuner.trainers.trainer_class`)."""
    layout: str = ""
    """Its `CheckpointLayout`: the release's single-file layout relative to diffusers'. Its `keys`
    (`ArchitectureKeys`: module renames and fused layers) name adapters in saved files. Empty: its folder's
    `keys.py` `<FOLDER>_LAYOUT` (e.g. `FLUX_LAYOUT`); else `module:attribute` in its folder (a layout kept in
    `loaders.py`). Architectures with the same network share one layout."""
    fixture: str = "FIXTURE"
    """Its tiny random-weight `Fixture` (written in the release's layouts), named in its folder's
    `fixture.py` (`module:attribute` in another module of the folder)."""
    configs: str = "configs"
    """The folder (in its family folder) of its variants' diffusers configs: a member whose networks are not
    its family's first record's keeps them apart (Qwen-Image 2.1's `configs_21`)."""
    folder: str = ""
    """The family folder under `tuner/archs/` whose `record.py` declares it, set by `tuner.registry`: its code
    is named relative to it, and its `configs/` holds the diffusers configs of every shipped variant (a
    `transformer/` folder holding a `tiny` variant and at least one real one)."""
    block_lists: tuple[str, ...]
    """The transformer's `nn.ModuleList`s of blocks, in execution order (block swap, checkpointing,
    fp8 storage)."""
    default_targets: tuple[str, ...]
    """Regexes over diffusers module names of the linear layers an adapter trains by default."""
    save_format: str
    """The layout `save.format = "auto"` writes: one ComfyUI loads, chosen to load in diffusers and musubi-tuner
    too where a layout does; which tool loads which layout is `tuner.networks.receivers`' table."""
    save_format_loads: str
    """Which tools load the `save_format` file as saved, and what the others need (shown in the docs)."""
    variants: tuple[str, ...]
    """The transformer variants it trains: folders of its family's `configs/transformer/` (a real release's
    config each; the `tiny*` fixtures' are not listed)."""
    checkpoints: str
    """The files each `model.*` component loads, in the layouts users have (the docs' variants table)."""
    spatial_step: int = 16
    """Pixels per latent token side (the VAE's factor times the patch size: 16 for an 8x VAE and 2x2 patches);
    sizes are multiples of it."""
    boundary: float | None = None
    """Two-expert models (Wan 2.2 A14B): the release's t in [0, 1] where denoising switches from the
    high-noise expert (`model.transformer`) to the low-noise one (`model.transformer_2`); None for models
    with one transformer."""
    tokenizers: tuple[tuple[str, str], ...] = ()
    """(config field, hub folder) of the tokenizer of each text encoder, e.g. ("tokenizer",
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers:tokenizer"): used when the config gives none and the encoder is a
    single file, which carries none (see `tuner.hub`). Every record names one per text encoder."""
    hub_repos: tuple[tuple[str, str], ...] = ()
    """(variant, repository) of the official diffusers pipelines, the first the default: what
    `tuner download ARCH [VARIANT]` fetches the components from; empty for a model released as single files
    only (Anima), whose `comfy_files` it then fetches (a release that is no pipeline, HiDream-O1's, names its
    repository: the download then asks for `--comfy`)."""
    hub_folders: tuple[tuple[str, str], ...] = ()
    """(config field, folder) of a component its pipeline keeps in a folder of another name than the field
    (OmniGen2's Qwen2.5-VL in `mllm/`): `tuner download` points that field at the pipeline too."""
    comfy_files: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    """(variant, ((config field, hub file), ...)) of the single files ComfyUI users have, from Comfy-Org's
    repackaged repositories (`repo/split_files/...`): what `tuner download ARCH [VARIANT] --comfy` fetches;
    empty where there are none. Variants are `hub_repos`' names."""
    first_frame: float | None = None
    """Models given a video's first frame (image-to-video): the share of training samples given it when
    `train.first_frame_conditioning_p` is unset (1.0, as the releases train; 0.5 where one model does both
    text- and image-to-video). None for models without a first-frame condition (they refuse the key)."""
    first_frame_required: str = ""
    """Why such a model cannot train without its frame, where it cannot (its image condition has no absent
    form in any of its pipelines): it then accepts only p = 1. What the others are fed without the frame is
    their trainer's `draw_conditions` / `predict`."""
    frame_multiple: int = 1
    """Valid frame counts are `frame_multiple`·N + `frame_remainder` (the VAE's temporal factor)."""
    frame_remainder: int = 0
    """See `frame_multiple`."""
    model_fps: float = 16.0
    """The frame rate the model was trained at (videos are resampled to it; generation writes it)."""
    supports_video: bool = False
    """Whether it trains on video (image-only models refuse video datasets when loading)."""
    supports_images: bool = True
    """Whether it trains on images (image-to-video models refuse image datasets when loading)."""
    min_frames: int = 1
    """Fewest frames per clip (first-last-frame models need two)."""
    frame_images: int = 0
    """Frame images generation is given (image-to-video: the first[, and the last])."""
    latent_encoders: tuple[str, ...] = ("vae",)
    """Config fields (`model.<name>`) whose weights shape latent entries (part of their cache key)."""
    latent_space: str = "vae"
    """What latent entries hold (part of their cache key): "vae", the latents of the models named in
    `latent_encoders`; or "pixels", the resized pictures themselves (pixel-space models, HiDream-O1:
    `tuner.archs.pixel_space`, with no `latent_encoders`)."""
    text_extra_encoders: tuple[str, ...] = ()
    """Config fields beyond the text encoders and tokenizers whose weights shape text entries (part of their
    cache key): FramePack one-frame conditions its prompt on the reference image's `image_encoder` tokens."""
    control_images: tuple[int, int] = (0, 0)
    """(Fewest, most) control images per item (edit models)."""
    text_uses_controls: bool = False
    """Whether the text encoder also sees the control images (Qwen-Image-Edit)."""
    timestep_mode: str = "shift"
    """What `timesteps.mode = "auto"` means for this model."""
    sampling: SamplingDefaults
    """Generation's defaults (steps, guidance and its form, shift, negative prompt), with where they come from;
    `tuner generate` and `[sample]` use them for what they are not given."""
    flow_sampler: str = ""
    """`module:function` (in its folder) of a generation that denoises the latent in parts (FramePack's
    sections), called as `fn(denoise, noise, cond, uncond)` where `denoise` takes the same three for one Euler
    pass; empty: one pass over the whole latent."""
    control_encoder: str = ""
    """`module:function` in its folder making the cached `control_<i>` tensors from (the family model, the
    VAE, the controls' pixels, each [B, 3, F, H, W]), where the control branch takes more than each
    control's latents (Wan VACE: the latents of the kept and the generated part, and the mask); empty: the
    latents."""
    flow_schedule: str = ""
    """`module:function` (in its folder) of generation's noise levels, called as `fn(steps, noise)` (the
    initial noise [1, ...]) for `steps + 1` levels from 1 to 0, where the release samples along a schedule of
    its own (Ideogram 4's logit-normal one); empty: the shifted linear ones (`sampling.shift`)."""
    sample_guidance: tuple[tuple[str, float], ...] = ()
    """(setting, value) of the adaptive projected guidance its release samples with
    (`tuner.diffusion.guidance.ProjectedGuidance`'s fields): generation's default guidance, plain CFG
    still chosen by `--guidance-method cfg` / `sample.guidance_method`. Empty: CFG (or `combine_guidance`)."""
    flow_next_time: bool = False
    """Whether generation also gives the model the time its Euler step goes to, as `cond["t_next"]` in [0, 1]
    (MeanFlow models, HunyuanImage 2.1 distilled: the interval's end r); training gives none (r = t)."""
    latent_patch: tuple[int, ...] = (1, 2, 2)
    """Latent elements per token along (F, H, W), or (H, W) for image latents."""
    audio_format: tuple[int, int] | None = None
    """(Sample rate, channels) of models that also learn sound; None for the others."""
    sound_stream: str = ""
    """Models that also learn sound: `module:Class` (in its folder) of their
    `tuner.archs.parts.audio.SoundStream` (how sound is encoded, predicted beside the video and decoded)."""
    first_frame_image: bool = False
    """Whether generation takes an optional first-frame image (`--image`; TI2V, LTX)."""
    one_frame: str = ""
    """One-frame models (one target frame from reference images at chosen time indices): what the config's
    `[one_frame]` section (`tuner.config.schema.OneFrameConfig`) lays out: "section" (a FramePack section's
    clean latents, a zero post latent and 2× / 4× history; entries hold the plain latents) or "frames"
    (latent frames at RoPE time indices, cached in time order, so the indices are in the latent cache key);
    empty: none."""
    objective: str = "flow"
    """"flow" (flow matching, velocity at t), "ddpm" (SD's discrete noise schedule; epsilon or v) or "edm"
    (Karras' preconditioned denoiser and loss weight over flow time, `tuner.diffusion.edm`; Cosmos 1.0)."""
    flow_prediction: str = "velocity"
    """What a flow model's network predicts: "velocity" (noise − x0) or "x0" (the clean sample, trained on its
    squared error and sampled along (x_t − x̂0)/t: `tuner.diffusion.timesteps.X0FlowObjective`; HiDream-O1)."""
    noise_scales: tuple[tuple[str, float, float], ...] = ()
    """`flow_prediction = "x0"` models: (regex, scale, clip) of the noise they train on and sample from, the
    first whose regex is found (case-insensitive) in `model.transformer`'s file or folder name: ε·scale, ε
    first clipped to ± clip of its standard deviation (0: not clipped). Empty: standard normal noise."""
    cache_format_version: int = 1
    """Version of its cache entries' format (part of their cache key)."""
    text_encoder_training: str = ""
    """Models whose text encoders may train (`network.train_text_encoder`, SDXL): `module:Class` (in its
    folder) of their `tuner.archs.parts.text_encoder_training.TrainableTextEncoders`; empty: the option is
    refused."""
    size_conditioning: bool = False
    """Whether the model is told how each training picture was sized: caching stores its `time_ids`
    (`tuner.archs.parts.size_conditioning`; SDXL)."""
    training_warning: str = ""
    """`module:function` (in its folder) called with the config before an adapter is built on a transformer,
    returning a warning to show (else ""): what training these weights as they are would undo (Z-Image-Turbo's
    distillation, without a de-distillation adapter merged)."""
    full_layout: str = ""
    """`module:function` (in its folder) giving the layout a full fine-tune's file is written through
    (`fn(family)`) where the release's checkpoint bundles more than the denoiser (SDXL's UNet, VAE and text
    encoders, as UIs load it); empty: the denoiser's layout. A `save.format = "diffusers"` save keeps the
    denoiser's."""
    dora_refused: str = ""
    """Why `network.dora` is refused, where it is: tuner's DoRA normalises each column over the rows of one
    layer, so on the parts of a fused layer it is written apart, and the tool the layout is for may have no
    name for a part (ComfyUI maps diffusers' names onto row slices for FLUX only). Empty: DoRA saves."""

    pipeline: ReferencePipeline | None = None
    """The diffusers pipeline `tuner generate` equals; None: not checked against one yet."""
    pipeline_refused: str = ""
    """Why `distributed.strategy = "pipeline"` is refused, where its model offers no `pipeline_parts`
    (`tuner.archs.stages`): what a user reads in the refusal. Empty: its model is cut into stages (the
    completeness test in tests/test_distributed_pipeline.py holds every record to one of the two)."""

    diffusers_loader: str = ""
    """The LoRA loader mixin of its diffusers pipeline (`diffusers.loaders.lora_pipeline`), whose
    `load_lora_weights` reads adapter files; empty: the pipeline has none (HunyuanVideo 1.5,
    Cosmos-Predict2)."""
    diffusers_reads: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Per tuner layout, what `diffusers_loader` does with a LoRA file (measured on the fixture, diffusers
    0.42.1, by `tests/test_receivers.py`): "loads" every module, "ignores" (0 layers, only a warning), or
    "refuses: why" (raises); a layout not listed: "ignores"."""
    diffusers_drops: tuple[tuple[str, str], ...] = ()
    """(layout, a fragment of the stems the loader drops silently though it loads the rest of the file)."""
    musubi_trains: bool = False
    """Whether musubi-tuner trains it (its `networks/lora_*.py`; HunyuanVideo in `lora.py`): its files are
    read by musubi-tuner's key rules (`tuner.networks.receivers`); else musubi-tuner is n/a."""

    def family_class(self) -> type:
        """Its `ArchitectureModel` subclass."""
        return self._code(self.family, "trainer")

    def family_model(self, cfg: Any) -> Any:
        """Its `ArchitectureModel` for `cfg` (caching, generation: no training loop)."""
        return self.family_class()(cfg)

    def flow_sampler_function(self) -> Any:
        """The `flow_sampler` function, or None for one pass."""
        return self._code(self.flow_sampler) if self.flow_sampler else None

    def control_encoder_function(self) -> Any:
        """The `control_encoder` function, or None for the control's latents."""
        return self._code(self.control_encoder) if self.control_encoder else None

    def noise_scale(self, transformer: str | Path | None) -> tuple[float, float]:
        """(scale, clip) of the noise for the transformer file or folder `transformer` (`noise_scales`)."""
        for pattern, scale, clip in self.noise_scales:
            if re.search(pattern, str(transformer or ""), re.IGNORECASE):
                return scale, clip
        return 1.0, 0.0

    def flow_schedule_function(self) -> Any:
        """The `flow_schedule` function, or None for the shifted linear schedule."""
        return self._code(self.flow_schedule) if self.flow_schedule else None

    def sound_stream_class(self) -> Any:
        """The `sound_stream` class (`tuner.archs.parts.audio.SoundStream`), or None without sound."""
        return self._code(self.sound_stream) if self.sound_stream else None

    def text_encoder_training_class(self) -> Any:
        """The `text_encoder_training` class, or None for models whose text encoders do not train."""
        return self._code(self.text_encoder_training) if self.text_encoder_training else None

    def full_layout_function(self) -> Any:
        """The `full_layout` function (set only where a full fine-tune saves a bundled checkpoint)."""
        return self._code(self.full_layout)

    def training_warning_function(self) -> Any:
        """The `training_warning` function, or None."""
        return self._code(self.training_warning) if self.training_warning else None

    def checkpoint_layout(self) -> Any:
        """The `CheckpointLayout` of this architecture: a name map (diffusers module -> release's, with the
        fused layers), `.inverse` for the way back, and whole-checkpoint conversion."""
        return self._code(self.layout or f"{self.folder.upper()}_LAYOUT", "keys")

    def key_table(self) -> Any:
        """The `ArchitectureKeys` of this architecture (what adapter files are named by)."""
        return self.checkpoint_layout().keys

    def load_fixture(self) -> Any:
        """The `Fixture` of this architecture."""
        return self._code(self.fixture, "fixture")

    @property
    def components(self) -> tuple[str, ...]:
        """The `model.*` fields whose files it loads: the transformer(s), the latent encoders, each text
        encoder with its tokenizer, and what its text encoding reads besides."""
        text = [
            f
            for tokenizer, _ in self.tokenizers
            for f in (tokenizer.replace("tokenizer", "text_encoder"), tokenizer)
        ]
        experts = ("transformer_2",) if self.boundary is not None else ()
        names = ("transformer", *experts, *self.latent_encoders, *text, *self.text_extra_encoders)
        return tuple(dict.fromkeys(names))

    @property
    def variant_dir(self) -> Path:
        return ARCHS / self.folder / self.configs

    @property
    def tiny_variant(self) -> str:
        """The `tiny*` transformer config of its first variant: the longest suffix of a `tiny*` folder found
        in the variant's name (`tiny-i2v` for `i2v-14B`), else `tiny`."""
        folders = [p.name for p in (self.variant_dir / "transformer").glob("tiny*")]
        return max(folders, key=lambda f: (f == "tiny" or f[5:] in self.variants[0]) * (len(f) + 1))

    @property
    def model_class(self) -> str:
        """The class of its transformer: its `tiny_variant` config's `_class_name` (its variants' too; one
        family folder may hold records of two classes, as Wan and Wan VACE)."""
        return _class_name(self.variant_dir / "transformer" / self.tiny_variant / "config.json")

    def transformer_class(self) -> type:
        """The `model_class`: diffusers' class, or where diffusers has none the one its folder's `model.py`
        defines (a transformers model then, built from its configs as transformers builds them)."""
        import diffusers

        if hasattr(diffusers, self.model_class):
            return getattr(diffusers, self.model_class)
        return self._code(self.model_class, "model")

    def build_transformer(self, variant: str) -> Any:
        """A `transformer_class` of the config folder `variant` with initial weights (call it under
        `init_empty_weights` for the shapes alone)."""
        cls, folder = self.transformer_class(), self.variant_dir / "transformer" / variant
        if hasattr(cls, "load_config"):  # a diffusers model
            return cls.from_config(cls.load_config(folder))
        return cls(cls.config_class.from_pretrained(folder))

    def _code(self, ref: str, default: str = "") -> Any:
        """What `ref` names in the record's folder: `attribute` of the module `default`, or
        `module:attribute`."""
        if not self.folder:
            raise LookupError(f"{self.name}: a record has a folder once `tuner.registry` lists it")
        module, _, attribute = ref.rpartition(":")
        return getattr(importlib.import_module(f"tuner.archs.{self.folder}.{module or default}"), attribute)


@functools.cache
def _class_name(config: Path) -> str:
    return json.loads(config.read_text())["_class_name"]


def hub_tokenizers(repo: str, *fields: str) -> tuple[tuple[str, str], ...]:
    """`tokenizers` entries: each config field's tokenizer from the folder of that name in `repo`."""
    return tuple((field, f"{repo}:{field}") for field in fields)


def comfy(repo: str, **files: str) -> tuple[tuple[str, str], ...]:
    """`comfy_files` entries: config field -> a file under `repo`'s `split_files/` folder."""
    return tuple((field, f"{repo}/split_files/{path}") for field, path in files.items())
