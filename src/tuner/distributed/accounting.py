"""What one training process holds in memory before step 1: parameters, gradients, optimizer state.

Counted from the real tensors, not from a table of model sizes:

- parameters: every parameter of the model and of what trains (each tensor once; an adapter's are its
  own, a full fine-tune's are the model's), at its stored dtype; those a block swap keeps in host
  memory are counted apart.
- gradients: one per trained parameter, in its dtype (the optimizer steps on them).
- optimizer state: what the optimizer holds per trained element. Before the first step most optimizers
  hold nothing yet (they create their state on the first step), so the configured optimizer, with its
  own settings, takes one step on a probe of each trained shape and dtype, and its state per element
  is scaled to the parameters of that shape. Dimensions are capped at 1024 (a probe of a 5120 × 13824
  matrix would cost a quarter GiB): exact for element-wise optimizers (AdamW: two moments; Lion: one;
  8-bit ones: a byte per moment plus block scales), an upper bound for factored ones on larger
  matrices (Adafactor keeps a row and a column per matrix, fewer bytes per element the wider it is).
  A resumed optimizer's state is counted as it is.

A strategy turns these per-model figures into per-process ones (DDP: the same on every process; FSDP
and ZeRO: shares of them).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_PROBE_SIDE = 1024  # the longest probe dimension


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of one whole model's training state (see the module docstring)."""

    frozen: int  # parameters that do not train
    trained: int  # parameters that train
    host: int  # of frozen: kept in host memory (block swap), not on the device
    gradients: int
    optimizer_state: int | None  # None: the optimizer could not be probed; known after step 1

    @property
    def parameters(self) -> int:
        return self.frozen + self.trained

    @property
    def total(self) -> int | None:
        if self.optimizer_state is None:
            return None
        return self.parameters + self.gradients + self.optimizer_state

    def describe(self) -> str:
        state = "unknown before step 1" if self.optimizer_state is None else size(self.optimizer_state)
        host = f", {size(self.host)} of them in host memory" if self.host else ""
        total = f"; total {size(self.total)}" if self.total is not None else ""
        return (
            f"parameters {size(self.parameters)} (trained {size(self.trained)}{host}), gradients "
            f"{size(self.gradients)}, optimizer state {state}{total}"
        )


def memory_plan(model: nn.Module, trained: nn.Module, optimizer, device: torch.device) -> MemoryPlan:
    """The `MemoryPlan` of `model` training `trained` with `optimizer` on `device`."""
    params = {id(p): p for module in (model, trained) for p in module.parameters()}.values()
    learning = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    elsewhere = torch.device(device).type
    return MemoryPlan(
        frozen=_bytes(frozen),
        trained=_bytes(learning),
        host=_bytes([p for p in frozen if p.device.type != elsewhere]),
        gradients=_bytes(learning),
        optimizer_state=optimizer_state_bytes(optimizer, learning),
    )


def optimizer_state_bytes(optimizer, params: list[torch.Tensor]) -> int | None:
    """The optimizer state `optimizer` holds, or will hold after its first step, for `params`."""
    chain = _unwrapped(optimizer)
    inner = chain[-1]
    if params and all(p in inner.state and inner.state[p] for p in params):
        return sum(tree_bytes(inner.state[p]) for p in params)
    elements: dict[tuple, int] = {}  # (dtype, probe shape) -> trained elements it stands for
    for p in params:
        key = (p.dtype, tuple(min(n, _PROBE_SIDE) for n in p.shape))
        elements[key] = elements.get(key, 0) + p.numel()
    total = 0.0
    for (dtype, shape), count in elements.items():
        per_element = _probe(chain, dtype, shape, params[0].device)
        if per_element is None:
            return None
        total += per_element * count
    return round(total)


def size(n: int) -> str:
    """Bytes as a short figure in binary units."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _unwrapped(optimizer) -> list:
    """The optimizer and what it wraps, outermost first (accelerate's wrapper, stochastic rounding)."""
    chain = [optimizer]
    while "optimizer" in vars(chain[-1]):
        chain.append(vars(chain[-1])["optimizer"])
    return chain


def _probe(chain: list, dtype: torch.dtype, shape: tuple, device: torch.device) -> float | None:
    """State bytes per element the optimizer keeps for a parameter of `dtype` and `shape`, from one step
    on a probe: a new optimizer of the innermost class with its settings, wrapped as the real one is
    (stochastic rounding keeps bf16 parameters' state in fp32), not in accelerate's wrapper."""
    from tuner.networks.full import StochasticRounding
    from tuner.optimizers.build import schedule_free

    inner = chain[-1]
    accepted = inspect.signature(type(inner)).parameters
    settings = {k: v for k, v in inner.defaults.items() if k in accepted}
    probe = torch.full(
        shape, 0.01, dtype=dtype, device=device, requires_grad=True
    )  # not 0: Prodigy keeps no p0 of zeros
    probe.grad = torch.full_like(probe, 1e-3)
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):  # the run's random streams stay untouched
            optimizer = type(inner)([probe], **settings)
            if any(isinstance(o, StochasticRounding) for o in chain):
                optimizer = StochasticRounding(optimizer)
            if sf := schedule_free(optimizer):
                sf.train()
            optimizer.step()
    except Exception:  # an optimizer that cannot step on a probe: its state is known after step 1
        return None
    state = _unwrapped(optimizer)[-1].state
    return tree_bytes(dict(state)) / probe.numel()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def tree_bytes(tree: Any) -> int:
    """Bytes of the tensors in a tree (to estimate what a save needs)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tree_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(tree_bytes(v) for v in tree)
    return 0
