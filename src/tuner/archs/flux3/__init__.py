"""FLUX.3 (klein base): text-to-image on diffusers' Flux3Transformer2DModel, Qwen3-VL-4B and the FLUX.2 VAE."""
