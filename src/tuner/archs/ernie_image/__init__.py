"""ERNIE-Image (base and Turbo): text-to-image on a single-stream DiT conditioned on Ministral 3 3B."""
