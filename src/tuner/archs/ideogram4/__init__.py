"""Ideogram 4: text-to-image on a single-stream DiT conditioned on a 13-layer stack of Qwen3-VL-8B states."""
