"""Kandinsky 6 text-to-video with sound (`tuner.archs.kandinsky6.loaders`)."""
