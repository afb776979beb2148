"""Attention backends: one entry point that picks the kernel every attention layer of a model uses.

diffusers' transformers compute attention through one function, `dispatch_attention_fn`, which calls the
backend named by each attention processor (`model.set_attention_backend(...)`). Choosing a backend is
therefore a setting on the model, not a change of model code, and that is all this module does — plus
the checks diffusers leaves off by default, so a wrong choice fails at once with a message that says
what to do instead of deep inside a kernel:

    name            kernel                          needs                                   varlen
    sdpa            torch scaled_dot_product_attn   any device, any float dtype (default)   -
    sdpa_math       torch's reference math kernel   any device, any float dtype             -
    sdpa_flash      torch's FlashAttention-2        CUDA, bf16/fp16                         -
    sdpa_efficient  torch's memory-efficient kernel CUDA                                    -
    sdpa_cudnn      cuDNN attention through torch   CUDA, bf16/fp16                         -
    flash           flash-attn 2 (varlen)           `pip install flash-attn`, CUDA sm80+    yes
    flash3          flash-attn 3 (varlen)           FlashAttention-3 build, CUDA sm90       yes
    sage            SageAttention (varlen)          `pip install sageattention`, CUDA sm80+ yes
    xformers        xformers memory-efficient       `pip install xformers`, CUDA            -

"varlen" backends take a padding mask and pack the valid tokens (cu_seqlens) instead of computing on the
padding, so variable-length text costs only its real length. They are used for masked and unmasked
calls alike (without a mask every token is valid). SageAttention has no backward pass: it serves
generation only and is refused while gradients are being computed.

`set_backend(model, name)` validates and sets; `override(model, name)` is a context manager that
switches temporarily (tests use it to compare a kernel against sdpa). The device, dtype and training
constraints are checked on every attention call by a forward pre-hook; the dtype is the one the
projections produce (the autocast dtype when autocast is on, else the input's).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tuner.errors import TunerError

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Backend:
    name: str
    diffusers: str  # AttentionBackendName value
    module: str | None = None  # Python module whose presence means "installed"
    install: str = ""
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] | None = None  # None: any floating dtype
    min_capability: tuple[int, int] | None = None
    backward: bool = True
    varlen: bool = False


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("sdpa", "native", devices=("cpu", "cuda", "mps", "xpu")),
        Backend("sdpa_math", "_native_math", devices=("cpu", "cuda", "mps", "xpu")),
        Backend("sdpa_flash", "_native_flash", dtypes=HALF, min_capability=(8, 0)),
        Backend("sdpa_efficient", "_native_efficient"),
        Backend("sdpa_cudnn", "_native_cudnn", dtypes=HALF, min_capability=(8, 0)),
        Backend(
            "flash",
            "flash_varlen",
            "flash_attn",
            "pip install flash-attn --no-build-isolation",
            dtypes=HALF,
            min_capability=(8, 0),
            varlen=True,
        ),
        Backend(
            "flash3",
            "_flash_varlen_3",
            "flash_attn_interface",
            "build FlashAttention-3 from the flash-attention repository (hopper/)",
            dtypes=HALF,
            min_capability=(9, 0),
            varlen=True,
        ),
        Backend(
            "sage",
            "sage_varlen",
            "sageattention",
            "pip install sageattention",
            dtypes=HALF,
            min_capability=(8, 0),
            backward=False,
            varlen=True,
        ),
        Backend("xformers", "xformers", "xformers", "pip install xformers"),
    )
}
DEFAULT = "sdpa"
_STATE_ATTR = "_tuner_attention"


@dataclass
class _State:
    backend: Backend
    handles: list


def _installed(backend: Backend) -> bool:
    return backend.module is None or importlib.util.find_spec(backend.module) is not None


def get_backend(name: str) -> Backend:
    """The backend called `name`, or a TunerError listing the known ones."""
    if name not in BACKENDS:
        close = difflib.get_close_matches(name, BACKENDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TunerError(f"unknown attention backend {name!r}{hint}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def check_backend(name: str, device: torch.device | str) -> Backend:
    """Raise TunerError unless backend `name` is installed and can run on `device`."""
    backend = get_backend(name)
    device = torch.device(device)
    if not _installed(backend):
        raise TunerError(
            f"attention backend {name!r} is not installed ({backend.install}), or choose attention = 'sdpa'"
        )
    if device.type not in backend.devices:
        raise TunerError(
            f"attention backend {name!r} runs on {'/'.join(backend.devices)}, not on {device.type}; "
            "use attention = 'sdpa' there"
        )
    if backend.min_capability and device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < backend.min_capability:
            need = ".".join(map(str, backend.min_capability))
            raise TunerError(
                f"attention backend {name!r} needs a GPU of compute capability {need} or newer; "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
            )
    return backend


def available_backends(device: torch.device | str) -> list[str]:
    """Names of the backends installed and usable on `device`."""
    names = []
    for name in BACKENDS:
        with contextlib.suppress(TunerError):
            check_backend(name, device)
            names.append(name)
    return names


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of `model` that own an attention processor."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, "processor", None) is not None]


def set_backend(model: nn.Module, name: str, device: torch.device | str | None = None) -> None:
    """Route every attention layer of `model` to backend `name` (checked against `device`, by default
    the device of the model's first parameter)."""
    if device is None:
        device = next(model.parameters()).device
    backend = check_backend(name, device)
    modules = attention_modules(model)
    foreign = sorted(
        {type(m.processor).__name__ for _, m in modules if not hasattr(m.processor, "_attention_backend")}
    )
    if foreign and name != DEFAULT:
        raise TunerError(
            f"{type(model).__name__} has attention processors that do not go through diffusers' attention "
            f"dispatch ({', '.join(foreign)}); only attention = 'sdpa' works for it"
        )
    if not modules and name != DEFAULT:
        raise TunerError(f"{type(model).__name__} has no attention layers to set to {name!r}")
    _clear(model)
    if modules and hasattr(model, "set_attention_backend"):
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        process_default = _AttentionBackendRegistry._active_backend
        try:
            _quietly(model.set_attention_backend, backend.diffusers)
        except (RuntimeError, ValueError) as e:  # diffusers' own checks (e.g. a too old flash-attn)
            raise TunerError(f"attention backend {name!r} cannot be used: {e}") from None
        finally:  # diffusers also makes it every other model's default: this sets one model
            _AttentionBackendRegistry.set_active_backend(process_default)
    else:
        from diffusers.models.attention_dispatch import AttentionBackendName

        for _, module in modules:
            if hasattr(module.processor, "_attention_backend"):
                module.processor._attention_backend = AttentionBackendName(backend.diffusers)
    handles = [m.register_forward_pre_hook(_call_check(backend), with_kwargs=True) for _, m in modules]
    model.__dict__[_STATE_ATTR] = _State(backend, handles)


def current_backend(model: nn.Module) -> str:
    state = model.__dict__.get(_STATE_ATTR)
    return state.backend.name if state else DEFAULT


@contextlib.contextmanager
def override(model: nn.Module, name: str) -> Iterator[None]:
    """Use backend `name` for `model` inside the block, then go back to the previous one."""
    previous = current_backend(model)
    set_backend(model, name)
    try:
        yield
    finally:
        set_backend(model, previous)


def _clear(model: nn.Module) -> None:
    state = model.__dict__.pop(_STATE_ATTR, None)
    for handle in state.handles if state else ():
        handle.remove()


def _quietly(fn, *args) -> None:
    """diffusers logs an "experimental feature" warning on every set_attention_backend call."""
    log = logging.getLogger("diffusers.models.modeling_utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        fn(*args)
    finally:
        log.setLevel(level)


def _call_check(backend: Backend):
    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor):
            return
        device = x.device.type
        if device not in backend.devices:
            raise TunerError(f"attention backend {backend.name!r} cannot run on {device}; use 'sdpa' there")
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        if backend.dtypes and dtype not in backend.dtypes:
            raise TunerError(
                f"attention backend {backend.name!r} computes in bf16/fp16 only, but this model runs in {dtype}; "
                "load the model in bf16 (or use mixed precision), or use 'sdpa'"
            )
        if not backend.backward and torch.is_grad_enabled():
            raise TunerError(
                f"attention backend {backend.name!r} has no backward pass; use it for generate only"
            )

    return check
