"""Saving and resuming under DeepSpeed ZeRO as one process does: the optimizer state consolidated from
every process's partition (`EngineOptimizer`) and ZeRO-3's partitioned weights made whole, one at a time,
in host memory while a save or a resume runs (`whole_on_host`).

ZeRO steps our optimizer on flat fp32 "master" partitions: each process keeps its 1/N of every parameter
group flattened into one tensor, and the optimizer's state (AdamW's two moments) is keyed by those. DeepSpeed's
tensor-fragment API (`deepspeed.utils.safe_get_full_optimizer_state` and the setters) maps a parameter to its
fragment in each process's partition; gathering them gives back the per-parameter tensors a one-process
optimizer holds, numbered as the optimizer numbered its parameters before DeepSpeed swapped them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from tuner.errors import TrainingError


class EngineOptimizer:
    """What the loop steps and what checkpoints save in place of the optimizer.

    `step` is the engine's step (clip, update the partitions, gather the weights, zero the gradients).
    `state_dict` is the state a one-process optimizer over the same parameters has, assembled from every
    process's partition (`consolidate`, collective, run by `DeepSpeedStrategy.whole_state` in every
    process), and `load_state_dict` takes such a state (saved under either stage, or by DDP's plain
    optimizer) and keeps this process's part of it, with the fp32 master weights taken from the
    weights just loaded."""

    def __init__(self, engine, order: list[torch.nn.Parameter], group_sizes: list[int]):
        self.engine = engine
        self.inner = engine.optimizer.optimizer  # ours, now stepping on DeepSpeed's flat fp32 partitions
        self.order = order  # the trained parameters in the optimizer's original numbering
        self.group_sizes = group_sizes  # parameters per original group
        self.consolidated: dict | None = None

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups  # the group dicts the lr schedule writes into

    def step(self) -> None:
        self.engine.step()
        if getattr(self.engine.optimizer, "overflow", False):
            raise TrainingError(
                "DeepSpeed skipped an update: the gradient was not finite (the loss was). Lower "
                "train.learning_rate or network.alpha, or check the cached latents."
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the engine's step zeroed them

    def consolidate(self) -> None:
        """Assemble the one-process state dict from the partitions (every process must call it)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        keys, scalars = self._state_keys()
        state = {}
        if keys:
            for i, p in enumerate(self.order):
                full = {key: safe_get_full_optimizer_state(p, key).detach().cpu().reshape(_shape(p)).clone()
                        for key in keys}  # fmt: skip
                state[i] = {**{k: _copy(v) for k, v in scalars.items()}, **full}
        groups, start = [], 0
        for group, n in zip(self.inner.param_groups, self.group_sizes):
            settings = {k: v for k, v in group.items() if k != "params"}
            groups.append({**settings, "params": list(range(start, start + n))})
            start += n
        self.consolidated = {"state": state, "param_groups": groups}

    def state_dict(self) -> dict:
        if self.consolidated is not None:
            return self.consolidated
        return self.inner.state_dict()  # outside a save (the disk-space estimate): this process's partitions

    def load_state_dict(self, saved: dict) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        for group, saved_group in zip(self.inner.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        for p in self.order:  # the master weights: the weights just loaded (gathered whole under stage 3)
            safe_set_full_fp32_param(p, p.detach().float())
        states = {int(k): v for k, v in saved["state"].items()}
        if not states:
            return
        first = next(iter(states.values()))
        keys = [k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0]
        self._create_state(keys, {k: v for k, v in first.items() if k not in keys})
        for i, p in enumerate(self.order):
            if i in states:
                for key in keys:
                    safe_set_full_optimizer_state(p, states[i][key].float().flatten(), key)

    def _state_keys(self) -> tuple[list[str], dict[str, Any]]:
        """The per-element state tensors' names and the other entries (the step) of the partitions' state;
        none before the first step."""
        for flat, state in self.inner.state.items():
            keys = [k for k, v in state.items() if torch.is_tensor(v) and v.shape == flat.shape]
            return keys, {k: v for k, v in state.items() if k not in keys}
        return [], {}

    def _create_state(self, keys: list[str], scalars: dict[str, Any]) -> None:
        """Give each flat partition a zero state with these keys (before the first step there is none), and
        link DeepSpeed's per-parameter views of it (stage 2 links them after its first step otherwise)."""
        zero = self.engine.optimizer
        for flat in master_partitions(zero):
            state = self.inner.state[flat]
            for key in keys:
                state.setdefault(key, torch.zeros_like(flat))
            state.update({k: _copy(v) for k, v in scalars.items()})
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # stage 2's link (private in DeepSpeed)
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()


@contextlib.contextmanager
def whole_on_host(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """ZeRO-3: each partitioned weight is gathered in turn and held whole in host memory while the context
    is open (a save reads it, a resume loads into it), so a device never holds more than one whole weight
    at a time; on closing, process 0's copies are partitioned back (what a resume loaded is kept)."""
    import deepspeed

    partitions = []
    for p in params:
        with deepspeed.zero.GatheredParameters([p]):
            whole = p.data.detach().to("cpu", copy=True)
        partitions.append(p.data)
        p.data = whole
    try:
        yield
    finally:
        for p, partition in zip(params, partitions):
            whole, p.data = p.data, partition
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                p.data.copy_(whole)


def master_partitions(zero) -> list[torch.Tensor]:
    """This process's flat fp32 master partitions, one per parameter group (stage 3: per sub-group); the
    optimizer's state is keyed by them."""
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        return list(zero.fp32_partitioned_groups_flat)
    return list(zero.single_partition_of_fp32_groups)


def _copy(value: Any) -> Any:
    return value.detach().clone().cpu() if torch.is_tensor(value) else value


def _shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
