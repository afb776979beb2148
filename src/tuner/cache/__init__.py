"""The cache store and the encode-once logic: latents and text-encoder outputs are encoded once,
addressed by a digest of everything they depend on (`keys`), and stored in shards indexed by SQLite
(`store`, `writer`, `index`)."""

from tuner.cache.keys import EncoderIdentity, entry_key, fingerprint_weights, hash_file
from tuner.cache.store import CacheStore, format_info
from tuner.cache.writer import ShardWriter

__all__ = [
    "CacheStore",
    "EncoderIdentity",
    "ShardWriter",
    "entry_key",
    "fingerprint_weights",
    "format_info",
    "hash_file",
]
