"""A training state on disk without pickle: safetensors for tensors, JSON for the rest, and a manifest.

A resumable state is the adapter's (or model's) state dict, the optimizer's and the scheduler's, the
random number generators of every process, and tuner's position. `torch.save` / accelerate's
`save_state` write these as pickles, and unpickling runs whatever code the file names: a state folder
someone else could write to would be a way to run code on the next `--resume`. Here nothing is
unpickled, ever:

- `save_tree` / `load_tree` store any nest of dicts, lists, tuples, numbers, strings and tensors as
  `<stem>.json` (the structure, tensors replaced by references) plus `<stem>.safetensors` (the tensors).
  Dict keys keep their type (optimizer state is keyed by int), tuples stay tuples (Adam's `betas`).
  A value of any other type is refused when saving, never pickled.
- `rng_state` / `set_rng_state` turn Python's, NumPy's and torch's generator states into such a tree.
- `write_manifest` runs last and records each file's size and SHA-256; `verify` checks a folder against
  it before anything in it is read, and refuses, by name, a missing, truncated, changed or extra file.
  A folder without a manifest is incomplete (a save that was killed) or from an older tuner.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from tuner.errors import CheckpointError
from tuner.io import save_safetensors, write_text

MANIFEST = "manifest.json"
FORMAT = 1  # bumped when the layout of a state folder changes
PICKLE_SUFFIXES = (".pkl", ".pickle", ".bin", ".pt", ".pth", ".ckpt")

# ---- trees of plain values and tensors ---------------------------------------------------------


def save_tree(tree: Any, folder: Path, stem: str) -> list[str]:
    """Write `tree` as `<stem>.json` + `<stem>.safetensors` in `folder`; return the file names."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}

    def encode(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            key = f"t{len(tensors)}"
            # safetensors refuses tensors sharing memory: store a copy of a view already stored
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
            tensors[key] = t.clone() if ident in seen or t.numel() == 0 else t
            seen[ident] = key
            return {"tensor": key}
        if isinstance(value, bool) or value is None or isinstance(value, int | float | str):
            return value
        if isinstance(value, dict):
            return {"dict": [[encode(k, where), encode(v, f"{where}.{k}")] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"tuple": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return {"list": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        raise CheckpointError(
            f"cannot save the training state: {where} is a {type(value).__name__}, and tuner saves only "
            "numbers, strings, lists, dicts and tensors (never pickles). Use another optimizer or scheduler."
        )

    structure = encode(tree, stem)
    save_safetensors(tensors, folder / f"{stem}.safetensors")
    write_text(folder / f"{stem}.json", json.dumps({"format": FORMAT, "tree": structure}))
    return [f"{stem}.json", f"{stem}.safetensors"]


def load_tree(folder: Path, stem: str) -> Any:
    """Read what `save_tree` wrote (tensors on the CPU)."""
    json_path, tensor_path = folder / f"{stem}.json", folder / f"{stem}.safetensors"
    try:
        structure = json.loads(json_path.read_text(encoding="utf-8"))["tree"]
        with safe_open(str(tensor_path), framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # json, safetensors and the OS raise many types; all mean the same here
        raise CheckpointError(f"{folder}: cannot read {stem} ({type(e).__name__}: {e})") from None

    def decode(value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        (kind, body), *_ = value.items()
        if kind == "tensor":
            return tensors[body]
        if kind == "dict":
            return {decode(k): decode(v) for k, v in body}
        items = [decode(v) for v in body]
        return tuple(items) if kind == "tuple" else items

    try:
        return decode(structure)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{json_path}: malformed ({type(e).__name__}: {e})") from None


# ---- random number generators ------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's global generator states (Python, NumPy, torch CPU and CUDA) as a tree."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
        },  # fmt: skip
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- the manifest --------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, names: Iterable[str]) -> None:
    """Record the size and hash of each file; written last, it marks the folder complete."""
    files = {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256(folder / name)}
             for name in sorted(names)}  # fmt: skip
    write_text(folder / MANIFEST, json.dumps({"format": FORMAT, "files": files}, indent=1))


def verify(folder: Path) -> None:
    """Refuse a state folder whose files are not exactly those its manifest lists, byte for byte.
    Pickles are refused by name before anything else: tuner never loads them."""
    present = {p.name for p in folder.iterdir() if p.is_file()}
    pickles = sorted(n for n in present if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise CheckpointError(
            f"{folder / pickles[0]}: a pickle file in a training state. tuner never loads pickles (loading "
            "one can run any code it contains) and did not write this one; "
            + (
                "this state was saved by an older tuner, which used pickles. "
                if not (folder / MANIFEST).is_file()
                else "someone or something else put it there. "
            )
            + "Resume from another state, or start from the adapter file with network.network_weights."
        )
    if not (folder / MANIFEST).is_file():
        raise CheckpointError(
            f"{folder}: incomplete training state (no {MANIFEST}; the save was interrupted)."
        )
    try:
        listed = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    except Exception as e:
        raise CheckpointError(f"{folder / MANIFEST}: damaged ({type(e).__name__}: {e})") from None
    for name, entry in listed.items():
        path = folder / name
        if name not in present:
            raise CheckpointError(f"{path}: missing from the training state (its manifest lists it)")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{path}: {size} bytes, but {entry['bytes']} were saved (truncated or changed)"
            )
        if sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{path}: its contents changed since it was saved (hash differs)")
    extra = sorted(present - set(listed) - {MANIFEST})
    if extra:
        raise CheckpointError(f"{folder / extra[0]}: a file the training state did not save; remove it")


def is_complete(folder: Path) -> bool:
    """Cheap test used to list states: the manifest, written last, is there."""
    return (folder / MANIFEST).is_file()
