"""Cache keys: content hashes, cheap weight fingerprints, and entry keys that change with every input."""

import dataclasses
import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from tuner.cache.keys import EncoderIdentity, entry_key, fingerprint_weights, hash_file
from tuner.errors import CheckpointError, DataError

ENCODER = EncoderIdentity(
    architecture="wan2.1-vae", weights_fingerprint="ab" * 32, dtype="bfloat16", format_version=1
)
PARAMS = {"bucket": [832, 480, 33], "frames": [0, 4, 8], "crop": [0, 0, 832, 480], "fps": 16.0}


def test_hash_file_is_blake2b_of_the_bytes(tmp_path):
    data = bytes(range(256)) * 9000  # spans several 1 MiB read blocks
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    assert hash_file(path) == hashlib.blake2b(data, digest_size=32).hexdigest()
    path.write_bytes(data[:-1] + b"\0")
    assert hash_file(path) != hashlib.blake2b(data, digest_size=32).hexdigest()


def test_hash_file_missing_names_the_file(tmp_path):
    with pytest.raises(DataError, match="nope.png"):
        hash_file(tmp_path / "nope.png")


def _flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_fingerprint_small_safetensors_sees_every_byte_and_the_header(tmp_path):
    path = tmp_path / "vae.safetensors"
    save_file({"w": torch.zeros(64, 64), "b": torch.zeros(64)}, path)
    first = fingerprint_weights(path)
    assert fingerprint_weights(path) == first
    _flip_byte(path, path.stat().st_size - 1)  # last data byte
    changed_data = fingerprint_weights(path)
    assert changed_data != first
    save_file({"w": torch.zeros(64, 64), "bias": torch.zeros(64)}, path)  # same bytes, new name
    assert fingerprint_weights(path) not in (first, changed_data)


def test_fingerprint_large_file_samples_chunks(tmp_path):
    path = tmp_path / "dit.safetensors"
    save_file({"w": torch.zeros(3 << 20)}, path)  # 12 MiB of data: sampled, not read whole
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    data_start, size = 8 + header_len, path.stat().st_size
    first = fingerprint_weights(path)
    _flip_byte(path, size - 1)  # inside the last sampled chunk
    assert fingerprint_weights(path) != first
    _flip_byte(path, size - 1)
    assert fingerprint_weights(path) == first
    # The documented limit: a byte between sampled chunks goes unnoticed.
    gap_start = data_start + (1 << 20)  # first chunk ends here, the second starts 1/7 further on
    _flip_byte(path, gap_start + (size - data_start) // 28)
    assert fingerprint_weights(path) == first


def test_fingerprint_non_safetensors_file(tmp_path):
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"\x80\x02" + b"x" * 1000)
    first = fingerprint_weights(path)
    path.write_bytes(b"\x80\x02" + b"x" * 1001)
    assert fingerprint_weights(path) != first


def _model_folder(root, scale=1.0):
    (root / "vae").mkdir(parents=True)
    (root / "vae" / "config.json").write_text(json.dumps({"scaling_factor": scale}))
    save_file({"w": torch.ones(8)}, root / "vae" / "diffusion_pytorch_model.safetensors")
    (root / "model_index.json").write_text("{}")
    return root


def test_fingerprint_folder_combines_files_and_ignores_bookkeeping(tmp_path):
    a = fingerprint_weights(_model_folder(tmp_path / "a"))
    assert fingerprint_weights(_model_folder(tmp_path / "b")) == a  # path-independent
    (tmp_path / "b" / "README.md").write_text("model card")
    (tmp_path / "b" / ".cache").mkdir()
    (tmp_path / "b" / ".cache" / "lock").write_text("x")
    assert fingerprint_weights(tmp_path / "b") == a
    assert fingerprint_weights(_model_folder(tmp_path / "c", scale=0.5)) != a  # a config value
    (tmp_path / "b" / "vae" / "extra.safetensors").write_bytes(
        (tmp_path / "a" / "model_index.json").read_bytes()
    )
    assert fingerprint_weights(tmp_path / "b") != a  # an added file


