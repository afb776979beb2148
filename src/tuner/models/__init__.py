"""Model loading: one module per architecture family on top of the shared `loading` and `identify`."""
