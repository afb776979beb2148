"""The architecture registry: name → "module:Class" of its trainer.

A plain dict, so that reading a config (which checks the name) imports no model code.
"""

ARCHITECTURES: dict[str, str] = {
    "wan": "tuner.trainers.wan:WanTrainer",
    "qwen_image": "tuner.trainers.qwen_image:QwenImageTrainer",
    "qwen_image_edit": "tuner.trainers.qwen_image:QwenImageEditTrainer",
    "flux": "tuner.trainers.flux:FluxTrainer",
    "flux_kontext": "tuner.trainers.flux:FluxKontextTrainer",
}


def trainer_class(name: str):
    """Import and return the trainer class registered under `name`."""
    import importlib

    module, cls = ARCHITECTURES[name].split(":")
    return getattr(importlib.import_module(module), cls)
