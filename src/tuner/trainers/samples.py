"""Samples drawn while training: the configured prompts, rendered with the model as it is being trained.

The prompts (and any control images) are encoded once, before the first step, and the text encoder is
dropped again (when the text encoders train too, at each sampling step, by them as they are then); at each sampling step the adapters switch to eval mode (no dropout), the latents are
denoised by the same code `tuner generate` uses, and the VAE is loaded just long enough to decode.
Nothing here draws from the global random state, so a run with samples trains exactly like one without.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tuner.dtypes import DTYPES
from tuner.generate import (
    GenerateOptions,
    check_options,
    decode_and_write,
    encode_conditions,
    sample_latents,
    sampling_summary,
)


class TrainingSamples:
    def __init__(self, trainer, cfg, device: torch.device, out_dir: Path):
        self.trainer, self.cfg, self.device = trainer, cfg, device
        self.out_dir = out_dir
        sc = cfg.sample
        self.options = [
            GenerateOptions(
                prompt=prompt, out="", negative_prompt=sc.negative_prompt, controls=sc.controls, images=sc.images, width=sc.width,
                height=sc.height, frames=sc.frames, steps=sc.steps, guidance_scale=sc.guidance,
                embedded_guidance=sc.embedded_guidance, shift=sc.shift, seed=sc.seed, guidance_method=sc.guidance_method,
            )
            for prompt in sc.prompts
        ]  # fmt: skip
        for opts in self.options:
            check_options(trainer, opts)  # a wrong size fails now, not after hours of training
        # unset settings are the architecture's defaults; the log names what ran
        self.summary = sampling_summary(trainer, self.options[0]) if self.options else ""
        self.conditions = [encode_conditions(trainer, cfg, opts, device) for opts in self.options]

    def draw(self, model: nn.Module, trained: nn.Module, step: int, log: Callable[[str], None]) -> list[Path]:
        """Render every prompt at `step`; return the files written."""
        from tuner.distributed import owned_model

        model = owned_model(model)  # DeepSpeed's engine owns it: sample from the model itself (ZeRO-2)
        was_training = trained.training
        trained.eval()
        written = []
        dtype = DTYPES[self.cfg.model.dtype]
        conditions = self.conditions
        if self.trainer.trains_text_encoder:  # encoded again, by the text encoders as trained so far
            with torch.no_grad():
                conditions = [
                    encode_conditions(self.trainer, self.cfg, opts, self.device) for opts in self.options
                ]
        for i, (opts, (cond, uncond)) in enumerate(zip(self.options, conditions)):
            latents = sample_latents(
                self.trainer, model, opts, cond, uncond, self.device, dtype, progress=False
            )
            suffix = ".png" if opts.frames == 1 else ".mp4"
            out = self.out_dir / f"{self.cfg.save.output_name}-step{step:06d}-{i:02d}{suffix}"
            written.append(decode_and_write(self.trainer, self.cfg, latents, out, self.device))
        trained.train(was_training)
        log(f"samples at step {step} ({self.summary}): {', '.join(str(p) for p in written)}")
        return written
