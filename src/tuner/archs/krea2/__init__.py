"""Krea 2 (RAW and Turbo): text-to-image on a single-stream DiT conditioned on a stack of Qwen3-VL-4B layers."""
