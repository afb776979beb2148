"""Finding, checking and loading model checkpoints, shared by every architecture.

Users hold weights in two layouts:

* a **diffusers folder** (a pipeline root with `model_index.json` and one subfolder per component, or a
  component folder with `config.json`), loaded with `from_pretrained(local_dir)`;
* a **single file** (`.safetensors`, or `.pth` for some official releases) in the original release's key
  layout, often with a `model.diffusion_model.` prefix from ComfyUI and no config at all.

This module reads files (safetensors headers without the data, .pth through `torch.load(weights_only)`),
normalizes their keys (ComfyUI prefixes, scaled-fp8 weights), picks one component of a file that bundles
several (`component_entries`) and loads models through diffusers. A single file carries no config:
`tuner.models.identify` recognises its variant from tensor shapes, and the variant's shipped config
folder builds the model, never the hub. Everything that can go wrong (missing file, truncated download,
another architecture's checkpoint, unknown variant, missing keys) raises `CheckpointError` naming the
file and what to do.
"""

from __future__ import annotations

import contextlib
import json
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from tuner.errors import CheckpointError
from tuner.io import NotSafetensors, safetensors_header

if TYPE_CHECKING:  # transformers is imported where a tokenizer is loaded (it costs about a second)
    from transformers import PreTrainedTokenizerBase

# Prefixes other tools put in front of a component's keys (ComfyUI checkpoints and exports).
KNOWN_PREFIXES = ("model.diffusion_model.", "diffusion_model.")

# Keys of ComfyUI's legacy "scaled fp8" files: a marker tensor and a per-weight scale.
_SCALED_FP8_MARKER = "scaled_fp8"
# ComfyUI's fp8 files: the older layout has `<layer>.scale_weight` (+ a `scaled_fp8` marker), the newer
# one `<layer>.weight_scale` with a `<layer>.comfy_quant` description; input scales are for fp8 matmul.
_SCALE_SUFFIXES = (".scale_weight", ".scale_input", ".weight_scale", ".input_scale", ".comfy_quant")

_TORCH_PICKLE_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
T = TypeVar("T")


class TensorMeta(NamedTuple):
    """What a checkpoint header says about one tensor."""

    dtype: str
    shape: tuple[int, ...]


# ---------------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------------


def read_safetensors_header(path: str | Path) -> dict[str, TensorMeta]:
    """Return name -> (dtype, shape) for every tensor in a .safetensors file, reading only its header."""
    path = Path(path)
    _require_file(path)
    try:
        header, data_start = safetensors_header(path)
    except NotSafetensors as e:
        raise _corrupt(path, str(e)) from None
    data_size = path.stat().st_size - data_start
    tensors: dict[str, TensorMeta] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            meta = TensorMeta(str(entry["dtype"]), tuple(int(d) for d in entry["shape"]))
        except (TypeError, KeyError, ValueError):
            raise _corrupt(path, f"the header entry for {name!r} is malformed") from None
        if not 0 <= begin <= end <= data_size:
            raise _corrupt(path, f"tensor {name!r} lies past the end of the file (truncated download?)")
        tensors[name] = meta
    return tensors


