"""The training TOML: one frozen dataclass per section, every field documented.

`docs/config.md` is generated from these classes (`python -m tuner.config.docs`), and a test keeps
it in sync, so this file is the single source of truth for what a config may say.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from tuner.config.fields import option
from tuner.errors import ConfigError, TunerError
from tuner.networks.options import check_network_options, check_save_format
from tuner.registry import resolve_save_format

Dtype = Literal["fp32", "bf16", "fp16"]
SwapMode = Literal["full", "h2d_only"]


@dataclass(frozen=True)
class ModelConfig:
    moved_keys: ClassVar[dict[str, str]] = {
        "i2v_probability": "train.first_frame_conditioning_p",  # one key for every image-to-video model
    }
    architecture: str = option(doc="Architecture name, e.g. 'wan' (see `tuner --help` for the list).")
    transformer: str = option(
        doc="Transformer checkpoint: a single .safetensors file or a diffusers folder.", path=True
    )
    vae: str = option(
        "",
        "VAE checkpoint (single file or diffusers folder); needed by `cache latents` and `generate`.",
        path=True,
    )
    transformer_2: str = option(
        "",
        "Second transformer of two-expert models (Wan 2.2 A14B: the low-noise expert; `transformer` is the "
        "high-noise one, as in diffusers' pipeline folders).",
        path=True,
    )
    expert: Literal["", "high", "low", "both"] = option(
        "",
        "Two-expert models: which expert trains: high (`transformer`, t >= boundary), low (`transformer_2`, "
        "t < boundary) or both (one adapter file per expert). Required when both experts are given (high "
        "when only `transformer` is); unset for other models.",
    )
    boundary: float = option(
        0.0,
        "Two-expert models: the t in [0, 1] where denoising switches experts; 0 means the release's "
        "(0.875 for Wan 2.2 T2V A14B).",
        ge=0,
        lt=1,
    )
    text_encoder: str = option("", "Text encoder checkpoint (single file or diffusers folder).", path=True)
    tokenizer: str = option("", "Tokenizer folder; defaults to the one beside the text encoder.", path=True)
    text_encoder_2: str = option(
        "", "Second text encoder, for models with two (FLUX.1: T5-XXL beside CLIP-L).", path=True
    )
    tokenizer_2: str = option("", "Tokenizer folder of the second text encoder.", path=True)
    text_encoder_3: str = option(
        "", "Third text encoder, for models with three or more (SD 3.5 and HiDream: T5-XXL).", path=True
    )
    tokenizer_3: str = option("", "Tokenizer folder of the third text encoder.", path=True)
    text_encoder_4: str = option(
        "", "Fourth text encoder, for models with four (HiDream-I1: Llama 3.1 8B Instruct).", path=True
    )
    tokenizer_4: str = option("", "Tokenizer folder of the fourth text encoder.", path=True)
    image_encoder: str = option(
        "",
        "Image encoder of image-to-video models (Wan 2.1 I2V / FLF2V: CLIP ViT-H/14, ComfyUI's "
        "clip_vision_h.safetensors or a diffusers folder); runs in `vae_dtype` when caching latents.",
        path=True,
    )
    guidance: float = option(
        1.0,
        "Guidance-embedding value fed while training guidance-distilled models (FLUX.1-dev; HunyuanVideo "
        "takes it × 1000 as its release's sampler and diffusion-pipe do, where musubi-tuner's training "
        "passes it raw).",
        ge=0,
    )
    dtype: Dtype = option("bf16", "Dtype the frozen base transformer is loaded in.")
    vae_dtype: Dtype = option("fp32", "Dtype of the VAE.")
    merge_adapters: tuple[str, ...] = option(
        (),
        "Adapter files merged into the loaded base transformer before training, sampling and generation "
        '(and before fp8 storage), as "file.safetensors:strength" (strength 1.0 when left out); any layout '
        "`tuner lora` reads. E.g. a de-distillation adapter for step-distilled models (Z-Image-Turbo). "
        "Recorded in the saved adapter's metadata; the cache does not depend on it.",
        path=True,
    )

    def __post_init__(self) -> None:
        self.adapter_merges()  # a bad strength is named at load time

    def adapter_merges(self) -> tuple[tuple[str, float], ...]:
        """`merge_adapters` as (path, strength) pairs, in order."""
        return tuple(_adapter_entry(entry) for entry in self.merge_adapters)


def _adapter_entry(entry: str) -> tuple[str, float]:
    path, sep, strength = entry.rpartition(":")
    if not sep or "/" in strength or "\\" in strength:  # no strength given (or a drive letter's colon)
        return entry, 1.0
    try:
        return path, float(strength)
    except ValueError:
        raise ConfigError(
            f"key 'model.merge_adapters': {entry!r} should be \"file.safetensors:strength\" with a number "
            "after the last colon"
        ) from None


@dataclass(frozen=True)
class DataConfig:
    dataset_config: str = option(doc="Path of the dataset TOML ([general] + [[datasets]]).", path=True)
    num_workers: int = option(2, "DataLoader worker processes that read the cache.", ge=0)


@dataclass(frozen=True)
class CacheConfig:
    batch_size: int = option(1, "Items encoded per forward pass while caching.", ge=1)
    device: str = option("auto", "Device for the encoders while caching: 'auto', 'cpu', 'cuda', 'cuda:1'...")
    text_encoder_dtype: Literal["fp32", "bf16", "fp16", "fp8", "int8", "nf4"] = option(
        "bf16",
        "Precision of the text encoder while caching: fp8 stores its weights as float8 with scales; int8 / nf4 "
        "use bitsandbytes.",
    )
    text_encoder_blocks_to_swap: int = option(
        0,
        "Layers of each text encoder kept in pinned host memory and streamed to the GPU ahead of use while "
        "caching and generating (a CUDA device only), for encoders larger than the GPU (FLUX.2 dev's 24B "
        "Mistral): at most that encoder's layer count. Works with bf16 / fp16 / fp8, not with int8 / nf4.",
        ge=0,
    )
    text_max_length: int = option(512, "Longest caption in tokens; longer captions are cut to it.", ge=1)
    commit_every_seconds: float = option(
        30.0,
        "Commit what is encoded at least this often (and on SIGINT/SIGTERM): a killed run loses at most "
        "this many seconds of encoding. 0 commits after every item.",
        ge=0,
    )

    def __post_init__(self) -> None:
        if self.text_encoder_blocks_to_swap and self.text_encoder_dtype in ("int8", "nf4"):
            raise ConfigError(
                f"cache.text_encoder_blocks_to_swap = {self.text_encoder_blocks_to_swap} cannot stream "
                f"bitsandbytes {self.text_encoder_dtype} layers: set cache.text_encoder_dtype to 'fp8' (or "
                "bf16) to stream, or text_encoder_blocks_to_swap = 0 to keep the quantized encoder resident"
            )


@dataclass(frozen=True)
class NetworkConfig:
    type: Literal["lora", "loha", "lokr", "full"] = option(
        "lora",
        "What is trained: lora, loha (Hadamard product), lokr (Kronecker product), or full (every weight).",
    )
    rank: int = option(16, "Adapter rank (dimension).", ge=1)
    alpha: float = option(16.0, "Adapter alpha; the scale is alpha / rank.", gt=0)
    dropout: float = option(0.0, "Dropout on the adapter input.", ge=0, lt=1)
    rank_dropout: float = option(0.0, "Probability of dropping each rank channel in a step.", ge=0, lt=1)
    module_dropout: float = option(0.0, "Probability of skipping a whole adapter in a step.", ge=0, lt=1)
    include: tuple[str, ...] = option(
        (), "Regexes (full match on module names) to adapt besides the defaults."
    )
    exclude: tuple[str, ...] = option((), "Regexes (full match) of modules never to adapt.")
    loraplus_lr_ratio: float | None = option(
        None, "LoRA+: learning rate of the up matrices = lr × this.", gt=0
    )
    network_weights: str = option("", "Adapter file to start from (continue training).", path=True)
    dora: bool = option(False, "DoRA: also learn a magnitude per input channel (weight decomposition).")
    factor: int = option(
        -1,
        "LoKr: largest side of the small Kronecker factor; -1 splits each side as squarely as possible.",
        ge=-1,
    )
    decompose_both: bool = option(False, "LoKr: store the small Kronecker factor as a low-rank pair too.")
    full_matrix: bool = option(
        False, "LoKr: keep both Kronecker factors full (rank and alpha unused, scale 1)."
    )
    stochastic_rounding: bool = option(
        False, "Full fine-tune: round bf16 weights stochastically after each optimizer step."
    )
    train_text_encoder: bool = option(
        False,
        "Also train an adapter on the text encoder(s) (SDXL: CLIP-L and bigG). Their outputs are then "
        "computed at every step instead of cached (`tuner cache text` stores token ids only).",
    )
    text_encoder_lr: float | None = option(
        None, "Learning rate of the text encoders' adapters (unset: train.learning_rate).", gt=0
    )

    def __post_init__(self) -> None:
        check_network_options(self)


TIMESTEPS_GUIDE = """Flow-matching timestep sampling and loss (DDPM models, SDXL: the last four keys). Which t
the model trains on (t = 0 clean, 1 pure noise; `tuner timesteps` draws the configured distribution as a
PNG). Modes, with musubi-tuner's names and formulas (`tuner.diffusion.timesteps` has them written out):

