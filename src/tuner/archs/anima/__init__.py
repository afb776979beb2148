"""The anima family: Anima (CircleStone Labs), Cosmos-Predict2-2B's DiT with a Qwen3-0.6B text encoder and
an LLM adapter; its record, trainer, loaders, key layout, fixture and variant configs."""
