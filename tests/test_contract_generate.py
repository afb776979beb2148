"""The contract's generation half: `tuner generate` draws what the architecture's diffusers pipeline
(its record's `pipeline`) draws, for every architecture that names one.

On the tiny fixture and the contract's cached project, `tuner generate` from the command line and the
pipeline loaded from the fixture's diffusers folder get the same seed, steps (2), guidance, embedded
guidance, shift, negative prompt and the smallest size; their pixels agree within float tolerance, without
and with a LoRA (tuner's file, read by `tuner generate --lora` and by the pipeline's own
`load_lora_weights` where it loads tuner's diffusers layout, else attached to the pipeline's transformer by
tuner). Where tuner samples otherwise on purpose, the record names the difference
(`ReferencePipeline.differs`) and the pipeline is given exactly it.
"""

import inspect

import diffusers
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

import tuner.generate
from project import cfg, random_lora, run
from tuner.diffusion.sampling import flow_sigmas
from tuner.generate import GenerateOptions, resolve_options
from tuner.networks.factory import apply_adapter_file
from tuner.registry import ARCHITECTURES

PROMPT = "a red dog"
# the text encoder in fp32, as the pipeline loads it (the cache's default, bf16, rounds its output)
FP32_TEXT = "cache.text_encoder_dtype='fp32'"
WITH_PIPELINES = [name for name, record in ARCHITECTURES.items() if record.pipeline is not None]


def _smallest(record) -> tuple[int, int, int]:
    """(width, height, frames): two latent patches a side, one frame where the model draws images."""
    side = record.spatial_step * 2
    frames = 1 if record.supports_images else record.frame_multiple + record.frame_remainder
    return side, side, max(frames, record.min_frames)


def _ours(capsys, monkeypatch, config, out, opts: GenerateOptions, *lora: str) -> torch.Tensor:
    """`tuner generate`'s pixels [C, F, H, W] in [0, 1], as the pipeline's `output_type="pt"` gives them."""
    written = []
    write = tuner.generate.write_media
    monkeypatch.setattr(
        tuner.generate, "write_media", lambda pixels, *a: written.append(pixels) or write(pixels, *a)
    )
    code, log = run(capsys, "generate", "--config", config, "--set", FP32_TEXT, "--prompt", PROMPT, "--size",
                    f"{opts.width}x{opts.height}", "--frames", opts.frames, "--steps", opts.steps, "--seed", 0,
                    "--device", "cpu", "--out", out, *lora)  # fmt: skip
    assert code == 0, log
    return (written[0].float() / 2 + 0.5).clamp(0, 1)


def _pipeline_call(family, pipe, opts: GenerateOptions) -> dict:
    """The pipeline's keyword arguments for the settings `opts` (resolved) samples with, its prompts padded
    or cut to the cache's text length as tuner's are. Pipelines that keep the guidance in their `guider` or
    the text length in `tokenizer_max_length` are set there."""
    record = family.record
    params = inspect.signature(pipe.__call__).parameters
    kw = {"prompt": PROMPT, "height": opts.height, "width": opts.width, "num_inference_steps": opts.steps,
          "output_type": "pt"}  # fmt: skip
    if opts.embedded_guidance is not None:  # guidance-distilled: the embedding takes `guidance_scale`
        kw["guidance_scale"] = opts.embedded_guidance
        if "true_cfg_scale" in params:
            kw["true_cfg_scale"] = opts.guidance_scale
        else:
            assert opts.guidance_scale == 1, f"{record.pipeline.name} has no real CFG beside the embedding"
    elif "true_cfg_scale" in params:  # real CFG apart from a (here unused) distilled guidance argument
        kw["true_cfg_scale"] = opts.guidance_scale
    elif "guidance_scale" in params:
        kw["guidance_scale"] = opts.guidance_scale
    else:  # pipelines that guide through their `guider` component
        pipe.guider = pipe.guider.new(guidance_scale=opts.guidance_scale)
    if opts.negative_prompt:
        kw["negative_prompt"] = opts.negative_prompt
    if "boolean_text_mask" in dict(record.pipeline.differs):
        embeds, _, mask, negative, _, negative_mask = pipe.encode_prompt(
            PROMPT, opts.negative_prompt, max_sequence_length=family.cfg.cache.text_max_length
        )
        del kw["prompt"]
        kw.pop("negative_prompt", None)
        kw.update(prompt_embeds=embeds, prompt_attention_mask=mask.bool(), negative_prompt_embeds=negative,
                  negative_prompt_attention_mask=negative_mask.bool())  # fmt: skip
    if "max_sequence_length" in params:
        kw["max_sequence_length"] = family.cfg.cache.text_max_length
    elif hasattr(pipe, "tokenizer_max_length"):  # pipelines that keep the text length as an attribute
        pipe.tokenizer_max_length = family.cfg.cache.text_max_length
    if "num_frames" in params:
        kw["num_frames"] = opts.frames
    return kw


