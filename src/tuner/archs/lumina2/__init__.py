"""The lumina2 family: its record(s), trainer(s), loaders, key layout, fixture and variant configs."""
