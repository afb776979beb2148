"""Model single files as the file tools read and write them: keys kept as stored, fp8 scaled or not.

A single file may carry ComfyUI's `model.diffusion_model.` prefix (a full checkpoint also holds the VAE
and text encoders under other prefixes) and may be "scaled fp8". The tools change only the model's own
weights and write every other tensor back as it was, so `Checkpoint` keeps the stored keys and maps
component keys (`blocks.0.self_attn.q.weight`) onto them.

*Scaled fp8* (ComfyUI's `*_fp8_scaled.safetensors`): each linear weight is stored as float8_e4m3fn
together with a scalar `<module>.scale_weight`, and the true weight is `w8.float() * scale_weight`. One
scale per tensor maps its largest magnitude onto 448, the largest finite e4m3 value, so the tensor uses
the format's whole range; 3 mantissa bits leave a relative error of at most 2⁻⁴ per element. An empty
`scaled_fp8` tensor (of the fp8 dtype) marks the file so loaders know to apply the scales.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tuner.models.loading import load_tensors, strip_known_prefixes
from tuner.networks.keys import read_safetensors

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
SCALED_FP8_MARKER = "scaled_fp8"
_SCALE_SUFFIXES = (".scale_weight", ".scale_input")


@dataclass
class Checkpoint:
    """A model file's tensors under their stored keys (scaled fp8 already dequantized)."""

    tensors: dict[str, torch.Tensor]
    stored: dict[str, str]
    """Component key (prefix stripped) -> stored key, for the model's own tensors."""
    metadata: dict[str, str] = field(default_factory=dict)

    def modules(self) -> set[str]:
        """Names of the component's modules that have a weight matrix (what adapters can target)."""
        return {
            k.removesuffix(".weight")
            for k, v in self.component().items()
            if k.endswith(".weight") and v.ndim == 2
        }

    def component(self) -> dict[str, torch.Tensor]:
        return {k: self.tensors[s] for k, s in self.stored.items()}

    def float_dtype(self) -> torch.dtype:
        """The most common floating dtype of the model's tensors (what a dequantized file is cast to)."""
        dtypes = Counter(
            v.dtype for v in self.component().values() if v.is_floating_point() and v.dtype != FP8
        )
        return dtypes.most_common(1)[0][0] if dtypes else torch.bfloat16


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Load a single-file checkpoint (.safetensors or .pth) with scaled fp8 weights dequantized."""
    tensors = load_tensors(path)
    metadata = read_safetensors(path)[1] if Path(path).suffix == ".safetensors" else {}
    stored = strip_known_prefixes(tensors)
    scaled = {k: s for k, s in stored.items() if k.endswith(".weight") and _scale_key(k) in stored}
    if scaled or SCALED_FP8_MARKER in stored:
        plain = Checkpoint(tensors, stored).float_dtype()
        for key, stored_key in scaled.items():
            scale = tensors[stored[_scale_key(key)]].float()
            tensors[stored_key] = (tensors[stored_key].float() * scale).to(plain)
        for key in [k for k in stored if k == SCALED_FP8_MARKER or k.endswith(_SCALE_SUFFIXES)]:
            del tensors[stored.pop(key)]
    return Checkpoint(tensors, stored, metadata)


def _scale_key(weight_key: str) -> str:
    return weight_key.removesuffix(".weight") + ".scale_weight"


def quantize_scaled_fp8(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every weight matrix of the model stored as scaled fp8 (other
    tensors as they are), plus the `scaled_fp8` marker."""
    out = dict(checkpoint.tensors)
    prefix = _prefix(checkpoint)
    for key, stored_key in checkpoint.stored.items():
        tensor = out[stored_key]
        if not (key.endswith(".weight") and tensor.ndim == 2 and tensor.is_floating_point()):
            continue
        w = tensor.float()
        scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
        out[stored_key] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out[prefix + _scale_key(key)] = scale.reshape(())
    out[prefix + SCALED_FP8_MARKER] = torch.empty(0, dtype=FP8)
    return out


def _prefix(checkpoint: Checkpoint) -> str:
    key, stored_key = next(iter(checkpoint.stored.items()))
    return stored_key[: len(stored_key) - len(key)]
