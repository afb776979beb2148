"""Hub ids wherever a checkpoint path goes, and the default tokenizer of every text encoder.

A model path in a config may name a Hugging Face hub repository instead of a local file or folder:

    transformer = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"            # a pipeline: the components it names
    vae = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers:vae"                 # one folder of it
    text_encoder = "Comfy-Org/Wan_2.1_ComfyUI_repackaged/split_files/text_encoders/umt5_xxl_fp16.safetensors"

A value is a hub id only when no local path of that name exists. It is resolved through `huggingface_hub`
into its cache (`HF_HOME` / `HF_HUB_CACHE`), so a file is downloaded once and shared with every other tool
that uses the cache. A stream cut mid-file is resumed where it stopped (huggingface_hub retries with a byte
range); a download that fails for good leaves no partial file. A file fresh from the hub is checked against
the hub's checksum (the sha256 of large files, the git blob hash of small ones) and removed if it does not
match. With `HF_HUB_OFFLINE=1` ids resolve from the cache alone, or fail naming the command that fetches
them. Every failure is one `HubError` line: no such repository, a gated one without a token, a file the
repository lacks, a cut download, a checksum that does not match.

Text encoders shipped as single files (ComfyUI's `umt5_xxl_fp16.safetensors`, `clip_l.safetensors`, ...)
carry no tokenizer. Each architecture record names the official tokenizer folder of each of its text
encoders (`Architecture.tokenizers`); when a config gives no tokenizer and the encoder is a single file,
that folder is used (only its tokenizer files are downloaded).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from tuner.errors import TunerError

# owner/name, then either /path/to/file (a file) or :folder (a folder; empty = the whole repository)
_REF = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:/(?P<file>[\w.+-][\w./+-]*)|:(?P<sub>[\w./+-]*))?$"
)
_LOCAL_FILE = re.compile(r"\.(safetensors|sft|pt|pth|bin|ckpt|gguf|json|toml)$")
TOKENIZER_FILES = (
    "tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json", "spiece.model",
    "*.tiktoken", "chat_template*", "preprocessor_config.json", "processor_config.json",
)  # fmt: skip
"""What a tokenizer (or processor) folder holds: all that is fetched when a repository root is a tokenizer."""


class HubError(TunerError):
    """A hub id cannot be resolved: unknown, gated, offline and not cached, cut, or corrupt."""


@dataclass(frozen=True)
class HubRef:
    """A file or folder of a hub repository."""

    repo: str
    filename: str = ""
    """A file in the repository (`repo/file`), or "" for a folder."""
    subfolder: str = ""
    """A folder of the repository (`repo:folder`); "" with no filename is the whole repository."""

    def __str__(self) -> str:
        return (
            f"{self.repo}/{self.filename}" if self.filename else f"{self.repo}:{self.subfolder}".rstrip(":")
        )

    def fetch_command(self) -> str:
        """The command that puts this into the hub cache."""
        if self.filename:
            return f"hf download {self.repo} {self.filename}"
        return f"hf download {self.repo}" + (f" --include '{self.subfolder}/*'" if self.subfolder else "")


def parse_ref(value: str) -> HubRef | None:
    """The hub reference `value` spells, or None when it can only be a local path."""
    if not value or value.startswith((".", "/", "~")) or "\\" in value or "//" in value:
        return None
    m = _REF.match(value)
    if m is None or (not m["file"] and m["sub"] is None and _LOCAL_FILE.search(value)):
        return None  # `models/wan.safetensors` is a missing local file, not a repository named so
    return HubRef(m["repo"], m["file"] or "", (m["sub"] or "").strip("/"))


def resolve(ref: HubRef, patterns: tuple[str, ...] = ()) -> Path:
    """The local path of `ref` in the hub cache, downloading what is missing. `patterns` (fnmatch, over
    names inside the folder) limit what a folder fetches."""
    if ref.filename:
        return _file(ref, ref.filename)
    from huggingface_hub import HfApi, constants
    from huggingface_hub.hf_api import RepoFile

    if constants.HF_HUB_OFFLINE:
        return _cached_folder(ref)
    with one_line_errors(ref):
        entries = HfApi(endpoint=constants.ENDPOINT).list_repo_tree(
            ref.repo, path_in_repo=ref.subfolder or None, recursive=True
        )
        names = [e.path for e in entries if isinstance(e, RepoFile)]
    prefix = f"{ref.subfolder}/" if ref.subfolder else ""
    wanted = [n for n in names if not patterns or any(fnmatch(n[len(prefix) :], p) for p in patterns)]
    if not ref.subfolder and not patterns and "model_index.json" in names:  # a diffusers pipeline
        index = json.loads(_file(ref, "model_index.json").read_text())
        wanted = ["model_index.json", *pipeline_files(names, index)]
    if not wanted:
        raise HubError(f"{ref}: holds no files{' matching ' + ', '.join(patterns) if patterns else ''}.")
    root = None
    for name in wanted:
        path = _file(ref, name)
        root = Path(str(path)[: -len(name)])  # the snapshot folder every file of the commit lies in
    return root / ref.subfolder if ref.subfolder else root


# other formats of the same weights, fetched only where a folder has no safetensors
_OTHER_FORMATS = (".bin", ".msgpack", ".onnx", ".pb", ".h5", ".ckpt", ".pt", ".pth", ".gguf")


def pipeline_files(names: list[str], model_index: dict) -> list[str]:
    """Of a diffusers pipeline repository's files `names`, those of the components its `model_index`
    names, weights in safetensors where a folder has them: not the release's single files at the root
    (FLUX.1-dev's 24 GB `flux1-dev.safetensors`) nor other formats of the same weights."""
    components = {k for k in model_index if not k.startswith("_")}
    files = [n for n in names if "/" in n and n.split("/")[0] in components]
    has_safetensors = {n.rsplit("/", 1)[0] for n in files if n.endswith(".safetensors")}
    return sorted(
        n for n in files if not (n.endswith(_OTHER_FORMATS) and n.rsplit("/", 1)[0] in has_safetensors)
    )


def resolve_tokenizer(ref: HubRef) -> Path:
    """A tokenizer folder: `ref`'s folder, only its tokenizer files."""
    return resolve(ref, TOKENIZER_FILES)


def _file(ref: HubRef, filename: str) -> Path:
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(ref.repo, filename)
    if isinstance(cached, str):
        return Path(cached)
    if constants.HF_HUB_OFFLINE:
        raise HubError(_offline_message(ref))
    with one_line_errors(ref, filename):
        path = Path(hf_hub_download(ref.repo, filename, endpoint=constants.ENDPOINT))
    _verify(path, ref, filename)
    return path


def _cached_folder(ref: HubRef) -> Path:
    from huggingface_hub import snapshot_download

    try:
        root = Path(snapshot_download(ref.repo, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError and kin: nothing of this repository is cached
        raise HubError(_offline_message(ref)) from None
    folder = root / ref.subfolder if ref.subfolder else root
    if not folder.is_dir() or not any(folder.iterdir()):
        raise HubError(_offline_message(ref))
    return folder


def _offline_message(ref: HubRef) -> str:
    from huggingface_hub import constants

    return (
        f"{ref}: not in the hub cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set; fetch it once "
        f"online: `{ref.fetch_command()}`."
    )


def _verify(path: Path, ref: HubRef, filename: str) -> None:
    """Check a fresh download against the hub's checksum, which names its blob in the cache."""
    blob = Path(os.path.realpath(path))
    if re.fullmatch(r"[0-9a-f]{64}|[0-9a-f]{40}", blob.name):
        check_digest(path, blob.name, f"{ref.repo}/{filename}")


def check_digest(path: Path, expected: str, what: str) -> None:
    """`HubError` (and `path` removed, its cache blob too) unless the file's hub checksum is `expected`: a
    sha256 (64 hex digits, large files) or a git blob sha1 (40, small ones)."""
    blob = Path(os.path.realpath(path))
    if len(expected) == 64:
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1()
        digest.update(b"blob %d\0" % blob.stat().st_size)
    with open(blob, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise HubError(
            f"{what}: the download does not match the hub's checksum (expected {expected}, got "
            f"{digest.hexdigest()}); it was removed, run the command again to download it anew."
        )


@contextmanager
def one_line_errors(ref: HubRef, filename: str = ""):
    """huggingface_hub's exceptions as one `HubError` line each."""
    from huggingface_hub import errors as hf

    what = f"{ref.repo}/{filename}" if filename else str(ref)
    try:
        yield
    except hf.GatedRepoError:
        raise HubError(
            f"{ref.repo}: a gated repository; accept its terms on https://huggingface.co/{ref.repo} and log in "
            "(`hf auth login`, or set HF_TOKEN)."
        ) from None
    except hf.RepositoryNotFoundError:
        raise HubError(
            f"{ref.repo}: no such repository on the hub (check the name; a private one needs `hf auth login`)."
        ) from None
    except hf.RevisionNotFoundError:
        raise HubError(f"{ref.repo}: has no main revision.") from None
    except hf.EntryNotFoundError:
        raise HubError(f"{what}: the repository has no such file.") from None
    except hf.OfflineModeIsEnabled:
        raise HubError(_offline_message(ref)) from None
    except (HubError, KeyboardInterrupt):
        raise
    except Exception as e:  # network failures; a stream cut for good (huggingface_hub resumed it a few times)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HubError(f"{what}: download failed ({first}); run the command again to resume it.") from None


# ---------------------------------------------------------------------------------------------------
# Config paths
# ---------------------------------------------------------------------------------------------------


def resolve_hub_paths(section: Any, raw: dict, base_dir: Path) -> Any:
    """`section` (a config dataclass) with every path field that holds a hub id resolved to its cache
    path. `raw` is the section's TOML table: the values as written, before they were joined to `base_dir`
    (the config's folder). A value whose first folder exists in `base_dir` stays a (missing) local path."""
    changes: dict[str, str] = {}
    for f in fields(section):
        value, written = getattr(section, f.name), raw.get(f.name)
        if not f.metadata.get("path") or not isinstance(written, str) or not value or Path(value).exists():
            continue
        if (ref := parse_ref(written)) and not (base_dir / written.split("/")[0]).is_dir():
            changes[f.name] = str(resolve(ref))
    return replace(section, **changes) if changes else section


def resolve_model_paths(model: Any, raw: dict, base_dir: Path) -> Any:
    """`model` (a `ModelConfig`) with its hub ids resolved (`resolve_hub_paths`) and the record's default
    tokenizer filled in where a text encoder is a single file and no tokenizer is given."""
    from tuner.registry import architecture

    model = resolve_hub_paths(model, raw, base_dir)
    defaults = {}
    for name, spec in architecture(model.architecture).tokenizers:
        encoder = getattr(model, name.replace("tokenizer", "text_encoder"))
        if not getattr(model, name) and encoder and Path(encoder).is_file():
            defaults[name] = str(resolve_tokenizer(parse_ref(spec)))
    return replace(model, **defaults) if defaults else model
