"""The trainers: one `NetworkTrainer` subclass per architecture family (`base.py` holds the loop).

Which class trains an architecture is part of its record (`tuner.registry`); `trainer_class(name)`
imports it.
"""

from tuner.registry import trainer_class

__all__ = ["trainer_class"]
