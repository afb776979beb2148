"""fp8 base weights: frozen Linear weights stored as float8 with block-wise scales.

A float8_e4m3fn number has 4 exponent bits, 3 mantissa bits and a largest finite value of 448. A weight
matrix W [out, in] is stored as

    W8[o, i] = round_fp8(W[o, i] / s[o, i // 64])      s[o, b] = max |W[o, 64b : 64b + 64]| / 448

one fp32 scale per output row and per block of 64 inputs (1/32 byte of overhead per weight). Rounding to
3 mantissa bits costs at most 2^-4 relative error per element in fp8's normal range, and values far below
their block's maximum fall into fp8's subnormals, whose spacing is 2^-9 · s, so the per-element bound is

    |W - dequant(W8)| <= max(2^-4 |W|, 2^-10 s)

fp8's exponent already gives every weight within 2^-6 of its scale's range the full relative precision;
below that, values turn subnormal and lose it. One scale per row would push a whole row into that range
when it holds a weight ~10^4 times its typical size; with 64-wide blocks only the outlier's 63 neighbours
are affected. When `in` is not a multiple of 64 the scale is per output row (per channel).

Memory: 1 byte per weight instead of 2 (bf16) — a 14B transformer goes from 28 GB to 14 GB. Compute:
CPUs and most GPUs cannot multiply fp8 tensors, and `F.linear` refuses mixed fp8/bf16 operands, so each
call dequantizes the weight into the compute dtype (`W8.to(bf16) * s`) right before the matmul. The
custom autograd function below saves the fp8 weight and its scales, not the dequantized copy, for the
backward pass (which needs W to compute dL/dx); a plain `F.linear` on the dequantized weight would keep a
bf16 copy of every layer alive until backward and undo the savings. Only dL/dx is computed: base weights
are frozen, adapters (LoRA) sit beside the layer in full precision and get their own gradients.

`fp8_matmul=True` runs the forward matmul itself in fp8 (`torch._scaled_mm`, on GPUs of compute
capability 8.9+): activations are quantized per token, weights per output row (the row-wise scaling
`_scaled_mm` supports, so block-wise scales are not used in this mode). The backward stays in bf16.

Norms, embeddings, modulation and the layers a model lists in `_keep_in_fp32_modules` keep their
precision: they are small, and their errors are amplified (a modulation scale multiplies every token).

The layer keeps its name and class; its `weight` becomes the fp8 tensor, a `fp8_scale` buffer holds the
scales and its `forward` is patched from outside, so state_dict keys are `<layer>.weight` (fp8) and
`<layer>.fp8_scale` (fp32). Checkpoints in that layout save and load with `save_fp8_checkpoint` /
`load_fp8_checkpoint`. ComfyUI's "fp8_scaled" files (one fp32 scale per tensor, see
`read_comfy_fp8`) load without requantizing: a per-tensor scale is just a [1, 1] scale here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tuner.errors import CheckpointError, TunerError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
BLOCK = 64
SCALE_KEY = "fp8_scale"
FORMAT = "tuner.fp8.e4m3fn.block64"

# Module-name fragments (lower case, regexes searched in the name) of layers kept in high precision. Data,
# not code: a new architecture whose modulation layer is called something else adds its fragment here.
# `_mod` is a whole word (`img_mod.lin`, `txt_mod`), not the start of one (`language_model.layers`).
KEEP_HIGH_PRECISION = ("norm", "embed", "modulation", "_mod(?![a-z])", "adaln", "time")
# Layers whose weight dtype a model reads to cast its inputs (regexes searched in the name): diffusers'
# Wan casts the timestep to the time embedder's dtype, so an fp8 weight there would make the timestep fp8.
# Even when a ComfyUI fp8 file stores them in fp8, they are left as the loader put them (dequantized);
# they are small. A family's own such layers are its layout's `read_for_dtype`.
READ_FOR_DTYPE = ("time_embedder",)

# --- the numbers ----------------------------------------------------------------------------------


def quantize_weight(
    weight: torch.Tensor, block_size: int | None = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [out, in], fp32 scales [out, in // block_size]) with weight ≈ dequantize_weight(...).
    Per output row ([out, 1]) when `block_size` is None or does not divide `in`."""
    w = weight.detach().float()
    rows, cols = w.shape
    if block_size and cols % block_size == 0:
        blocks = w.view(rows, cols // block_size, block_size)
        scale = blocks.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
        w8 = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, cols)
    else:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        w8 = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return w8, scale


