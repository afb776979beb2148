"""Wan 2.2 A14B: a Wan network twice, as a high-noise and a low-noise expert (T2V and I2V).

Everything but the transformers is Wan 2.1's (the 16-channel Wan 2.1 VAE, UMT5-XXL, 1×2×2 patches,
4N+1 frames at 16 fps). `WanExpertsModel` adds two experts (`tuner.archs.parts.experts`) to the Wan trainer that
follows it in a subclass's bases: T2V A14B is Wan 2.1 T2V 14B's network (`WanModel`); I2V A14B takes
Wan 2.1 I2V's 36-channel input (noise, frame mask, first-frame condition latents) without its CLIP
image layers (`WanFrameConditionedModel`: no CLIP encoder, and the cache's latent entries are keyed by
the VAE alone).

* `model.expert = "high"` trains `model.transformer` on t in [boundary, 1]; `"low"` trains
  `model.transformer_2` on t in [0, boundary). One expert is loaded, and the timestep sampler is the
  configured one truncated to that expert's range (shape kept; `timesteps.min/max_timestep` narrow it
  further).
* `"both"` loads both, draws t over the whole range and sends each sample to its expert; one adapter
  per expert, saved as `<name>_high_noise.safetensors` and `<name>_low_noise.safetensors`. Memory
  settings (fp8, block swap) apply to each expert; on a GPU without block swap the idle expert waits
  in host memory.

The boundary is the release's (`Architecture.boundary`: T2V 0.875, I2V 0.9; diffusers'
`boundary_ratio`, t × 1000 compared with the scheduler's timestep) unless `model.boundary` says
otherwise. Sampling uses the releases' default shift: 12 (T2V), 5 (I2V).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tuner.archs.parts.experts import EXPERT_FIELDS, TimestepExperts
from tuner.archs.wan import loaders as wan
from tuner.archs.wan.trainer import WanModel
from tuner.archs.wan.trainer_i2v import WanFrameConditionedModel
from tuner.errors import CheckpointError, ConfigError


class WanExpertsModel(WanModel):
    """Two experts of the network the next Wan trainer in the bases feeds (its `predict` builds the
    inputs, this class picks the expert per sample)."""

    # ---- loading ----
    def load_transformer(self, dtype: torch.dtype) -> nn.Module:
        """The expert being trained, or both (`TimestepExperts`) for `model.expert = "both"`."""
        expert = self.cfg.model.expert
        if expert == "both":
            return self.load_experts(dtype)
        return self._load_expert(expert, dtype)

    def load_experts(self, dtype: torch.dtype) -> TimestepExperts:
        """Both experts, after checking that they are a pair (generation always needs both)."""
        self._check_pair()
        return TimestepExperts(
            self._load_expert("high", dtype), self._load_expert("low", dtype), self.boundary
        )

    def _load_expert(self, expert: str, dtype: torch.dtype) -> nn.Module:
        field = EXPERT_FIELDS[expert]
        path = self.weights_path(field)
        _check_named_for(path, expert, field)
        return wan.load_transformer(path, dtype, self.architecture, subfolder=field)

    def _check_pair(self) -> None:
        m = self.cfg.model
        high, low = self.weights_path("transformer"), self.weights_path("transformer_2")
        if Path(high).is_file() and Path(high).resolve() == Path(low).resolve():
            raise CheckpointError(
                f"{self.cfg.path}: model.transformer and model.transformer_2 are the same checkpoint ({high}); "
                "give the high-noise expert as transformer and the low-noise one as transformer_2."
            )
        variants = {f: wan.transformer_variant(getattr(m, f), f) for f in EXPERT_FIELDS.values()}
        if variants["transformer"] != variants["transformer_2"]:
            raise CheckpointError(
                f"{self.cfg.path}: the experts are not a pair: model.transformer ({high}) is variant "
                f"{variants['transformer'] or 'unknown'}, model.transformer_2 ({low}) is {variants['transformer_2'] or 'unknown'}. Give "
                "both experts of one release."
            )

    # ---- the model's inputs ----
    def pipeline_parts(self, model: nn.Module):
        """The network's parts for one expert (stages split one transformer; `model.expert = "both"` is
        refused before)."""
        if isinstance(model, TimestepExperts):
            raise ConfigError(
                "key 'model.expert': pipeline stages split one transformer; train one expert at a time "
                '(model.expert = "high" or "low") with distributed.strategy = "pipeline"'
            )
        return super().pipeline_parts(model)

    def predict(self, model: nn.Module, noisy: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        if not isinstance(model, TimestepExperts):
            return super().predict(model, noisy, t, cond)
        high = model.is_high(t)
        if high.all() or not high.any():  # the usual case: one expert for the whole batch
            return super().predict(model.activate("high" if high.all() else "low"), noisy, t, cond)
        out = torch.empty_like(noisy)
        for name, rows in (("high", high), ("low", ~high)):
            part = {k: v[rows] for k, v in cond.items()}
            out[rows] = super().predict(model.activate(name), noisy[rows], t[rows], part)
        return out


class Wan22T2VModel(WanExpertsModel):
    architecture = "wan22_t2v"


class Wan22I2VModel(WanExpertsModel, WanFrameConditionedModel):
    architecture = "wan22_i2v"


def _check_named_for(path: str, expert: str, field: str) -> None:
    """A release file named for the other expert (`..._low_noise_...` given as the high-noise one) is a
    swapped pair: their shapes are identical, so the name is all there is to go by."""
    other = "low" if expert == "high" else "high"
    name = str(path).replace("\\", "/").lower()
    if f"{other}_noise" in name and f"{expert}_noise" not in name:
        right = EXPERT_FIELDS[other]
        raise CheckpointError(
            f"{path}: this is the Wan 2.2 {other}-noise expert (by its name), given as model.{field}, the "
            f"{expert}-noise expert's slot. Give it as model.{right} (model.transformer holds the high-noise "
            "expert, model.transformer_2 the low-noise one, as in diffusers)."
        )