def test_fingerprint_errors_name_the_path(tmp_path):
    with pytest.raises(CheckpointError, match="missing"):
        fingerprint_weights(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty"):
        fingerprint_weights(tmp_path / "empty")


def test_entry_key_is_pinned():
    # A key must never change across processes, machines or releases without a schema bump:
    # a changed key silently re-encodes every user's cache.
    # The digest was checked against blake2b-256 of this canonical JSON written out by hand:
    # {"encoder":{"architecture":"wan2.1-vae","dtype":"bfloat16","format_version":1,
    #  "weights_fingerprint":"abab..."},"kind":"latent","params":{"bucket":[832,480,33],
    #  "crop":[0,0,832,480],"fps":16.0,"frames":[0,4,8]},"schema":1,"source":"cdcd..."}
    key = entry_key("latent", "cd" * 32, PARAMS, ENCODER)
    assert key == "d19babd144012087ea38d0664b7b44cd88809b333009f0e261b87a7ca64cec00"


def test_entry_key_ignores_dict_order_and_tuple_vs_list():
    reordered = {k: tuple(v) if isinstance(v, list) else v for k, v in reversed(PARAMS.items())}
    assert entry_key("latent", "cd" * 32, reordered, ENCODER) == entry_key(
        "latent", "cd" * 32, PARAMS, ENCODER
    )


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "text"},
        {"source_hash": "ce" * 32},
        {"params": {**PARAMS, "bucket": [480, 832, 33]}},
        {"params": {**PARAMS, "frames": [0, 4, 9]}},
        {"params": {**PARAMS, "crop": [1, 0, 833, 480]}},
        {"params": {**PARAMS, "fps": 16.5}},
        {"params": {**PARAMS, "caption": "a cat"}},
        {"encoder": dataclasses.replace(ENCODER, architecture="wan2.2-vae")},
        {"encoder": dataclasses.replace(ENCODER, weights_fingerprint="ac" * 32)},
        {"encoder": dataclasses.replace(ENCODER, dtype="float32")},
        {"encoder": dataclasses.replace(ENCODER, format_version=2)},
    ],
)
def test_entry_key_changes_with_every_input(change):
    base = {"kind": "latent", "source_hash": "cd" * 32, "params": PARAMS, "encoder": ENCODER}
    assert entry_key(**{**base, **change}) != entry_key(**base)


def test_entry_key_rejects_values_without_a_canonical_form():
    with pytest.raises(TypeError, match="JSON"):
        entry_key("latent", "cd", {"crop": torch.tensor([1, 2])}, ENCODER)
    with pytest.raises(ValueError):
        entry_key("latent", "cd", {"fps": float("nan")}, ENCODER)


def test_encoder_identity_is_frozen_and_labelled():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ENCODER.dtype = "float16"
    assert ENCODER.label() == "wan2.1-vae/bfloat16/v1/abababab"


@pytest.mark.parametrize("name, keyed", [("framepack_1f", True), ("framepack", False)])
def test_text_key_covers_what_the_text_encoding_reads_besides_its_encoders(name, keyed, tmp_path):
    """FramePack one-frame's text entries hold the reference image's SigLIP tokens: another image encoder
    must re-encode them (the record's `text_extra_encoders`); for FramePack it shapes latents only."""
    from types import SimpleNamespace

    from tuner.cache.plan import text_encoder
    from tuner.registry import architecture

    def identity(image_encoder: torch.Tensor):
        save_file({"w": image_encoder}, tmp_path / "siglip.safetensors")
        save_file({"w": torch.ones(2)}, tmp_path / "text.safetensors")
        paths = {
            "text_encoder": tmp_path / "text.safetensors",
            "image_encoder": tmp_path / "siglip.safetensors",
        }
        model_fields = dict.fromkeys(
            ("text_encoder_2", "text_encoder_3", "text_encoder_4", "tokenizer", "tokenizer_2", "tokenizer_3",
             "tokenizer_4"),
            None,
        )  # fmt: skip
        model = SimpleNamespace(
            cfg=SimpleNamespace(model=SimpleNamespace(**model_fields), cache=SimpleNamespace(text_encoder_dtype="bf16")),
            record=architecture(name), architecture=name, trains_text_encoder=False,
            weights_path=lambda field: str(paths[field]),
        )  # fmt: skip
        return text_encoder(model).weights_fingerprint

    assert (identity(torch.zeros(2)) != identity(torch.ones(2))) is keyed