def dequantize_weight(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W in `dtype` from its fp8 storage; `scale` is [out, blocks], [out, 1] or a single number."""
    rows, cols = w8.shape
    blocks = scale.shape[-1] if scale.ndim == 2 else 1
    if scale.numel() == 1 or blocks == 1:
        return w8.to(dtype) * scale.reshape(-1, 1).to(dtype)
    return (w8.to(dtype).view(rows, blocks, cols // blocks) * scale.to(dtype)[..., None]).view(rows, cols)


def fp8_matmul_supported(device: torch.device | str) -> bool:
    """Whether `torch._scaled_mm` can run on `device` (CUDA 8.9+; torch also implements it on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _scaled_mm(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x @ W.T with both operands in fp8: x per token, W per output row (scale [out, 1])."""
    x2 = x.reshape(-1, x.shape[-1])
    sx = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    x8 = (x2.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    y = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=scale.reshape(1, -1).float(), out_dtype=dtype)
    return y.view(*x.shape[:-1], w8.shape[0])


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T + b with W in fp8; saves the fp8 weight (not a dequantized copy) for dL/dx."""

    @staticmethod
    def forward(ctx, x, w8, scale, bias, use_scaled_mm: bool):
        dtype = _compute_dtype(x)
        if use_scaled_mm:
            y = _scaled_mm(x, w8, scale, dtype)
            if bias is not None:
                y = y + bias.to(dtype)
        else:
            y = F.linear(
                x.to(dtype), dequantize_weight(w8, scale, dtype), None if bias is None else bias.to(dtype)
            )
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(w8, scale)
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        w8, scale = ctx.saved_tensors
        grad_x = (grad @ dequantize_weight(w8, scale, grad.dtype)).to(ctx.x_dtype)
        return grad_x, None, None, None, None


class Fp8LinearForward:
    """Its bound `__call__` is installed as `layer.forward` of an nn.Linear whose weight is stored in fp8.

    A bound method rather than the object itself: torch.compile guards a callable object by identity, so
    every block would compile its own graph; a bound method is guarded by its function, which all
    layers share (`tuner.compile`)."""

    def __init__(self, module: nn.Linear, use_scaled_mm: bool):
        self.module = module
        self.use_scaled_mm = use_scaled_mm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        return _Fp8Linear.apply(x, m.weight, getattr(m, SCALE_KEY), m.bias, self.use_scaled_mm)


def fp8_forward(module: nn.Module) -> Fp8LinearForward | None:
    """The fp8 forward patched onto `module`, or None."""
    owner = getattr(module.__dict__.get("forward"), "__self__", None)
    return owner if isinstance(owner, Fp8LinearForward) else None


def is_fp8_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and fp8_forward(module) is not None


# --- layers and models ----------------------------------------------------------------------------


def store_linear_fp8(
    module: nn.Linear,
    w8: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    *,
    block_size: int | None = BLOCK,
    fp8_matmul: bool = False,
    name: str = "",
) -> None:
    """Store one frozen nn.Linear's weight in fp8 (quantized here unless `w8`, `scale` are given) and
    patch its forward. Must happen before adapters or other forward patches are attached."""
    if "forward" in module.__dict__ and not is_fp8_linear(module):
        raise TunerError(
            f"cannot store {name or 'a linear layer'} in fp8: its forward is already patched (an adapter "
            "or hook was attached first). Apply memory settings before attaching adapters."
        )
    if module.weight.requires_grad:
        raise TunerError(f"{name or 'a linear layer'} is trainable; only frozen base weights can be fp8")
    use_mm = fp8_matmul and module.in_features % 16 == 0 and module.out_features % 16 == 0
    if w8 is None:
        w8, scale = quantize_weight(module.weight, None if use_mm else block_size)
    scale = (scale if scale.ndim == 2 else scale.reshape(1, 1)).float()
    if use_mm and scale.shape[1] != 1:  # block-wise scales given (a loaded checkpoint): no fp8 matmul
        use_mm = False
    if use_mm and scale.shape[0] == 1:  # one scale per tensor (ComfyUI): _scaled_mm wants one per row
        scale = scale.expand(module.out_features, 1).contiguous()
    device = module.weight.device
    module.weight = nn.Parameter(w8.to(device), requires_grad=False)
    scale = scale.to(device)
    if SCALE_KEY in module._buffers:
        module._buffers[SCALE_KEY] = scale
    else:
        module.register_buffer(SCALE_KEY, scale)
    module.forward = Fp8LinearForward(module, use_mm).__call__


def keeps_high_precision(
    name: str, model: nn.Module | None = None, keep: Iterable[str] = KEEP_HIGH_PRECISION
) -> bool:
    """Whether the layer called `name` stays out of fp8 (norms, embeddings, modulation, fp32 modules)."""
    lower = name.lower()
    if any(re.search(fragment, lower) for fragment in keep):
        return True
    fp32_modules = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    return bool(fp32_modules.intersection(name.split(".")))


def reads_own_dtype(name: str, layout: object = None) -> bool:
    """Whether the model casts the input of the layer called `name` to the layer's weight dtype
    (`READ_FOR_DTYPE`, and the `read_for_dtype` of `layout`, a `CheckpointLayout`): such a layer cannot run
    from fp8 storage."""
    fragments = (*READ_FOR_DTYPE, *getattr(layout, "read_for_dtype", ()))
    return any(re.search(fragment, name) for fragment in fragments)


def quantize_linears(
    model: nn.Module,
    *,
    prefixes: Iterable[str] | None = None,
    block_size: int | None = BLOCK,
    fp8_matmul: bool = False,
    keep: Iterable[str] = KEEP_HIGH_PRECISION,
) -> list[str]:
    """Store the frozen Linear weights of `model` in fp8 and return their names. `prefixes` limits it to
    modules under those names (e.g. the block lists, `("blocks",)`); layers `keeps_high_precision`
    names and layers already in fp8 are left alone."""
    prefixes = tuple(p.rstrip(".") + "." for p in prefixes) if prefixes is not None else None
    keep = tuple(keep)
    done = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or is_fp8_linear(module):
            continue
        if prefixes is not None and not name.startswith(prefixes):
            continue
        if keeps_high_precision(name, model, keep) or not module.weight.is_floating_point():
            continue
        store_linear_fp8(module, block_size=block_size, fp8_matmul=fp8_matmul, name=name)
        done.append(name)
    return done


def fp8_linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if is_fp8_linear(module)]


# --- files: our own layout ------------------------------------------------------------------------


def save_fp8_checkpoint(
    model: nn.Module, path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> None:
    """Write `model.state_dict()` with its fp8 layers (weight in fp8 + `fp8_scale`) to a safetensors file."""
    from tuner.io import save_safetensors

    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    meta = {
        **(metadata or {}),
        "tuner.format": FORMAT,
        "tuner.fp8_layers": json.dumps(fp8_linear_names(model)),
    }
    save_safetensors(state, path, metadata=meta)


def load_fp8_checkpoint(model: nn.Module, path: str | os.PathLike, *, fp8_matmul: bool = False) -> list[str]:
    """Load a file written by `save_fp8_checkpoint` into a model of the same architecture: layers with an
    `fp8_scale` in the file become fp8 layers, every other tensor is loaded as stored. Returns the fp8
    layer names. Raises CheckpointError when keys are missing or unexpected."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    modules = dict(model.named_modules())
    layers = [k[: -len(SCALE_KEY) - 1] for k in tensors if k.endswith("." + SCALE_KEY)]
    for layer in layers:
        module = modules.get(layer)
        if not isinstance(module, nn.Linear):
            raise CheckpointError(
                f"{path}: fp8 layer {layer!r} is not a linear layer of {type(model).__name__}"
            )
        store_linear_fp8(
            module, tensors.pop(layer + ".weight"), tensors.pop(layer + "." + SCALE_KEY),
            fp8_matmul=fp8_matmul, name=layer,
        )  # fmt: skip
    expected = {k for k in model.state_dict() if not any(k.startswith(layer + ".") for layer in layers)}
    expected |= {f"{layer}.bias" for layer in layers if modules[layer].bias is not None}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: does not match {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        model.load_state_dict(tensors, strict=False, assign=True)
    return layers


# --- files: ComfyUI's fp8 checkpoints ------------------------------------------------------------
#
# Two layouts exist, both with one fp32 scale per weight tensor (W = W8 * scale):
#   legacy "fp8_scaled": `<layer>.weight` (float8_e4m3fn), `<layer>.scale_weight` (fp32 scalar), optional
#     `<layer>.scale_input`, and a marker tensor `scaled_fp8` (its dtype names the fp8 type).
#   "comfy_quant" (newer): `<layer>.weight`, `<layer>.weight_scale` (fp32 scalar), optional
#     `<layer>.input_scale` and `<layer>.comfy_quant` (JSON bytes such as {"format": "float8_e4m3fn"}),
#     with the list of layers also in the header's `_quantization_metadata`.
# Keys may carry ComfyUI's `model.diffusion_model.` prefix. Input scales are ignored: fp8 matmul here
# scales activations per token at run time.

_COMFY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_COMFY_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")


def read_comfy_fp8(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{layer name without prefix: (fp8 weight, fp32 scale)} for every fp8 layer of a ComfyUI file."""
    layers = {}
    # A file whose model keys carry the prefix may bundle other components beside them (SD 3.5's fp8
    # release: `text_encoders.t5xxl.*` in fp8 too); only the prefixed layers are the model's.
    prefixed = any(key.startswith(_COMFY_PREFIXES) for key in tensors)
    for key, scale in tensors.items():
        suffix = next((s for s in _COMFY_SCALE_SUFFIXES if key.endswith(s)), None)
        if suffix is None or (prefixed and not key.startswith(_COMFY_PREFIXES)):
            continue
        stem = key[: -len(suffix)]
        weight = tensors.get(stem + ".weight")
        if weight is None or weight.dtype != FP8:
            continue  # other formats (nvfp4, int8) are not fp8 layers
        for prefix in _COMFY_PREFIXES:
            stem = stem.removeprefix(prefix)
        layers[stem] = (weight, scale.float().reshape(1, 1))
    return layers


def load_comfy_fp8_weights(
    model: nn.Module,
    path: str | os.PathLike,
    name_map: Callable[[str], str] | None = None,
    *,
    fp8_matmul: bool = False,
) -> list[str]:
    """Store the linear layers of `model` that a ComfyUI fp8 file holds in fp8 with the file's exact
    values and scales (no dequantize / requantize round trip). `name_map` turns the file's layer names
    (original release layout, e.g. `blocks.0.self_attn.q`) into `model`'s (`blocks.0.attn1.to_q`); when
    it is an architecture layout's `inverse` (`tuner.networks.layouts`), a fused layer (FLUX's
    `img_attn.qkv`) is split into its parts: each gets its rows of the stored fp8 weight and the layer's
    per-tensor scale, which is exact. Only fp8 layers are touched; load the rest as usual. Layers of the
    other components a layout says the file bundles under the model's prefix (`CheckpointLayout.bundled`:
    LTX-2's text connectors) are left alone, and so are the layers whose dtype the model reads
    (`reads_own_dtype`). Returns the model names of the layers."""
    from safetensors import safe_open

    from tuner.networks.layouts import diffusers_tensors

    if Path(path).suffix != ".safetensors":
        return []
    with safe_open(str(path), framework="pt") as f:
        keys = [k for k in f.keys() if k.endswith(_COMFY_SCALE_SUFFIXES) or k.endswith(".weight")]
        scale_stems = {k.rsplit(".", 1)[0] for k in keys if k.endswith(_COMFY_SCALE_SUFFIXES)}
        tensors = {k: f.get_tensor(k) for k in keys if k.rsplit(".", 1)[0] in scale_stems}
    modules = dict(model.named_modules())
    layout = getattr(name_map, "layout", name_map)  # a layout's inverse carries the layout
    skip = getattr(layout, "bundled", ())
    done = []
    for stem, (w8, scale) in read_comfy_fp8(tensors).items():
        if stem.startswith(skip):
            continue
        try:
            parts = diffusers_tensors(f"{stem}.weight", w8, name_map)
        except KeyError as e:
            raise CheckpointError(
                f"{path}: fp8 layer {stem!r} has no name in the model's layout ({e})"
            ) from None
        for key, rows in parts.items():
            name = key.removesuffix(".weight")
            if reads_own_dtype(name, layout):
                continue
            module = modules.get(name)
            if _weight_outside_linear(module, rows):
                continue  # e.g. HiDream's MoE routers: left as the loader put them (dequantized)
            if not isinstance(module, nn.Linear) or tuple(module.weight.shape) != tuple(rows.shape):
                raise CheckpointError(
                    f"{path}: fp8 layer {stem!r} has no matching linear layer {name!r} in the model"
                )
            store_linear_fp8(module, rows, scale.clone(), fp8_matmul=fp8_matmul, name=name)
            done.append(name)
    return done


def _weight_outside_linear(module: nn.Module | None, rows: torch.Tensor) -> bool:
    """Whether an fp8 tensor of a file is the `weight` parameter of a module that is no linear layer (a
    MoE router multiplying by its raw weight): fp8 storage is for linear layers, so such a tensor keeps
    the dequantized values the loader gave it."""
    weight = getattr(module, "weight", None)
    return (
        module is not None
        and not isinstance(module, nn.Linear)
        and isinstance(weight, nn.Parameter)
        and tuple(weight.shape) == tuple(rows.shape)
    )


def is_comfy_fp8_file(path: str | os.PathLike) -> bool:
    """Whether a safetensors file holds ComfyUI fp8 layers (header only, no data read)."""
    from safetensors import safe_open

    if Path(path).suffix != ".safetensors" or not Path(path).is_file():
        return False
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        keys = list(f.keys())
    pattern = re.compile(r"(^|\.)(scaled_fp8|[^.]+\.(scale_weight|weight_scale))$")
    return "_quantization_metadata" in metadata or any(pattern.search(k) for k in keys)