- `auto`: the model's usual one (below, in brackets). Start here.
- `uniform` (SDXL): every t alike; DDPM models, and a baseline for comparing recipes.
- `sigmoid`: a bump around 0.5 (`sigmoid_scale` widens it): the middle of the path without a shift.
- `logit_normal` (Cosmos-Predict2): SD3's default, median sigmoid(`logit_mean`); a positive mean trains noisier t.
- `mode`: SD3's heavy-tailed middle bump (`mode_scale`, −1 … 1.75; 0 is uniform). Like logit_normal
  but keeps some mass at both ends.
- `logsnr`: the log-SNR λ ~ N(`logit_mean`, `logit_std`), t = sigmoid(−λ/2); recipes from arXiv:2411.14793.
- `shift` (Wan, HunyuanVideo and every model not named here): `shift_from` then the flow shift
  `discrete_flow_shift` towards noise; large images and video need s = 3…12.
- `flux_shift` (FLUX.1, FLUX.2), `qwen_shift` (Qwen-Image), `krea2_shift` (Krea 2): the shift chosen from the
  token count as the model's own scheduler does; for training at several resolutions.
- `flux2_shift` (musubi-tuner's FLUX.2 mode): FLUX.1's line on FLUX.2's tokens; in tuner the same as
  `flux_shift`, which already counts each model's tokens.
- `qinglong_flux` / `qinglong_qwen`: 80 % flux_shift / qwen_shift, 7.5 % logsnr, 12.5 % nearly clean
  logsnr (λ ~ N(5.36, 1)): musubi-tuner's hybrid for fine detail on top of composition.

`min_timestep` / `max_timestep` narrow any mode; `range_mode` says how: `truncate` keeps the shape inside
the range (musubi-tuner's `--preserve_distribution_shape`), `scale` squeezes the whole distribution in
(musubi-tuner's default). Loss weightings (`loss_weighting`): `none` (the usual choice), `sigma_sqrt`
(1/t², stresses clean t), `cosmap` (cosine schedule), `logit_normal` / `mode` (the density of that mode as
a weight, SD3 §3.1; musubi-tuner's `--weighting_scheme logit_normal` / `mode` instead *draws* t from it,
which is `mode = "logit_normal"` / `"mode"` here)."""


@dataclass(frozen=True)
class TimestepConfig:
    mode: Literal[
        "auto", "uniform", "sigmoid", "logit_normal", "mode", "logsnr", "shift", "flux_shift", "flux2_shift",
        "qwen_shift", "krea2_shift", "qinglong_flux", "qinglong_qwen", "ideogram4_shift",
    ] = option(
        "auto",
        "How training timesteps t in [0, 1] are drawn (see the list above); auto is the model's usual choice "
        "(shift for Wan, flux_shift for FLUX.1, qwen_shift for Qwen-Image, krea2_shift for Krea 2, "
        "ideogram4_shift for Ideogram 4, uniform for SDXL).",
    )  # fmt: skip
    sigmoid_scale: float = option(
        1.0, "Scale of the normal inside the sigmoid (sigmoid and shift modes).", gt=0
    )
    logit_mean: float = option(
        0.0, "Mean of the normal (logit_normal mode and weighting; of λ in logsnr and the Qinglong modes)."
    )
    logit_std: float = option(
        1.0,
        "Std of the normal (logit_normal mode and weighting; of λ in logsnr and the Qinglong modes).",
        gt=0,
    )
    mode_scale: float = option(
        1.29, "s of the mode mode and weighting, in [-1, 2/(π-2) ≈ 1.75]; 0 is uniform.", ge=-1, le=1.7519
    )
    discrete_flow_shift: float = option(3.0, "Shift s of t' = s·t / (1 + (s-1)·t) (shift mode).", gt=0)
    min_timestep: float = option(0.0, "Smallest t drawn, in [0, 1].", ge=0, le=1)
    max_timestep: float = option(1.0, "Largest t drawn, in [0, 1].", ge=0, le=1)
    range_mode: Literal["truncate", "scale"] = option(
        "truncate",
        "How min/max_timestep narrow the mode: truncate (shape kept inside) or scale (squeezed in).",
    )
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap", "logit_normal", "mode"] = option(
        "none", "Per-timestep weighting of the MSE loss (flow-matching models; see the list above)."
    )
    noise_offset: float = option(
        0.0, "Add this times a per-channel constant to the noise (learns brightness; e.g. 0.0357).", ge=0
    )
    prediction: Literal["auto", "epsilon", "v"] = option(
        "auto",
        "DDPM models (SDXL): what the model predicts, the noise (epsilon) or the velocity (v, for v-pred "
        "fine-tunes); auto is epsilon.",
    )
    zero_terminal_snr: bool = option(
        False, "DDPM models: rescale the schedule to end at pure noise (v-pred fine-tunes need it)."
    )
    min_snr_gamma: float = option(
        0.0, "DDPM models: min-SNR-γ loss weighting (5 is usual); 0 disables it.", ge=0
    )
    debiased_estimation: bool = option(
        False, "DDPM models: sd-scripts' debiased estimation, weight 1/√SNR (epsilon) or 1/(SNR+1) (v)."
    )

    def __post_init__(self) -> None:
        if self.min_timestep >= self.max_timestep:
            raise ConfigError("key 'timesteps.min_timestep' must be below 'timesteps.max_timestep'.")


@dataclass(frozen=True)
class TrainConfig:
    learning_rate: float = option(
        1e-4, "Peak learning rate (at most 10: larger ones only train to NaN).", gt=0, le=10
    )
    optimizer: str = option(
        "adamw",
        "adamw, adamw8bit, paged_adamw8bit, adafactor, lion, lion8bit, paged_lion8bit, prodigy, adamw_schedulefree, "
        "came, automagic, adamw8bitkahan, genericoptim (see docs/optimizers.md), any torch.optim class, or a dotted path.",
    )
    optimizer_args: dict[str, Any] = option(factory=dict, doc="Keyword arguments passed to the optimizer.")
    lr_scheduler: Literal["constant", "linear", "cosine", "cosine_with_restarts"] = option(
        "constant", "Learning-rate schedule after warmup."
    )
    lr_warmup_steps: int = option(0, "Steps of linear warmup from 0.", ge=0)
    lr_num_cycles: int = option(1, "Restarts of cosine_with_restarts.", ge=1)
    max_steps: int = option(0, "Optimizer steps to train; 0 means use epochs.", ge=0)
    epochs: int = option(1, "Epochs to train when max_steps is 0.", ge=1)
    gradient_accumulation_steps: int = option(1, "Batches accumulated per optimizer step.", ge=1)
    max_grad_norm: float = option(1.0, "Gradient clipping norm; 0 disables clipping.", ge=0)
    max_nonfinite_steps: int = option(
        0,
        "Steps with a NaN or infinite loss or gradient that are skipped (no update) before training stops; "
        "0 stops at the first.",
        ge=0,
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = option("bf16", "Autocast precision of the forward pass.")
    gradient_checkpointing: bool = option(False, "Recompute block activations in backward to save memory.")
    compile: bool = option(
        False,
        "torch.compile each transformer block (one compile serves every block; `tuner generate` too). The "
        "first steps wait for the compiler; later ones run faster on GPUs.",
    )
    seed: int = option(42, "Seed of weights init, noise, timesteps and data order.")
    validate_every_n_steps: int = option(
        0,
        "Loss on the validation datasets every N steps (and at the end); 0 = at the end only, if any.",
        ge=0,
    )
    validation_timesteps: tuple[float, ...] = option(
        (0.25, 0.5, 0.75), "Fixed timesteps the validation loss averages over (same noise every time)."
    )
    fused_backward: bool = option(
        False,
        "Step each parameter's optimizer inside backward and free its gradient at once, so no full set of "
        "gradients is ever held (full fine-tunes). Needs max_grad_norm = 0, gradient_accumulation_steps = 1, "
        "one process, no fp16, and a per-parameter optimizer (not prodigy / adamw_schedulefree).",
    )
    ema_decay: float = option(
        0.0,
        "EMA of the trained weights while training: the decay per optimizer step (e.g. 0.999); saved beside "
        "each adapter as <name>-ema.safetensors. 0 disables.",
        ge=0,
        lt=1,
    )
    ema_warmup: bool = option(
        True, "Ramp the EMA decay up as min(ema_decay, (1 + n) / (10 + n)) over the first updates."
    )
    ema_on_host: bool = option(
        False, "Keep the EMA in host memory (no VRAM; one device-to-host copy of the weights per step)."
    )
    first_frame_conditioning_p: float | None = option(
        None,
        "Image-to-video models: the share of video samples trained with their first frame given (drawn per "
        "sample from the step's seeded generator); the others train without it, as the model's own "
        "pipeline runs without an image: text-to-video for wan22_ti2v and ltx_video (the first frame is then "
        "noised and in the loss), the zero condition latents and mask of ComfyUI's WanImageToVideo without "
        "a start image for wan22_i2v, the text-to-video pipeline's zero condition latents, mask and image "
        "tokens for hunyuan_video15_i2v, no given latent frame (a zero condition mask) for "
        "cosmos_predict2_v2w. Unset: 1 (always given, as released), 0.5 for wan22_ti2v, 0 for ltx_video. wan_i2v, wan_flf2v, "
        "framepack and framepack_1f accept only 1 (their image tokens have no absent form); other "
        "architectures refuse it. See docs/architectures.md.",
        ge=0,
        le=1,
    )

    def __post_init__(self) -> None:
        if not self.validation_timesteps or not all(0 <= t <= 1 for t in self.validation_timesteps):
            raise ConfigError("key 'train.validation_timesteps': give one or more values in [0, 1].")
        if "schedulefree" in self.optimizer.lower() and (
            self.lr_scheduler != "constant" or self.lr_warmup_steps
        ):
            raise ConfigError(
                f"train.optimizer = {self.optimizer!r} schedules its own learning rate: set train.lr_scheduler = "
                "'constant' and train.lr_warmup_steps = 0, and give warm-up as "
                "train.optimizer_args = { warmup_steps = N }."
            )


@dataclass(frozen=True)
class SaveConfig:
    output_dir: str = option("output", "Folder for adapters, checkpoints and logs.", path=True)
    output_name: str = option("lora", "File name stem of saved adapters (also their `modelspec.title`).")
    trigger_phrase: str = option(
        "", "Word(s) the captions use to call up what is trained; saved as `modelspec.trigger_phrase`."
    )
    every_n_steps: int = option(0, "Save every N optimizer steps; 0 disables.", ge=0)
    every_n_epochs: int = option(1, "Save every N epochs; 0 disables.", ge=0)
    keep_last: int = option(0, "Keep only the last K saves (adapters and states); 0 keeps all.", ge=0)
    save_state: bool = option(True, "Also save the full training state next to each adapter, for resume.")
    precision: Literal["fp32", "bf16", "fp16"] = option("fp32", "Dtype of saved adapter weights.")
    format: Literal["auto", "comfy", "comfy_folded", "diffusers", "kohya", "musubi"] = option(
        "auto",
        "Key layout of saved adapters: auto (per architecture, one ComfyUI loads; diffusers reads it only "
        "where docs/architectures.md#which-tool-loads-which-layout says so, and `diffusers` is then what it "
        "loads; never one folding alpha with network.dora; resolved when the config is read), comfy (original "
        "names with `diffusion_model.`), comfy_folded (the same, LoRA only, alpha folded into lora_B, no "
        "`.alpha` keys: what diffusers' LTX loaders read too), diffusers (PEFT, alpha folded in), kohya "
        "(`lora_unet_` + original names, as ComfyUI names them), musubi (kohya's spelling of musubi-tuner's "
        "names: diffusers' for z_image and framepack, the release's `img_mlp_fc1` for hunyuan_video; "
        "elsewhere the same file as kohya). A full fine-tune writes the release's file for all but diffusers.",
    )


@dataclass(frozen=True)
class SampleConfig:
    prompts: tuple[str, ...] = option((), "Prompts drawn during training, one file each, to watch it learn.")
    negative_prompt: str | None = option(
        None, "Negative prompt of the samples (used with guidance); unset: the architecture's default."
    )
    controls: tuple[str, ...] = option(
        (),
        "Control images given with every prompt (edit models; Wan VACE: a control video, then optionally its mask video).",
        path=True,
    )
    images: tuple[str, ...] = option(
        (),
        "Frame images given with every prompt (image-to-video models: the first, then the last frame).",
        path=True,
    )
    every_n_steps: int = option(0, "Draw the samples every N optimizer steps; 0 disables.", ge=0)
    at_start: bool = option(False, "Also draw them before the first step (the base model's output).")
    use_ema: bool = option(False, "Draw the samples with the EMA weights (needs train.ema_decay).")
    width: int = option(512, "Sample width in pixels.", ge=16)
    height: int = option(512, "Sample height in pixels.", ge=16)
    frames: int = option(1, "Sample frame count (1 for an image).", ge=1)
    steps: int | None = option(None, "Sampling steps; unset: the architecture's default.", ge=1)
    guidance: float | None = option(
        None,
        "Classifier-free guidance in the release's convention (`tuner generate --help` lists each "
        "architecture's); unset: the architecture's default.",
        ge=0,
    )
    embedded_guidance: float | None = option(
        None,
        "Guidance-distilled models: the guidance embedding's value; unset: the architecture's default.",
        ge=0,
    )
    shift: float | None = option(None, "Sampling flow shift; unset: the architecture's default.", gt=0)
    guidance_method: Literal["auto", "cfg", "apg"] = option(
        "auto",
        "auto: guide as the release does (adaptive projected guidance for HunyuanImage 2.1, else CFG).",
    )
    seed: int = option(0, "Seed of the samples' noise (the same every time, so samples compare).")


@dataclass(frozen=True)
class OneFrameConfig:
    """One-frame training (records with `one_frame`: framepack_1f, wan_1f): where the target and the reference
    images sit on the model's RoPE time axis, as musubi-tuner's `fp_latent_window_size` / `fp_1f_*` dataset
    keys set them (its docs/framepack_1f.md and dataset_config.md)."""

    target_index: int | None = option(
        None,
        "Time index of the generated frame; unset: latent_window (9) for framepack_1f, 1 for wan_1f (musubi's).",
        ge=0,
    )
    clean_indices: tuple[int, ...] = option(
        (0,),
        "Time index of each reference (control) image, in the items' control order; one per control image.",
    )
    no_post: bool = option(
        False, "Leave out the zero 'post' clean latent at index 1 + latent_window (musubi's fp_1f_no_post)."
    )
    latent_window: int = option(
        9, "FramePack's latent window: the post latent's index is 1 + it, the 2x / 4x history follow.", ge=1
    )

    def target(self, layout: str) -> int:
        """The target's time index: `target_index`, else the default of the record's `one_frame` layout."""
        if self.target_index is not None:
            return self.target_index
        return 1 if layout == "frames" else self.latent_window


@dataclass(frozen=True)
class LogConfig:
    tensorboard: bool = option(True, "Write TensorBoard scalars to <output_dir>/logs.")
    every_n_steps: int = option(
        1,
        "Log scalars (TensorBoard, and <output_dir>/logs/metrics.jsonl, always written) every N optimizer steps.",
        ge=1,
    )


@dataclass(frozen=True)
class MemorySettings:
    """The `[memory]` section of the training TOML (see `docs/memory.md`)."""

    blocks_to_swap: int | Literal["auto"] = option(
        0,
        "Transformer blocks kept in pinned host memory and streamed to the GPU ahead of use; "
        "'auto' sizes it to vram_budget_gb after measuring the first step.",
    )
    vram_budget_gb: float = option(0.0, "VRAM in GiB that 'auto' may plan for; 0 means the whole GPU.", ge=0)
    swap_mode: SwapMode = option(
        "h2d_only",
        "h2d_only: host copies are the truth and nothing is copied back (frozen base); "
        "full: swapped-out blocks are copied back to host memory.",
    )
    share_swapped_weights: bool = option(
        True,
        "With block swap in h2d_only mode and several processes on one machine (DDP), keep one host copy "
        "of the swapped weights in /dev/shm, mapped by all of them, instead of a pinned copy each; falls "
        "back to a copy each (with a warning saying why) when /dev/shm is too small.",
    )
    activation_offload: bool = option(
        False, "Checkpoint every block and keep its saved inputs in pinned host memory."
    )
    fp8_base: bool = option(
        False, "Store the frozen Linear weights of the blocks as float8 with block-wise scales."
    )
    fp8_matmul: bool = option(
        False, "Run those layers' forward matmul in fp8 (torch._scaled_mm) on GPUs that support it (sm 8.9+)."
    )
    attention: str = option(
        "sdpa",
        "Attention backend: sdpa, sdpa_math, sdpa_flash, sdpa_efficient, sdpa_cudnn, flash, flash3, sage, xformers.",
    )

    def __post_init__(self) -> None:
        n = self.blocks_to_swap
        if not (n == "auto" or (isinstance(n, int) and not isinstance(n, bool) and n >= 0)):
            raise ConfigError(f'memory.blocks_to_swap must be a whole number >= 0 or "auto", got {n!r}')
        if self.vram_budget_gb < 0:
            raise ConfigError(f"memory.vram_budget_gb must be >= 0, got {self.vram_budget_gb}")
        if self.swap_mode not in ("full", "h2d_only"):
            raise ConfigError(f"memory.swap_mode must be 'full' or 'h2d_only', got {self.swap_mode!r}")
        if self.fp8_matmul and not self.fp8_base:
            raise ConfigError("memory.fp8_matmul needs memory.fp8_base = true")
        from tuner.attention import get_backend  # imported here: config loading stays light

        try:
            get_backend(self.attention)
        except TunerError as e:
            raise ConfigError(f"key 'memory.attention': {e}") from None


@dataclass(frozen=True)
class DistributedConfig:
    strategy: Literal["ddp", "fsdp", "deepspeed", "pipeline"] = option(
        "ddp",
        "How several processes (`accelerate launch --num_processes N` / `torchrun`) share the work: ddp "
        "(each holds the whole model, gradients averaged), fsdp (FSDP2: weights, gradients and optimizer "
        "state sharded), deepspeed (ZeRO through accelerate's plugin) or pipeline (the blocks split into "
        "stages across processes). One process ignores it. See docs/distributed.md for which to pick.",
    )
    deepspeed_stage: Literal[2, 3] | None = option(
        None,
        "strategy = deepspeed: the ZeRO stage. 2 shards the optimizer state and the gradients of what trains "
        "(LoRA); 3 shards the weights too, the frozen base included (full fine-tunes, models that do not fit "
        "one card). Unset: the stage in deepspeed_config, else 2.",
    )
    deepspeed_offload_optimizer: bool | None = option(
        None,
        "strategy = deepspeed: keep the optimizer state (and its fp32 master weights) in host memory and step "
        "there, freeing their GPU memory for a slower step. Unset: as deepspeed_config says, else off.",
    )
    deepspeed_config: str = option(
        "",
        "strategy = deepspeed: a DeepSpeed JSON file of your own, merged under tuner's keys (e.g. "
        "zero_optimization's bucket sizes). It may not set the optimizer or the scheduler (tuner builds "
        "them from [train]); keys that contradict [train] or the deepspeed_* keys are refused by name.",
        path=True,
    )
    pipeline_microbatches: int = option(
        0,
        'strategy = "pipeline": micro-batches each batch is cut into, so the stages work at once (more keep '
        "them busier; each holds that many micro-batches' activations with GPipe, at most the stage count "
        "with 1F1B, used when there are at least as many micro-batches as stages). 0: one per stage; never "
        "more than the batch's samples.",
        ge=0,
    )
    pipeline_stages: int = option(
        0,
        'strategy = "pipeline": stages each pipeline has; the processes form (processes / stages) replicas of '
        "it that share the batches out and average each stage's gradients (pipeline × data parallel, laid "
        "out as DeepSpeed's pipeline engine: rank = stage × replicas + replica). 0: one stage per process.",
        ge=0,
    )


@dataclass(frozen=True)
class TrainingFile:
    """The whole training TOML."""

    model: ModelConfig = option(doc="Which model and checkpoints.")
    data: DataConfig = option(doc="Where the data is.")
    cache: CacheConfig = option(factory=CacheConfig, doc="Caching commands' settings.")
    network: NetworkConfig = option(factory=NetworkConfig, doc="The adapter being trained.")
    timesteps: TimestepConfig = option(factory=TimestepConfig, doc=TIMESTEPS_GUIDE)
    train: TrainConfig = option(factory=TrainConfig, doc="Optimizer, schedule and loop.")
    save: SaveConfig = option(factory=SaveConfig, doc="What is saved and when.")
    log: LogConfig = option(factory=LogConfig, doc="Progress and TensorBoard logging.")
    sample: SampleConfig = option(factory=SampleConfig, doc="Images or videos drawn while training.")
    one_frame: OneFrameConfig = option(
        factory=OneFrameConfig, doc="One-frame mode's time indices (framepack_1f, wan_1f)."
    )
    memory: MemorySettings = option(
        factory=MemorySettings,
        doc="Fitting big models in small GPUs: block swap, activation offload, fp8, attention.",
    )
    distributed: DistributedConfig = option(
        factory=DistributedConfig, doc="Training on several processes: DDP, FSDP2, DeepSpeed ZeRO, pipeline."
    )

    def __post_init__(self) -> None:
        # "auto" becomes the architecture's layout here, so `tuner check`, training and the files agree
        try:
            layout = resolve_save_format(
                self.model.architecture, self.save.format, self.network.dora, self.network.type == "full"
            )
        except ConfigError as e:
            raise ConfigError(f"key 'model.architecture': {e}") from None
        if layout != self.save.format:
            object.__setattr__(self, "save", replace(self.save, format=layout))  # frozen: set once, here
        check_save_format(self.network.dora, layout)
        _check_experts(self)
        _check_first_frame(self)
        _check_one_frame(self)
        _check_dora(self)
        _check_fused_backward(self.train)
        if self.sample.use_ema and not self.train.ema_decay:
            raise ConfigError(
                "key 'sample.use_ema': there is no EMA to draw with; set train.ema_decay (e.g. 0.999) or remove it."
            )
        if self.network.type == "full" and (self.memory.fp8_base or self.memory.blocks_to_swap != 0):
            # block swap and fp8 storage are for frozen weights: a swapped-out or fp8 copy of a weight
            # being trained would silently lose its updates
            raise ConfigError(
                "key 'network.type': a full fine-tune trains the weights that memory.fp8_base and "
                "memory.blocks_to_swap expect frozen; turn those off (use gradient checkpointing, "
                "activation_offload and an 8-bit or Adafactor optimizer instead)."
            )


def _check_first_frame(file: TrainingFile) -> None:
    """train.first_frame_conditioning_p: for architectures given a first frame, below 1 only for those that
    can train without it (`Architecture.first_frame`, `first_frame_required`)."""
    from tuner.registry import ARCHITECTURES, architecture

    p, name = file.train.first_frame_conditioning_p, file.model.architecture
    if p is None:
        return
    record = architecture(name)
    if record.first_frame is None:
        given = [a.name for a in ARCHITECTURES.values() if a.first_frame is not None]
        raise ConfigError(
            f"key 'train.first_frame_conditioning_p': {name} is not given a first frame; the key is for the "
            f"image-to-video architectures ({', '.join(given)}). Remove it."
        )
    if p < 1 and record.first_frame_required:
        raise ConfigError(
            f"key 'train.first_frame_conditioning_p': {name} cannot train without its first frame "
            f"({record.first_frame_required}); set 1 or remove the key."
        )


def _check_one_frame(file: TrainingFile) -> None:
    """[one_frame]: only for one-frame architectures (`Architecture.one_frame`); the target's index is not a
    reference's, and there is one index per reference image the architecture takes."""
    from tuner.registry import ARCHITECTURES, architecture

    one, name = file.one_frame, file.model.architecture
    record = architecture(name)
    if not record.one_frame:
        if one != OneFrameConfig():
            modes = ", ".join(a.name for a in ARCHITECTURES.values() if a.one_frame)
            raise ConfigError(
                f"section 'one_frame': {name} has no one-frame mode; remove it (it is for {modes})."
            )
        return
    low, high = record.control_images
    if not low <= len(one.clean_indices) <= high:
        raise ConfigError(f"key 'one_frame.clean_indices': {name} takes {low} to {high} reference images, one "
                          f"index each; got {list(one.clean_indices)}.")  # fmt: skip
    if any(i < 0 for i in one.clean_indices) or len(set(one.clean_indices)) < len(one.clean_indices):
        raise ConfigError(f"key 'one_frame.clean_indices': {list(one.clean_indices)}: indices must be distinct "
                          "and >= 0, e.g. [0] or [0, 10].")  # fmt: skip
    target = one.target(record.one_frame)
    if target in one.clean_indices:
        raise ConfigError(f"key 'one_frame.target_index': {target} is also a reference's index "
                          f"(one_frame.clean_indices = {list(one.clean_indices)}); choose another, e.g. "
                          f"{max(one.clean_indices) + 1}.")  # fmt: skip
    if record.one_frame == "frames":
        for key in ("no_post", "latent_window"):
            if getattr(one, key) != getattr(OneFrameConfig(), key):
                raise ConfigError(f"key 'one_frame.{key}': {name} has no post latent or section window (they "
                                  "are FramePack's); remove it.")  # fmt: skip
    elif not one.no_post and 1 + one.latent_window in (*one.clean_indices, target):
        raise ConfigError(f"key 'one_frame.latent_window': the zero post latent's index 1 + {one.latent_window} "
                          "is taken by a reference or the target; change it or set one_frame.no_post = true.")  # fmt: skip


def _check_dora(file: TrainingFile) -> None:
    """network.dora: refused for architectures whose saved DoRA would not load (`Architecture.dora_refused`)."""
    from tuner.registry import architecture

    if file.network.dora and (why := architecture(file.model.architecture).dora_refused):
        raise ConfigError(f"key 'network.dora': {file.model.architecture} cannot save a DoRA ComfyUI loads "
                          f"({why}); train without it (a LoRA, LoHa or LoKr).")  # fmt: skip


def _check_fused_backward(train: TrainConfig) -> None:
    """train.fused_backward steps each parameter as its gradient completes: refuse what needs them all."""
    if not train.fused_backward:
        return
    from tuner.optimizers.fused_backward import NOT_PER_PARAMETER

    conflicts = [
        (train.max_grad_norm > 0, "train.max_grad_norm = 0 (clipping by the total norm needs every gradient)"),
        (train.gradient_accumulation_steps > 1, "train.gradient_accumulation_steps = 1"),
        (train.mixed_precision == "fp16", "train.mixed_precision = 'bf16' (fp16's scaler checks all gradients)"),
        (train.optimizer.lower() in NOT_PER_PARAMETER,
         f"another optimizer than {train.optimizer} (its step looks at all parameters at once)"),
    ]  # fmt: skip
    needed = [fix for conflict, fix in conflicts if conflict]
    if needed:
        raise ConfigError(f"key 'train.fused_backward': set {'; '.join(needed)}, or turn fused_backward off.")


def _check_experts(file: TrainingFile) -> None:
    """model.transformer_2 / expert / boundary: set for two-expert models (Wan 2.2 A14B), unset for others."""
    from tuner.registry import architecture

    m = file.model
    record = architecture(m.architecture)
    if record.boundary is None:
        extra = [k for k in ("transformer_2", "expert", "boundary") if getattr(m, k)]
        if extra:
            raise ConfigError(
                f"key 'model.{extra[0]}': {m.architecture} has one transformer; remove it (it is for "
                "two-expert models such as wan22_t2v)."
            )
        return
    if not m.expert and not m.transformer_2:  # one checkpoint given: it is the one that trains
        m = replace(m, expert="high")
        object.__setattr__(file, "model", m)  # frozen: set once, here (as save.format's "auto")
    if not m.expert:
        raise ConfigError(
            f"key 'model.expert': {m.architecture} has two experts; choose which one trains: \"high\" "
            '(model.transformer, the high-noise expert), "low" (model.transformer_2, the low-noise '
            'expert) or "both" (one adapter file per expert).'
        )
    if m.expert in ("low", "both") and not m.transformer_2:
        raise ConfigError(
            f"key 'model.transformer_2': model.expert = {m.expert!r} trains the low-noise expert; set "
            "model.transformer_2 to its checkpoint (e.g. wan2.2_t2v_low_noise_14B_fp16.safetensors)."
        )
    boundary = m.boundary or record.boundary
    if m.expert != "both":
        lo, hi = (boundary, 1.0) if m.expert == "high" else (0.0, boundary)
        ts = file.timesteps
        if ts.max_timestep <= lo or ts.min_timestep >= hi:
            raise ConfigError(
                f"key 'timesteps.min_timestep' / 'max_timestep': [{ts.min_timestep}, {ts.max_timestep}] lies "
                f"outside the {m.expert}-noise expert's timesteps [{lo}, {hi}] (boundary {boundary})."
            )
        if file.sample.prompts and (file.sample.every_n_steps or file.sample.at_start):
            raise ConfigError(
                f"key 'sample.every_n_steps': samples of {m.architecture} need both experts, and "
                f"model.expert = {m.expert!r} loads one; draw them with `tuner generate` and the saved "
                'adapter, or train model.expert = "both".'
            )
    if m.expert == "both" and file.network.network_weights:
        raise ConfigError(
            "key 'network.network_weights': continuing from an adapter file is one expert at a time; train "
            'model.expert = "high" or "low" with that expert\'s file.'
        )
    if m.expert == "both" and file.network.type == "full":
        raise ConfigError(
            "key 'network.type': a full fine-tune of both 14B experts at once is not supported; fine-tune "
            'one expert at a time (model.expert = "high" or "low").'
        )
