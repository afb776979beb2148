"""The training loop (`base.py`: `NetworkTrainer`, set up by `setup.py`) and what it saves and reports.

An architecture's trainer is the loop over its family's `ArchitectureModel` (`tuner.archs.model`);
`trainer_class(name)` builds it from the record.
"""

import functools

from tuner.registry import architecture


@functools.cache
def trainer_class(name: str) -> type:
    """The class that trains architecture `name`: the loop (`NetworkTrainer`) over the family's
    `ArchitectureModel`, e.g. `WanTrainer(NetworkTrainer, WanModel)`. One class per architecture and
    process (cached), so patching it patches every trainer of that architecture."""
    from tuner.trainers.base import NetworkTrainer  # the loop (and accelerate) only when a trainer is built

    family = architecture(name).family_class()
    trainer = family.__name__.removesuffix("Model") + "Trainer"
    return type(trainer, (NetworkTrainer, family), {"__module__": family.__module__})