def read_tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Return name -> shape without loading tensor data (.safetensors header, or an mmap'ed .pth)."""
    path = Path(path)
    if path.suffix in _TORCH_PICKLE_SUFFIXES:
        return {k: tuple(v.shape) for k, v in load_tensors(path, mmap=True).items()}
    return {name: meta.shape for name, meta in read_safetensors_header(path).items()}


def load_tensors(path: str | Path, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Load every tensor of a .safetensors or .pth file onto the CPU."""
    path = Path(path)
    _require_file(path)
    try:
        if path.suffix in _TORCH_PICKLE_SUFFIXES:
            # weights_only: a checkpoint must never run code; mmap: shapes can be read without the data.
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
                state = state["state_dict"]
            if not isinstance(state, dict):
                raise _corrupt(path, "it does not hold a state dict")
            return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        read_safetensors_header(path)  # clear errors for truncated or non-safetensors files
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    except CheckpointError:
        raise
    except pickle.UnpicklingError:  # weights_only refused it: the pickle names code, not just tensors
        raise CheckpointError(
            f"{path}: a pickled checkpoint that holds more than tensors. tuner does not load such files: "
            "unpickling one can run any code it contains. Convert it to .safetensors where you trust it, or "
            "use the .safetensors release of the model."
        ) from None
    except Exception as e:  # the readers raise many types; all mean the file is unreadable
        raise _corrupt(path, f"{type(e).__name__}: {e}") from None


def as_file_list(files: str | Path | Sequence[Path]) -> list[Path]:
    """One checkpoint as a list of files (a single file, or the shards of a sharded save)."""
    if isinstance(files, str | Path):
        return [Path(files)]
    if not files:
        raise CheckpointError("no checkpoint files given. Check the model paths in your config.")
    return [Path(f) for f in files]


def read_shapes_of(files: str | Path | Sequence[Path]) -> dict[str, tuple[int, ...]]:
    """`read_tensor_shapes` over one file or all shards of a checkpoint."""
    return {k: v for f in as_file_list(files) for k, v in read_tensor_shapes(f).items()}


def load_tensors_of(files: str | Path | Sequence[Path]) -> dict[str, torch.Tensor]:
    """`load_tensors` over one file or all shards of a checkpoint."""
    return {k: v for f in as_file_list(files) for k, v in load_tensors(f).items()}


def component_entries(entries: Mapping[str, T], prefixes: Sequence[str]) -> dict[str, T]:
    """The entries of one component: those under the first of `prefixes` the file uses, prefix dropped (a
    file bundling several components, e.g. SDXL's `conditioner.embedders.0.transformer.*`), else all of
    them (a file of that component alone)."""
    for prefix in prefixes:
        if any(k.startswith(prefix) for k in entries):
            return {k[len(prefix) :]: v for k, v in entries.items() if k.startswith(prefix)}
    return dict(entries)


def load_component_tensors(path: str | Path, prefixes: Sequence[str]) -> dict[str, torch.Tensor]:
    """`component_entries` of a file's tensors, reading only the component's own from a .safetensors file
    that bundles several."""
    path = Path(path)
    if path.suffix == ".safetensors":
        names = read_safetensors_header(path)
        prefix = next((p for p in prefixes if any(k.startswith(p) for k in names)), None)
        if prefix is not None:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return {k[len(prefix) :]: f.get_tensor(k) for k in names if k.startswith(prefix)}
    return component_entries(load_tensors(path), prefixes)


def strip_known_prefixes(names: Iterable[str]) -> dict[str, str]:
    """Map each component key to the stored key it came from, dropping a ComfyUI-style prefix.

    When some keys carry a known prefix, only those belong to the component (a full ComfyUI checkpoint
    also holds `first_stage_model.*`, `cond_stage_model.*`), so the others are left out.
    """
    names = list(names)
    for prefix in KNOWN_PREFIXES:
        if any(n.startswith(prefix) for n in names):
            return {n[len(prefix) :]: n for n in names if n.startswith(prefix)}
    return {n: n for n in names}


def normalize_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Shapes keyed by component key: prefixes stripped, fp8 scale tensors dropped."""
    return {k: shapes[stored] for k, stored in strip_known_prefixes(shapes).items() if not _is_scale_key(k)}


def normalize_state_dict(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Strip prefixes and dequantize ComfyUI's fp8 weights (weight × its scale, both layouts) into `dtype`."""
    renamed = {k: state_dict[stored] for k, stored in strip_known_prefixes(state_dict).items()}
    if not any(_is_scale_key(k) for k in renamed):
        return renamed
    out = {}
    for key, value in renamed.items():
        if _is_scale_key(key):
            continue
        scale = None
        if key.endswith(".weight"):
            stem = key.removesuffix(".weight")
            scale = renamed.get(stem + ".scale_weight", renamed.get(stem + ".weight_scale"))
        if scale is not None:
            value = (value.to(torch.float32) * scale.to(torch.float32)).to(dtype)
        out[key] = value
    return out


def _is_scale_key(key: str) -> bool:
    return key == _SCALED_FP8_MARKER or key.endswith(_SCALE_SUFFIXES)


# ---------------------------------------------------------------------------------------------------
# Folders
# ---------------------------------------------------------------------------------------------------


def resolve_folder(path: str | Path, subfolder: str) -> Path | None:
    """The diffusers component folder `path` points at, or None when `path` is a single file.

    Accepts the component folder itself (holding `config.json`) or a pipeline root (holding
    `model_index.json` or the `subfolder`).
    """
    path = Path(path)
    if path.is_file():
        return None
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder. Check the path in your config.")
    if (path / "config.json").is_file():
        return path
    if (path / subfolder / "config.json").is_file():
        return path / subfolder
    if (path / "model_index.json").is_file():
        raise CheckpointError(
            f"{path}: this diffusers pipeline folder has no {subfolder}/config.json. "
            f"Point to a folder that contains the {subfolder} component, or to a single .safetensors file."
        )
    raise CheckpointError(
        f"{path}: a folder without config.json or model_index.json. Point to a diffusers folder "
        "(pipeline root or component folder) or to a single checkpoint file."
    )


def read_folder_config(folder: Path) -> dict:
    """The `config.json` of a component folder."""
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{folder / 'config.json'}: cannot be read ({e}). Re-download the folder."
        ) from None


# ---------------------------------------------------------------------------------------------------
# Loading only a part of a model (pipeline stages)
# ---------------------------------------------------------------------------------------------------

# Inside `loading_only`: the model built empty -> the modules the loading process leaves on the meta device
_SKIPPING: ContextVar[Callable[[torch.nn.Module], list[torch.nn.Module]] | None] = ContextVar(
    "skipping", default=None
)


@contextlib.contextmanager
def loading_only(skipping: Callable[[torch.nn.Module], list[torch.nn.Module]]) -> Iterator[None]:
    """Inside, the diffusers loaders below (`load_diffusers_folder`, `load_diffusers_single_file`,
    `from_state_dict`) build the model on the meta device, ask `skipping` which of its modules this process
    does not hold, and load every tensor but theirs: those modules stay on the meta device (a diffusers
    folder's files give only the kept tensors' bytes). `skipping` returns [] for a model it does not cut
    (an auxiliary model the architecture's loader builds), which loads whole."""
    token = _SKIPPING.set(skipping)
    try:
        yield
    finally:
        _SKIPPING.reset(token)


def skipped_prefixes(model: torch.nn.Module) -> tuple[str, ...]:
    """The state-dict prefixes (`name.`) of the modules of `model` that `loading_only` leaves empty."""
    skipping = _SKIPPING.get()
    if skipping is None:
        return ()
    names = {id(m): name for name, m in model.named_modules()}
    return tuple(names[id(m)] + "." for m in skipping(model))


# ---------------------------------------------------------------------------------------------------
# Loading through diffusers
# ---------------------------------------------------------------------------------------------------


def load_diffusers_folder(
    model_cls: type, folder: Path, dtype: torch.dtype, class_name: str
) -> torch.nn.Module:
    """`model_cls.from_pretrained(folder)` offline, after checking the folder holds a `class_name`."""
    config = read_folder_config(folder)
    if config.get("_class_name") != class_name:
        raise CheckpointError(
            f"{folder}: config.json describes a {config.get('_class_name')!r}, not a {class_name}. "
            f"Point to a {class_name} folder or to a single checkpoint file."
        )
    if _SKIPPING.get() is not None:  # a pipeline stage: read only the tensors it keeps
        model = _empty_model(model_cls, folder)
        return _fill(model, _read_kept(folder, model), dtype, folder)
    try:
        model = model_cls.from_pretrained(folder, torch_dtype=dtype, local_files_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{folder}: cannot be loaded as a {class_name}: {e}") from None
    return model.eval()


def _read_kept(folder: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of a diffusers folder's weight files (`diffusion_pytorch_model*.safetensors`, one or
    the shards its index names) outside the prefixes `skipping` says the loading process leaves on the
    meta device; a safetensors file gives only those tensors' bytes."""
    files = sorted(folder.glob("diffusion_pytorch_model*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder}: no diffusion_pytorch_model*.safetensors; pipeline stages read only their own tensors "
            "from safetensors files. Convert the folder's weights to .safetensors."
        )
    from safetensors import safe_open

    skipped = skipped_prefixes(model)
    kept = {}
    for file in files:
        read_safetensors_header(file)  # clear errors for truncated or non-safetensors files
        with safe_open(str(file), framework="pt", device="cpu") as f:
            kept.update({k: f.get_tensor(k) for k in f.keys() if not k.startswith(skipped)})
    return kept


def load_diffusers_single_file(
    model_cls: type, state_dict: dict[str, torch.Tensor], config_dir: Path, dtype: torch.dtype, path: Path
) -> torch.nn.Module:
    """A diffusers model of the shipped config from a single file's tensors in the original release's
    layout, converted by the function diffusers' `from_single_file` uses for `model_cls` (its
    `SINGLE_FILE_LOADABLE_CLASSES` entry; a file already in diffusers' names is not converted, as there).

    Not `from_single_file` itself: to find that entry it imports every class it can load (some 20 model
    modules a run does not use). `state_dict` must already be checked to hold the expected keys; it is
    then built as `from_state_dict` builds, so both layouts give identical models.
    """
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = next(
        SINGLE_FILE_LOADABLE_CLASSES[c.__name__]
        for c in model_cls.__mro__
        if c.__name__ in SINGLE_FILE_LOADABLE_CLASSES
    )
    model = _empty_model(model_cls, config_dir)
    if set(model.state_dict()) != set(state_dict):
        try:
            state_dict = entry["checkpoint_mapping_fn"](checkpoint=state_dict, config=model.config)
        except (ValueError, RuntimeError, KeyError) as e:
            raise CheckpointError(f"{path}: cannot be loaded as a {model_cls.__name__}: {e}") from None
    return _fill(model, state_dict, dtype, path)


def from_state_dict(
    model_cls: type, state_dict: dict[str, torch.Tensor], config_dir: Path, dtype: torch.dtype, path: Path
) -> torch.nn.Module:
    """A diffusers model of the shipped config holding exactly `state_dict` (diffusers keys), cast the
    way `from_pretrained` casts. Parameters are built on the meta device, so no memory goes to random
    init; buffers are real (Chroma computes its non-persistent `mod_proj` table at construction)."""
    return _fill(_empty_model(model_cls, config_dir), state_dict, dtype, path)


def _empty_model(model_cls: type, config_dir: Path) -> torch.nn.Module:
    from accelerate import init_empty_weights

    with init_empty_weights():
        return model_cls.from_config(model_cls.load_config(config_dir))


def _fill(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, path: Path):
    skipped = skipped_prefixes(model)
    if skipped:  # the skipped modules keep their empty (meta) tensors; the rest must all be there
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith(skipped)}
        state_dict |= {k: v for k, v in model.state_dict().items() if k.startswith(skipped)}
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as e:  # shapes or names that do not fit the identified variant
        raise CheckpointError(f"{path}: cannot be loaded as a {type(model).__name__}: {e}") from None
    assert_materialized(model, path, skipped)
    cast_like_from_pretrained_(model, dtype)
    return model.eval()


def load_transformers_folder(
    model_cls: type, folder: Path, dtype: torch.dtype, model_type: str
) -> torch.nn.Module:
    """`model_cls.from_pretrained(folder)` of a transformers model (a text encoder) offline, after checking
    the folder's config describes a `model_type`."""
    found = read_folder_config(folder).get("model_type")
    if found != model_type:
        raise CheckpointError(
            f"{folder}: config.json describes a {found!r} model, not a {model_cls.__name__} ({model_type!r})."
        )
    try:
        model = model_cls.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{folder}: cannot be loaded as a {model_cls.__name__}: {e}") from None
    return model.eval()


def sibling(folder: Path, name: str) -> Path | None:
    """The folder `name` beside a pipeline component's `folder` (its tokenizer, another encoder), or None."""
    return folder.parent / name if (folder.parent / name).is_dir() else None


def beside(path: str | Path, subfolder: str, name: str) -> Path | None:
    """The folder `name` beside the pipeline component `subfolder` that `path` is (or holds, being the
    pipeline root), or None for a single file or where there is no such folder."""
    folder = resolve_folder(path, subfolder)
    return sibling(folder, name) if folder is not None else None


def second_text_encoder(first: str | Path, model: str, encoder: str, example: str) -> Path:
    """The `text_encoder_2/` beside the first text encoder `first` in a diffusers layout, or a CheckpointError
    telling how to give `model` its second text encoder (`encoder`, a single file such as `example`)."""
    found = beside(first, "text_encoder", "text_encoder_2")
    if found is None:
        raise CheckpointError(
            f"{first}: {model} needs a second text encoder ({encoder}). Set model.text_encoder_2 to its single "
            f"file (e.g. {example}) or diffusers folder, or point model.text_encoder at a {model} diffusers "
            "pipeline folder."
        )
    return found


@torch.no_grad()
def cast_like_from_pretrained_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating state-dict tensors to `dtype`, keeping the model's `_keep_in_fp32_modules` in fp32.

    Mirrors diffusers' `from_pretrained`: a tensor stays fp32 when one of the dotted parts of its name is
    in `_keep_in_fp32_modules` (for Wan: timestep embedder, modulation tables, affine norms).
    """
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.is_floating_point():
            target = torch.float32 if keep.intersection(name.split(".")) else dtype
            tensor.data = tensor.data.to(target)


def assert_materialized(model: torch.nn.Module, path: str | Path, skipped: tuple[str, ...] = ()) -> None:
    """Raise CheckpointError if any parameter or buffer (outside the `skipped` prefixes) was left without
    data (on the meta device)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    empty = [n for n, t in tensors if t.is_meta and not n.startswith(skipped)]
    if empty:
        raise CheckpointError(
            f"{path}: {len(empty)} tensors were not in the checkpoint (e.g. {', '.join(empty[:3])}). "
            "Use the complete base-model file."
        )


# ---------------------------------------------------------------------------------------------------


def _require_file(path: Path) -> None:
    if not path.is_file():
        where = "a folder, not a file" if path.is_dir() else "no such file"
        raise CheckpointError(f"{path}: {where}. Check the path in your config.")


def _corrupt(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: not a readable checkpoint ({why}). The file is damaged or incomplete; download it again."
    )


def load_tokenizer(path: str | Path | None, model_path: str | Path, what: str) -> PreTrainedTokenizerBase:  # noqa: F821
    """A tokenizer from a local folder, with errors that say which tokenizer `model_path` needs."""
    if path is None:
        raise CheckpointError(
            f"{model_path}: no tokenizer next to this text encoder. Set the tokenizer path to a folder with "
            f"the {what}."
        )
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: the tokenizer path must be a folder (with tokenizer.json).")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be loaded as a tokenizer: {e}") from None