def _same_schedule(record, pipe, opts: GenerateOptions) -> None:
    """The pipeline's scheduler at tuner's shift; one that shifts with the resolution keeps its own (tuner's
    equals it: the shift is part of what is compared). A "sigmas" difference spaces its steps as tuner does;
    "area" makes the asked size its default."""
    config = pipe.scheduler.config
    if "euler" in dict(record.pipeline.differs):
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(config, shift=opts.shift)
    elif opts.shift is not None and not config.get("use_dynamic_shifting"):
        pipe.scheduler = type(pipe.scheduler).from_config(config, shift=opts.shift)
    if "area" in dict(record.pipeline.differs):
        assert opts.width == opts.height
        pipe.default_sample_size = opts.width // pipe.vae_scale_factor
    if "sigmas" in dict(record.pipeline.differs):  # this pipeline's scheduler only, whatever it is asked
        set_timesteps = pipe.scheduler.set_timesteps
        pipe.scheduler.set_timesteps = lambda steps, device=None, **_: set_timesteps(
            sigmas=np.linspace(1.0, 1.0 / steps, steps), device=device
        )


def _theirs(pipe, kw: dict, seed: int = 0) -> torch.Tensor:
    out = pipe(**kw, generator=torch.Generator().manual_seed(seed))
    pixels = (out.images if hasattr(out, "images") else out.frames)[0].float()
    return pixels[:, None] if pixels.dim() == 3 else pixels.permute(1, 0, 2, 3)


@pytest.mark.slow
@pytest.mark.parametrize("contract", WITH_PIPELINES, indirect=True)
def test_generate_equals_the_diffusers_pipeline(contract, tmp_path, capsys, monkeypatch):
    arch, config, paths = contract
    record = ARCHITECTURES[arch]
    width, height, frames = _smallest(record)
    family = record.family_model(cfg(config, FP32_TEXT))
    opts = resolve_options(family, GenerateOptions(prompt=PROMPT, out="", width=width, height=height,
                                                   frames=frames, steps=2))  # fmt: skip
    pipe = getattr(diffusers, record.pipeline.name).from_pretrained(paths["diffusers"])
    pipe.set_progress_bar_config(disable=True)
    _same_schedule(record, pipe, opts)
    kw = _pipeline_call(family, pipe, opts)

    ours = _ours(capsys, monkeypatch, config, tmp_path / "base.png", opts)
    theirs = _theirs(pipe, kw)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)

    # with a LoRA: the file tuner saves, read by both
    denoiser = getattr(pipe, "transformer", None) or pipe.unet
    network = random_lora(denoiser, record.default_targets, record.checkpoint_layout())
    loads = record.diffusers_loader and record.diffusers_reads.get("diffusers") == "loads"
    lora = tmp_path / "lora.safetensors"
    network.save(lora, record.checkpoint_layout(), **({"format": "diffusers"} if loads else {}))
    network.remove()
    adapted = _ours(capsys, monkeypatch, config, tmp_path / "lora.png", opts, "--lora", lora)
    assert not torch.allclose(adapted, ours, rtol=1e-3, atol=1e-3), "the LoRA changes nothing: no check"
    if loads:
        pipe.load_lora_weights(str(lora))
    else:
        apply_adapter_file(denoiser, lora, 1.0, name_map=record.checkpoint_layout())
    torch.testing.assert_close(adapted, _theirs(pipe, kw), rtol=1e-4, atol=1e-4)


def test_pipeline_differences_are_known():
    from tuner.archs.record import PIPELINE_DIFFERENCES

    for name in WITH_PIPELINES:
        for difference, why in ARCHITECTURES[name].pipeline.differs:
            assert difference in PIPELINE_DIFFERENCES and why, (name, difference)


def test_sigmas_difference_is_tuners_schedule():
    """The sigmas the test gives a pipeline for the "sigmas" difference are tuner's before its shift."""
    for steps in (2, 5):
        torch.testing.assert_close(flow_sigmas(steps, 1.0)[:-1].double(),
                                   torch.from_numpy(np.linspace(1.0, 1.0 / steps, steps)))  # fmt: skip
