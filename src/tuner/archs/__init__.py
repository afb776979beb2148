"""One folder per architecture family: its record(s), trainer(s), loaders, key layout, fixture and
variant configs. `tuner.registry` lists the families; `record.py` here defines what a record holds."""
