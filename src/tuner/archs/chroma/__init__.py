"""The chroma family: its record(s), trainer(s), loaders, key layout, fixture and variant configs."""
