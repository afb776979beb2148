"""DeepSpeed ZeRO: the optimizer state, the gradients and (stage 3) the weights split across processes.

With DDP every process holds everything: the weights, their gradients, the fp32 master copy and the
optimizer's moments. ZeRO ("zero redundancy") gives each of N processes 1/N of them instead:

    stage 2   the optimizer state and the gradients of what trains are partitioned; the weights are
              whole on every process. For a LoRA, whose optimizer state is small next to the frozen base,
              this saves little; for a full fine-tune it is most of the memory (AdamW: 16 bytes per
              trained parameter, of which the weights are 2-4).
    stage 3   the weights are partitioned too, the frozen base included: a layer's weights are gathered
              just before it runs and freed after. A model that fits no single card trains on several.
    offload   (either stage) the optimizer state and its fp32 master weights live in host memory and the
              optimizer steps there; the GPU keeps only weights, gradients and activations.

DeepSpeed's engine must own one module and see each forward. The architecture code calls
`trainer.predict(model, ...)`, which reads attributes of the diffusers model, and the adapters run from
inside the frozen model's layers, so the engine owns a `PredictModule` (the model and the adapter together,
whose forward is `predict`), and `ArchitectureModel.loss` calls that instead of `predict` directly.

The engine is made through accelerate's DeepSpeed plugin (`accelerator_kwargs`): tuner writes the DeepSpeed
config from [train] and the `deepspeed_*` keys, merged over a user's own JSON (`deepspeed_config`), and
keeps its own optimizer (DeepSpeed runs it on its partitions) and its own lr schedule. The engine steps:
it averages the gradients, clips them (`gradient_clipping` = train.max_grad_norm), skips a step whose
gradient is not finite, updates the partitions and gathers the weights again.

Saves are the files a one-process run writes. The adapter (or model) file is written from the whole
weights (stage 3 gathers them for the save); the optimizer state is consolidated from every process's
partition into the state dict a one-process optimizer has (`deepspeed_state.py`), so a state saved under
either stage resumes under either stage, with or without offload, or under DDP, and the other way round
(on the same number of processes: a saved position counts each process's own batches).

On a machine without CUDA, accelerate only drives DeepSpeed when it is not told to use the CPU
(ACCELERATE_USE_CPU / --cpu turn its plugin off) and when the process group is gloo's; DeepSpeed then
picks its CPU accelerator by itself. That is how the tests run two processes under torchrun.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tuner.distributed import PredictModule, Strategy, launched_processes
from tuner.distributed.deepspeed_state import EngineOptimizer, master_partitions, whole_on_host
from tuner.errors import ConfigError

# Optimizers whose state is one tensor per parameter element (plus scalars such as the step): on ZeRO's
# flat partitions they compute what they compute on whole tensors, and their state consolidates into a
# one-process state dict. Value: state tensors per trained element (for the memory plan). Optimizers with
# per-tensor statistics (Adafactor, CAME, Prodigy's global d) or block-quantized states (bitsandbytes'
# 8-bit ones) would see a partition as a tensor of its own: not what one process computes.
ELEMENTWISE_OPTIMIZERS = {
    torch.optim.AdamW: 2,
    torch.optim.Adam: 2,
    torch.optim.RAdam: 2,
    torch.optim.NAdam: 2,
    torch.optim.Adamax: 2,
    torch.optim.RMSprop: 1,
    torch.optim.SGD: 1,
}

_STAGES = (2, 3)


def deepspeed_config(cfg, world: int) -> dict[str, Any]:
    """The DeepSpeed config of this run: tuner's keys over the user's JSON (`distributed.deepspeed_config`).
    A key of the file that contradicts ours is refused naming both."""
    dc, tc = cfg.distributed, cfg.train
    user = _user_config(dc.deepspeed_config)
    where = f"distributed.deepspeed_config ({dc.deepspeed_config})"
    for key in ("optimizer", "scheduler"):
        if key in user:
            raise ConfigError(
                f"{where} sets '{key}'; tuner builds the {key} from [train] (train.optimizer, "
                "train.lr_scheduler) and hands it to DeepSpeed. Remove it from the file."
            )
    for key in ("fp16", "bf16"):
        if _get(user, f"{key}.enabled") not in (None, False, "auto"):
            raise ConfigError(
                f"{where} enables '{key}'; with tuner, DeepSpeed keeps the weights in the dtypes tuner loads "
                "them in and train.mixed_precision autocasts the forward. Set train.mixed_precision instead "
                f"and remove '{key}' from the file."
            )
    zero = user.get("zero_optimization", {})
    stage = dc.deepspeed_stage or zero.get("stage", 2)
    if stage not in _STAGES:
        raise ConfigError(
            f"{where} sets zero_optimization.stage = {stage!r}; tuner runs ZeRO stages 2 and 3 (stage 0 and "
            "1 are what strategy = 'ddp' does). Set distributed.deepspeed_stage or fix the file."
        )
    offload = dc.deepspeed_offload_optimizer
    if offload is None:
        offload = _get(user, "zero_optimization.offload_optimizer.device") not in (None, "none")
    # DeepSpeed's batch sizes are bookkeeping (tuner's data plan makes the batches): the largest dataset's
    batch = max((spec.batch_size for spec in cfg.datasets if not spec.validation), default=1)
    ours = {
        "train_micro_batch_size_per_gpu": (batch, "the datasets' largest batch_size"),
        "gradient_accumulation_steps": (tc.gradient_accumulation_steps, "train.gradient_accumulation_steps"),
        "train_batch_size": (
            batch * tc.gradient_accumulation_steps * world,
            f"batch_size {batch} × train.gradient_accumulation_steps × {world} processes",
        ),
        "gradient_clipping": (float(tc.max_grad_norm), "train.max_grad_norm"),
        "zero_optimization.stage": (stage, "distributed.deepspeed_stage"),
        "zero_optimization.offload_optimizer.device": (
            "cpu" if offload else "none",
            "distributed.deepspeed_offload_optimizer",
        ),
    }
    for key, (value, our_key) in ours.items():
        theirs = _get(user, key)
        if theirs is not None and theirs != "auto" and theirs != value:
            raise ConfigError(
                f"{where} sets {key} = {theirs!r}, but {our_key} makes it {value!r}; change one of them "
                "(or remove the key from the file)."
            )
    merged = json.loads(json.dumps(user))  # a deep copy
    for key, (value, _) in ours.items():
        _set(merged, key, value)
    # our optimizer (not DeepSpeed's CPU Adam) steps on the offloaded partitions; tuner's loop prints
    # progress, so DeepSpeed's own step log stays off
    merged.setdefault("zero_allow_untested_optimizer", True)
    merged["zero_force_ds_cpu_optimizer"] = False
    merged.setdefault("steps_per_print", 2**31 - 1)
    merged.setdefault("wall_clock_breakdown", False)
    return merged


def _user_config(path: str) -> dict[str, Any]:
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"key 'distributed.deepspeed_config': no file {path}; give the path of a DeepSpeed JSON or remove "
            "the key (tuner writes the config from [train] and the deepspeed_* keys)."
        ) from None
    except OSError as e:
        raise ConfigError(f"key 'distributed.deepspeed_config': cannot read {path} ({e.strerror}).") from None
    try:
        user = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"key 'distributed.deepspeed_config': {path} is not valid JSON ({e.msg} at line {e.lineno}, "
            f"column {e.colno})."
        ) from None
    if not isinstance(user, dict):
        raise ConfigError(f"key 'distributed.deepspeed_config': {path} holds a JSON {type(user).__name__}, "
                          "not an object of DeepSpeed settings.")  # fmt: skip
    return user


def _get(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.engine = None
        self.optimizer: EngineOptimizer | None = None

    def accelerator_kwargs(self) -> dict[str, Any]:
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

        _require_deepspeed()
        kwargs: dict[str, Any] = {
            "deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=deepspeed_config(self.cfg, launched_processes()))
        }
        if not torch.cuda.is_available():  # accelerate would leave the process group to a backend it lacks
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
        return kwargs

    def check(self, trainer, world_size: int) -> None:
        _require_deepspeed()
        cfg = self.cfg
        config = deepspeed_config(cfg, world_size)
        stage = config["zero_optimization"]["stage"]
        tc, mem, sc = cfg.train, cfg.memory, cfg.sample
        both = "distributed.strategy = 'deepspeed'"
        from tuner.optimizers.build import resolve_optimizer

        if resolve_optimizer(tc.optimizer) not in ELEMENTWISE_OPTIMIZERS:
            names = ", ".join(sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS))
            raise ConfigError(
                f"train.optimizer = {tc.optimizer!r} with {both}: ZeRO steps the optimizer on flat partitions "
                "of the weights, where only an optimizer whose state is per element computes what it does on "
                f"whole tensors (and its state saves as one process's). Use one of: adamw, {names}."
            )
        refusals = [
            (mem.blocks_to_swap != 0, "memory.blocks_to_swap", "DeepSpeed places the weights itself"),
            (mem.fp8_base, "memory.fp8_base", "DeepSpeed partitions and gathers the weights in their own dtype"),
            (mem.activation_offload, "memory.activation_offload", "not tested with DeepSpeed's engine"),
            (tc.compile, "train.compile", "the engine's hooks are not compiled with the model"),
            (tc.max_nonfinite_steps > 0, "train.max_nonfinite_steps",
             "DeepSpeed skips a step with a non-finite gradient itself, and its engine cannot drop a step's "
             "gradients from outside; the run stops at the first non-finite loss"),
            (tc.mixed_precision == "fp16", "train.mixed_precision = 'fp16'",
             "fp16 needs DeepSpeed's loss scaler, which tuner does not drive; use bf16"),
            (cfg.network.type == "full" and cfg.network.stochastic_rounding, "network.stochastic_rounding",
             "DeepSpeed keeps fp32 master weights of what trains"),
            (trainer.record.boundary is not None, f"model.architecture = '{trainer.architecture}'",
             "two-expert models switch transformers per step; one engine owns one"),
            (stage == 3 and bool(tc.ema_decay), "train.ema_decay",
             "ZeRO-3 partitions the trained weights the EMA averages"),
            (stage == 3 and bool(sc.prompts) and bool(sc.every_n_steps or sc.at_start),
             "sample.every_n_steps / sample.at_start", "samples are drawn by the main process alone, and "
             "ZeRO-3's weights are partitioned across all; generate from the saved adapter with `tuner generate`"),
        ]  # fmt: skip
        for refused, key, why in refusals:
            if refused:
                raise ConfigError(f"{key} with {both} (ZeRO-{stage}): {why}. Change one of them.")

    def prepare(self, trainer, accelerator, model, trained, optimizer):
        from accelerate.utils import DistributedType

        if accelerator.distributed_type != DistributedType.DEEPSPEED:
            raise ConfigError(
                "distributed.strategy = 'deepspeed', but accelerate did not start DeepSpeed (its DeepSpeed plugin "
                "is off when it is told to use the CPU: unset ACCELERATE_USE_CPU and drop --cpu; launch with "
                "`accelerate launch` or `torchrun`)."
            )
        tc = self.cfg.train
        autocast = None
        if tc.mixed_precision == "bf16":  # accelerate leaves precision to DeepSpeed: autocast ourselves
            device = accelerator.device.type
            autocast = lambda: torch.autocast(device, dtype=torch.bfloat16)  # noqa: E731
        module = PredictModule(trainer, model, trained, autocast)
        # the optimizer's numbering of the parameters, before DeepSpeed swaps them for its partitions
        order = [p for group in optimizer.param_groups for p in group["params"]]
        sizes = [len(group["params"]) for group in optimizer.param_groups]
        engine, _ = accelerator.prepare(module, optimizer)
        self.engine = engine
        self.optimizer = EngineOptimizer(engine, order, sizes)
        self.stage = engine.zero_optimization_stage()
        return engine, trained, self.optimizer

    @contextlib.contextmanager
    def accumulating(self, run, last: bool) -> Iterator[None]:
        self.engine.set_gradient_accumulation_boundary(last)
        yield

    def backward(self, run, loss) -> None:
        # the loop has divided the loss by its accumulation group's size (short last groups included)
        self.engine.backward(loss, scale_wrt_gas=False)

    def grad_norm(self, run, max_norm: float) -> float | None:
        # the gradient lives in DeepSpeed's partitions until the engine's step, which clips it
        # (gradient_clipping) and skips the step itself when it is not finite
        return None

    @contextlib.contextmanager
    def whole_state(self, trained) -> Iterator[None]:
        """Every process takes part: stage 3 makes the trained weights whole in host memory (`whole_on_host`),
        and the optimizer consolidates its state."""
        params = [p for p in trained.parameters() if p.requires_grad]
        whole = whole_on_host(params) if self.stage == 3 else contextlib.nullcontext()
        with whole:
            self.optimizer.consolidate()
            try:
                yield
            finally:
                self.optimizer.consolidated = None

    def plan(self, trainer, accelerator, model, trained, optimizer) -> str:
        usage = self.memory()
        offload = " (optimizer offloaded to host)" if usage["offload"] else ""
        mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        return (
            f"strategy: deepspeed ZeRO-{self.stage}{offload} over {accelerator.num_processes} processes; per "
            f"process: parameters {mib(usage['parameters'])}, gradients {mib(usage['gradients'])}, optimizer "
            f"state {mib(usage['optimizer'])} (fp32 master {mib(usage['master'])} + moments "
            f"{mib(usage['moments'])})"
        )

    def memory(self) -> dict[str, int]:
        """This process's bytes, from DeepSpeed's partitions: the weights it holds (stage 3: its partition
        of each; persistent small ones whole), the gradient partition of what trains, and the optimizer's
        fp32 master partition plus its moments (measured once they exist, else the optimizer's count of
        state tensors per element times the partition)."""
        zero = self.engine.optimizer
        parameters = 0
        for p in self.engine.module.parameters():
            held = p.ds_tensor if hasattr(p, "ds_tensor") else p  # stage 3: the partition this process keeps
            parameters += held.numel() * held.element_size()
        masters = master_partitions(zero)
        master = sum(t.numel() * t.element_size() for t in masters)
        inner = self.optimizer.inner
        moments = sum(v.numel() * v.element_size() for state in inner.state.values() for v in state.values()
                      if torch.is_tensor(v) and v.dim() > 0)  # fmt: skip
        if not moments:
            moments = master * ELEMENTWISE_OPTIMIZERS.get(type(inner), 2)
        # the gradient partition: as many elements as the master partition, in the trained weights' dtype
        gradients = sum(t.numel() for t in masters) * self.optimizer.order[0].element_size()
        return {"parameters": parameters, "gradients": gradients, "master": master, "moments": moments,
                "optimizer": master + moments, "offload": int(bool(getattr(zero, "cpu_offload", False) or
                                                                  getattr(zero, "offload_optimizer", False)))}  # fmt: skip


def _require_deepspeed() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"distributed.strategy = 'deepspeed' needs the package 'deepspeed' ({e}); install it with "
            "`pip install tuner[deepspeed]`, or pick strategy = 'ddp' or 'fsdp'."
        ) from None
