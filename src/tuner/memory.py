"""Fitting a big model in a small GPU: the one entry point training and generation call.

`apply_memory_settings(model, settings, device)` takes a freshly loaded, frozen transformer (on the CPU,
or anywhere) and attaches, from outside and in this order:

1. fp8 base weights (`tuner.fp8`): the Linear layers inside the transformer blocks are stored as float8
   with block-wise scales (exact values from a ComfyUI fp8 file when one is given);
2. the attention backend (`tuner.attention`);
3. with `compile`, torch.compile on each block (`tuner.compile`), before the wrappers below, which must
   stay outside the compiled code;
4. activation checkpointing with the block inputs parked in pinned host memory (`tuner.offload`);
5. block swap, which also places the model: the non-swapped parts go to `device`, the swapped blocks'
   weights to pinned host memory — one copy in shared memory for all the processes on the machine when
   there are several (`share_swapped_weights`). Without block swap the whole model goes to `device`.

Call it before attaching adapters (they patch the same Linear forwards from outside, and must wrap the
fp8 forward, not the other way round), after `enable_gradient_checkpointing()`, and do not move the model
afterwards. A text encoder used for caching is made smaller with `quantize_text_encoder`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from tuner import attention, fp8
from tuner.compile import CompiledBlocks, compile_blocks
from tuner.config.schema import MemorySettings
from tuner.errors import ConfigError, TunerError
from tuner.offload import BlockSwap, CheckpointBlocks, Transfer, transfer_for
from tuner.offload.shared import machine_peers

logger = logging.getLogger(__name__)

SwapMode = Literal["full", "h2d_only"]
TEXT_ENCODER_QUANT = ("fp8", "int8", "nf4")


@dataclass
class MemoryHandle:
    """What `apply_memory_settings` attached, for logging and for taking it off again."""

    settings: MemorySettings
    device: torch.device
    block_lists: tuple[str, ...]
    fp8_layers: list[str] = field(default_factory=list)
    block_swap: BlockSwap | None = None
    checkpointing: CheckpointBlocks | None = None
    compiled: CompiledBlocks | None = None

    def summary(self) -> str:
        s = self.settings
        parts = [
            f"fp8 base on {len(self.fp8_layers)} layers{' (fp8 matmul)' if s.fp8_matmul else ''}"
            if self.fp8_layers else "base weights as loaded",
            self.block_swap.summary() if self.block_swap else "block swap off",
            "activations offloaded to host" if self.checkpointing else "",
            f"{len(self.compiled.modules)} blocks compiled" if self.compiled else "",
            f"attention {s.attention}",
        ]  # fmt: skip
        return ", ".join(p for p in parts if p)

    def remove(self) -> None:
        """Take block swap, activation offload and compilation off (fp8 storage and the attention backend
        stay)."""
        if self.block_swap:
            self.block_swap.remove()
        if self.checkpointing:
            self.checkpointing.remove()
        if self.compiled:
            self.compiled.remove()


def block_lists_of(model: nn.Module) -> tuple[str, ...]:
    """The block-list attribute names of a model whose class an architecture record names."""
    from tuner.registry import ARCHITECTURES

    name = type(model).__name__
    for record in ARCHITECTURES.values():
        if record.model_class == name:
            return record.block_lists
    raise TunerError(
        f"no architecture record names {name}; pass block_lists= (the attribute names of its "
        "nn.ModuleList of transformer blocks, in execution order)"
    )


def apply_memory_settings(
    model: nn.Module,
    settings: MemorySettings,
    device: torch.device | str,
    *,
    block_lists: Sequence[str] | None = None,
    fp8_source: str | None = None,
    name_map: Callable[[str], str] | None = None,
    probe_forwards: int = 1,
    transfer: Transfer | None = None,
    compile: bool | str | Callable = False,
) -> MemoryHandle:
    """Attach fp8 storage, the attention backend, activation offload and block swap to a frozen `model`
    and place it on `device` (see the module docstring).

    `block_lists` defaults to those of the architecture record naming the model's class. `fp8_source` is the checkpoint the
    model came from: when it is a ComfyUI fp8 file its fp8 layers keep their exact stored values
    (`name_map` turns its layer names into the model's). `probe_forwards`: with blocks_to_swap = "auto",
    the forward passes measured before N is chosen (training: the gradient-accumulation steps, so an
    optimizer step is included). `transfer` replaces the CUDA copy engine (tests pass a FakeTransfer).
    `compile`: True compiles each block with torch.compile's default backend; a backend name or callable
    picks another (tests count compiles with one)."""
    device = torch.device(device)
    lists = tuple(block_lists) if block_lists is not None else block_lists_of(model)
    _refuse_adapters(model)
    handle = MemoryHandle(settings, device, lists)

    # ---- fp8 base weights ----
    if settings.fp8_base:
        matmul = settings.fp8_matmul and fp8.fp8_matmul_supported(device)
        if settings.fp8_matmul and not matmul:
            logger.warning("memory.fp8_matmul: %s cannot multiply in fp8; dequantizing instead", device)
        if fp8_source and fp8.is_comfy_fp8_file(fp8_source):
            fp8.load_comfy_fp8_weights(model, fp8_source, name_map, fp8_matmul=matmul)
        fp8.quantize_linears(model, prefixes=lists, fp8_matmul=matmul)
        handle.fp8_layers = fp8.fp8_linear_names(model)

    # ---- attention ----
    attention.set_backend(model, settings.attention, device)

    # ---- regional compilation: inside the wrappers below (they move weights, wait on streams) ----
    if compile:
        handle.compiled = compile_blocks(model, lists, **({} if compile is True else {"backend": compile}))

    # ---- activations and block swap (these also place the model) ----
    swapping = settings.blocks_to_swap != 0
    if (swapping or settings.activation_offload) and transfer is None:
        transfer = transfer_for(device)
    if settings.activation_offload:
        handle.checkpointing = CheckpointBlocks(model, lists, offload=True, transfer=transfer)
    if swapping:
        budget = int(settings.vram_budget_gb * 2**30) or None
        share = settings.share_swapped_weights and settings.swap_mode == "h2d_only"
        handle.block_swap = BlockSwap(
            model, lists, settings.blocks_to_swap, transfer, mode=settings.swap_mode,
            budget_bytes=budget, probe_forwards=probe_forwards, peers=machine_peers() if share else None,
        )  # fmt: skip
    elif transfer is not None:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.data = transfer.to_device(t.data)
    else:
        model.to(device)
    return handle


def _refuse_adapters(model: nn.Module) -> None:
    patched = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and "forward" in m.__dict__ and not fp8.is_fp8_linear(m)
    ]
    if patched:
        raise TunerError(
            f"apply_memory_settings must run before adapters are attached; {patched[0]} already has a patched "
            "forward"
        )


# --- text encoders ----------------------------------------------------------------------------------


def text_encoder_dtype(precision: str) -> torch.dtype:
    """The dtype to load a text encoder in for `cache.text_encoder_dtype`: as named, or bf16 before
    fp8 / int8 / nf4 quantization."""
    from tuner.dtypes import DTYPES

    return DTYPES.get(precision, torch.bfloat16)


def place_text_encoder(
    model: nn.Module,
    precision: str,
    device: torch.device | str,
    blocks_to_swap: int = 0,
    *,
    transfer: Transfer | None = None,
) -> nn.Module:
    """Quantize a loaded text encoder when `precision` asks for it (fp8 / int8 / nf4), then place it on
    `device`: whole, or with its last `blocks_to_swap` layers streamed from pinned host memory
    (`cache.text_encoder_blocks_to_swap`; see `stream_text_encoder`)."""
    if blocks_to_swap and precision in ("int8", "nf4"):
        raise ConfigError(
            f"a {precision} text encoder cannot be streamed; use cache.text_encoder_dtype = 'fp8' or "
            "cache.text_encoder_blocks_to_swap = 0"
        )
    if precision in TEXT_ENCODER_QUANT:
        quantize_text_encoder(model, precision, "cpu" if blocks_to_swap else device)
    if blocks_to_swap:
        stream_text_encoder(model, blocks_to_swap, device, transfer=transfer)
        return model
    return model.to(device)


def text_encoder_layers(model: nn.Module) -> str:
    """The dotted name of a text encoder's stack of layers: its largest `nn.ModuleList` by parameter count
    (T5's `encoder.block`, CLIP's `text_model.encoder.layers`, a decoder LLM's `model.layers`, or a
    vision-language model's language layers rather than its vision blocks)."""
    lists = [
        (sum(p.numel() for p in module.parameters()), name)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
    ]
    if not lists:
        raise TunerError(f"{type(model).__name__} has no list of layers to stream")
    return max(lists)[1]


def stream_text_encoder(
    model: nn.Module, blocks_to_swap: int, device: torch.device | str, *, transfer: Transfer | None = None
) -> BlockSwap:
    """Block swap for a frozen text encoder, forward only: the last `blocks_to_swap` layers of its layer
    stack (at most all of them) stay in pinned host memory and are copied to `device` one ahead of use,
    overlapped with the layer before; the rest of the encoder is placed on `device`. This is how a text
    encoder larger than the GPU (FLUX.2 dev's 24B Mistral in bf16 or fp8) encodes captions at the cost
    of one host-to-device copy of those layers per batch. The outputs are the resident encoder's: only
    where the weights wait between uses changes, so cache entries need no key of their own."""
    layers = text_encoder_layers(model)
    count = min(blocks_to_swap, len(model.get_submodule(layers)))
    swap = BlockSwap(model, (layers,), count, transfer or transfer_for(device))
    logger.info(
        "text encoder %s: %s of %s streamed from host memory", type(model).__name__, swap.summary(), layers
    )
    return swap


def quantize_text_encoder(model: nn.Module, mode: str, device: torch.device | str = "cpu") -> int:
    """Make a frozen text encoder smaller for caching: "fp8" (block-wise float8, dequantized per call),
    "int8" (bitsandbytes LLM.int8) or "nf4" (bitsandbytes 4-bit NormalFloat). Embeddings, norms and the
    model's `_keep_in_fp32_modules` stay as they are. Moves the model to `device`; returns the number of
    Linear layers converted."""
    if mode not in TEXT_ENCODER_QUANT:
        raise ConfigError(
            f"text encoder quantization must be one of {', '.join(TEXT_ENCODER_QUANT)}, got {mode!r}"
        )
    model.requires_grad_(False)
    if mode == "fp8":
        count = len(fp8.quantize_linears(model))
        model.to(device)
        return count
    import bitsandbytes as bnb

    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not fp8.keeps_high_precision(name, model)
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        has_bias = linear.bias is not None
        if mode == "int8":
            new = bnb.nn.Linear8bitLt(
                linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False
            )
            new.weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False, has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(
                linear.in_features, linear.out_features, has_bias, linear.weight.dtype, quant_type="nf4"
            )
            new.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4")
        if has_bias:
            new.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        setattr(parent, child, new)
    model.to(device)  # bitsandbytes quantizes when the weights are moved to their device
    return len(targets)
