"""FSDP2: every weight, gradient and optimizer moment held by exactly one process.

With DDP each of N processes holds the whole model, its gradients and the optimizer state. Fully
sharded data parallelism (PyTorch's FSDP2, `torch.distributed.fsdp.fully_shard`) splits each of those
tensors along its first dimension into N pieces; process r keeps piece r only, as a DTensor (a tensor
that knows its mesh and placement). Per process, the frozen base costs 1/N of its bytes, the trained
weights 1/N, and because the optimizer makes its state in the shape of what it steps, so do its moments.
The price is communication: before a block runs forward (and again in backward) its pieces are
all-gathered into the full weights, used and freed again; after its backward the gradients are
reduce-scattered, each process receiving the average of its own piece.

Units of sharding. One all-gather per transformer block: each block of the architecture's block lists
(`record.block_lists`, what block swap and checkpointing iterate over) is one FSDP group, and the
model itself the root group for the rest (embeddings, norms, the head). Adapters (LoRA, LoHa, LoKr)
are not submodules of the model: they are attached from outside to the Linear layers they adapt
(`tuner.networks.base`). Each adapter joins the group of the block its layer sits in
(`fully_shard([block, *its adapters])`), so a block's weights and its adapters arrive in one
collective; an adapter outside every block (a head or embedding target) joins the first block's group.
A full fine-tune has no adapters; the same groups then hold trained weights.

Why `fully_shard` and not accelerate's FSDP plugin: the plugin shards the one module tree
`accelerator.prepare` is given, wrapping blocks picked by class name; our adapters live outside that
tree and must share their block's group, and the groups follow our block lists, not class names. So
the mesh (`init_device_mesh`) and `fully_shard` are called here directly; accelerate still provides the
process group, devices, mixed precision and gradient clipping (`clip_grad_norm_` over DTensor gradients
gives the norm of the whole, unsharded gradient).

Saving and resuming keep a one-process run's files. `full_state_dict` turns each DTensor of a state
(network, optimizer moments) into its full tensor on the main process, one tensor at a time (what
`torch.distributed.checkpoint.state_dict`'s `full_state_dict` + `cpu_offload` options do; written
here because a one-process optimizer state is keyed by parameter index, DCP's by name, and the files
must be the same). `full_weights` gives the main process the full trained weights for the adapter or
model export. Resuming reads those same files and cuts each tensor back into this process's piece
(`load_full_state_dict`), so a state saved by any number of processes, one included, resumes here.

fp8 base weights (`memory.fp8_base`) are sharded like any other: a block's float8 weights and its
fp32 scales travel in one all-gather (FSDP2 gathers a group of mixed dtypes as bytes); the scales are
buffers and stay whole on every process. Gradient checkpointing recomputes a block's forward in
backward, all-gathering its weights again.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tuner.distributed import Strategy
from tuner.errors import ConfigError


class FSDPStrategy(Strategy):
    name = "fsdp"

    def check(self, trainer, world_size: int) -> None:
        """Refuse the settings FSDP2 does not combine with here, naming both keys."""
        cfg = self.cfg
        both = "distributed.strategy = 'fsdp'"
        refusals = [
            (cfg.memory.blocks_to_swap != 0, "memory.blocks_to_swap",
             "block swap moves whole blocks between host and device, FSDP keeps 1/N of each block on each "
             "device; use one or the other"),
            (cfg.memory.activation_offload, "memory.activation_offload",
             "its block wrappers park inputs outside FSDP's hooks; use train.gradient_checkpointing"),
            (bool(cfg.train.compile), "train.compile", "compiled blocks are not set up under FSDP here"),
            (bool(cfg.train.ema_decay), "train.ema_decay", "the average would be kept per shard"),
            (trainer.record.boundary is not None, "model.architecture",
             f"{trainer.architecture} trains two experts in one run"),
            (cfg.network.train_text_encoder, "network.train_text_encoder",
             "the text encoders' adapters sit outside the transformer's blocks"),
            (bool(cfg.sample.prompts) and bool(cfg.sample.every_n_steps or cfg.sample.at_start),
             "sample.every_n_steps / sample.at_start",
             "samples are drawn by the main process alone, and the sharded weights need every process; "
             "generate from the saved files instead"),
        ]  # fmt: skip
        for refused, key, why in refusals:
            if refused:
                raise ConfigError(f"key '{key}' cannot be combined with {both}: {why}.")
        from tuner.optimizers.build import resolve_optimizer

        cls = resolve_optimizer(cfg.train.optimizer)
        if not cls.__module__.startswith("torch.optim"):
            raise ConfigError(
                f"key 'train.optimizer' = {cfg.train.optimizer!r} cannot be combined with {both}: FSDP hands "
                "the optimizer DTensor pieces of each weight, and only torch.optim's optimizers are known to "
                "step them correctly; use AdamW (or another torch.optim optimizer) or strategy = 'ddp'."
            )

    def prepare(self, trainer, accelerator, model, trained, optimizer):
        """Shard the model per block (adapters in their block's group), then point the optimizer at the
        sharded parameters that replaced the ones it was built with."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
        # gradients are averaged in fp32 whatever the weights' dtype (a bf16 sum loses bits)
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        names = {id(p): name for name, p in trained.named_parameters()}
        # each block of the record's block lists heads one group; its adapters join it
        blocks = [(f"{name}.{i}.", block) for name in trainer.record.block_lists
                  for i, block in enumerate(model.get_submodule(name))]  # fmt: skip
        groups: list[list[nn.Module]] = [[block] for _, block in blocks]
        for adapter in [] if self.cfg.network.type == "full" else trained:
            # an adapter outside every block (a head or embedding target) joins the first block's group
            index = next((i for i, (prefix, _) in enumerate(blocks) if adapter.name.startswith(prefix)), 0)
            groups[index].append(adapter)
        _check_one_trained_dtype(self.cfg, model, trained)
        for group in groups:
            fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: what no block holds
        # FSDP warns that the root's output is a view (an in-place op on it would skip a hook); the loss
        # only reads the prediction
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        # module dropout may leave an adapter without a gradient on one process only: reduce zeros for it
        model.set_reduce_scatter_unused_params(True)
        sharded = dict(trained.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        self.world = accelerator.num_processes
        return model, trained, optimizer

    # ---- the full state, for the files a one-process run writes ----

    def full_state_dict(self, part) -> Any:
        """`part.state_dict()` with every DTensor replaced by its full tensor on the CPU of the main
        process (None elsewhere). Every process must call it: each tensor is one all-gather."""
        return _gathered(part.state_dict(), torch.distributed.get_rank() == 0)

    def load_full_state_dict(self, part, tree) -> None:
        """Load a one-process state into the sharded `part`: each full tensor is cut to this process's
        piece of the parameter it belongs to (no communication: every process reads the files)."""
        from torch.distributed.tensor import DTensor

        if isinstance(part, nn.Module):
            current = part.state_dict()
            tree = {k: _piece_like(v, current.get(k)) for k, v in tree.items()}
        elif hasattr(part, "param_groups") and isinstance(tree, dict) and "state" in tree:
            params = [p for group in part.param_groups for p in group["params"]]
            tree = {**tree, "state": {
                index: {k: _piece_like(v, params[index]) if isinstance(params[index], DTensor) and
                        isinstance(v, torch.Tensor) and v.shape == params[index].shape else v
                        for k, v in moments.items()}
                for index, moments in tree["state"].items()
            }}  # fmt: skip
        part.load_state_dict(tree)

    @contextlib.contextmanager
    def full_weights(self, network: nn.Module) -> Iterator[None]:
        """While open, the main process's `network` holds its full weights on the CPU (for the export);
        the other processes take part in the gathers and keep their pieces."""
        from torch.distributed.tensor import DTensor

        main = torch.distributed.get_rank() == 0
        swapped = []
        for module in network.modules():
            for name, param in list(module._parameters.items()):
                if isinstance(param, DTensor):
                    full = param.full_tensor()
                    if main:
                        module._parameters[name] = nn.Parameter(full.cpu(), requires_grad=param.requires_grad)
                        swapped.append((module, name, param))
        try:
            yield
        finally:
            for module, name, param in swapped:
                module._parameters[name] = param  # the sharded parameter FSDP and the optimizer hold

    # ---- what it costs ----

    def plan(self, trainer, accelerator, model, trained, optimizer) -> str:
        m = process_memory(model, trained, optimizer)
        mib = 2**20
        moments = (
            f"optimizer state {m['optimizer'] / mib:.2f} MiB"
            if m["optimizer"]
            else "optimizer state sharded like the trained weights (made at the first step)"
        )
        return (
            f"distributed: fsdp (FSDP2) over {self.world} processes, {len(block_groups(model)) - 1} blocks + the "
            "rest of the model sharded; "
            f"per process: frozen weights {m['frozen'] / mib:.2f} of {m['frozen_full'] / mib:.2f} MiB, "
            f"trained {m['trained'] / mib:.2f} of {m['trained_full'] / mib:.2f} MiB, gradients "
            f"{m['trained'] / mib:.2f} MiB, {moments}"
        )


def block_groups(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that head an FSDP group (the blocks and the root)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _check_one_trained_dtype(cfg, model: nn.Module, trained: nn.Module) -> None:
    """FSDP2 gathers and reduces the trained weights of a group as one flat tensor of one dtype. A full
    fine-tune in bf16 of a model that keeps some weights in fp32 inside its blocks (Wan's
    `scale_shift_table`, diffusers' `_keep_in_fp32_modules`) has two: refuse it, naming the fix."""
    trainable = {id(p) for p in trained.parameters() if p.requires_grad}
    dtypes: dict[torch.dtype, str] = {}  # dtype -> the first trained weight of it
    for name, p in model.named_parameters():
        if id(p) in trainable:
            dtypes.setdefault(p.dtype, name)
    if len(dtypes) > 1:
        found = ", ".join(f"{str(dtype).removeprefix('torch.')} ({name})" for dtype, name in dtypes.items())
        raise ConfigError(
            f"key 'model.dtype' = {cfg.model.dtype!r} cannot be combined with distributed.strategy = 'fsdp' and "
            f"network.type = 'full' for this model: it trains weights of several dtypes ({found}), and FSDP2 "
            "shards one dtype per block. Train with model.dtype = 'fp32' and train.mixed_precision = 'bf16' (the "
            "fp32 weights, sharded, cost 4 / N bytes per parameter per process), or use strategy = 'ddp'."
        )


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds of `t` (its piece of a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _full_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def process_memory(model: nn.Module, trained: nn.Module, optimizer) -> dict[str, int]:
    """What one process holds, in bytes, measured from the tensors themselves: the frozen weights, the
    trained ones, the gradients that exist now and the optimizer's state tensors, each as this process's
    pieces and (`*_full`) whole, which is what every process of a DDP run holds."""
    trainable = {id(p): p for p in trained.parameters() if p.requires_grad}
    frozen = [p for p in model.parameters() if id(p) not in trainable]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "frozen": sum(_local_bytes(p) for p in frozen),
        "frozen_full": sum(_full_bytes(p) for p in frozen),
        "trained": sum(_local_bytes(p) for p in trainable.values()),
        "trained_full": sum(_full_bytes(p) for p in trainable.values()),
        "gradients": sum(_local_bytes(p.grad) for p in trainable.values() if p.grad is not None),
        "gradients_full": sum(_full_bytes(p.grad) for p in trainable.values() if p.grad is not None),
        "optimizer": sum(_local_bytes(v) for v in state),
        "optimizer_full": sum(_full_bytes(v) for v in state),
    }


def _gathered(tree: Any, main: bool) -> Any:
    """`tree` with each DTensor replaced by its full tensor (on the CPU of the main process, None on the
    others), in the same order on every process."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        full = tree.full_tensor()
        return full.cpu() if main else None
    if isinstance(tree, dict):
        return {k: _gathered(v, main) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_gathered(v, main) for v in tree)
    return tree


def _piece_like(full: Any, current: Any) -> Any:
    """`full` cut to this process's piece of `current`'s layout when `current` is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(current, DTensor) or not isinstance(full, torch.Tensor):
        return full
    local = full.to(device=current.device, dtype=current.dtype)
    return distribute_tensor(local, current.device_mesh, current.placements, src_data_rank=None)
