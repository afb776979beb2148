"""tuner: train LoRA-family adapters and full fine-tunes of diffusion image and video models."""

__version__ = "0.1.0"
