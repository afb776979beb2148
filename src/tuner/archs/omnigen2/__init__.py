"""The omnigen2 family: OmniGen2 text-to-image (its own transformer on Qwen2.5-VL-3B's hidden states, the
FLUX.1 VAE): record, trainer, loaders, key layout, model, fixture and variant configs."""
