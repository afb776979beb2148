"""The training loop (`base.py`: `NetworkTrainer`, set up by `setup.py`) and what it saves and reports.

An architecture's trainer is the loop over its family's `ArchitectureModel` (`tuner.archs.model`);
`trainer_class(name)` builds it from the record.
"""

from tuner.registry import trainer_class

__all__ = ["trainer_class"]
