"""AuraFlow (fal's v0.1-v0.3): text-to-image on an MMDiT (joint blocks, then single-stream blocks) conditioned on Pile-T5-XL."""
