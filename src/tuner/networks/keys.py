"""Key layouts of adapter files, and how their module names map back onto a model.

An adapter file stores a few tensors per adapted module under `<stem>.<suffix>`: the stem names the
module, the suffix names the tensor's role (for LoRA: down, up, alpha). Three layouts are common:

| layout               | stem                                 | LoRA suffixes                       | written by       |
|----------------------|--------------------------------------|-------------------------------------|------------------|
| original ("comfy")   | `diffusion_model.<original name>`    | `lora_A.weight lora_B.weight alpha` | tuner, ComfyUI   |
| kohya                | `lora_unet_<original, "." -> "_">`   | `lora_down.weight lora_up.weight alpha` | kohya, musubi |
| musubi               | kohya's, of musubi-tuner's names     | the same as kohya                   | musubi-tuner     |
| diffusers / PEFT     | `transformer.<diffusers name>`       | `lora_A.weight lora_B.weight`       | diffusers, PEFT  |

*Original names* are the module names of the model's original release (Wan: `blocks.0.self_attn.q`),
which is what ComfyUI builds its key map from; diffusers renames modules (`blocks.0.attn1.to_q`). Each
architecture supplies a *name map* (diffusers name -> original name) as data; the default is identity.

musubi is kohya's spelling where musubi-tuner's model names modules otherwise than ComfyUI (Z-Image and
FramePack keep diffusers' names there, HunyuanVideo 1.5 Tencent's separate q/k/v; see `formats.py`); the
readers take it as kohya.

Files are read the other way round: every stem must resolve to one module of the model. Rather than
inverting the name map or parsing stems, `ModuleNameIndex` writes down every stem each candidate
module could have in each layout and looks stems up. That is the only sound way for kohya stems, whose
underscores cannot be split back (`blocks_0_self_attn_q` might be `blocks.0.self_attn.q` or
`blocks.0.self.attn_q`), and it needs only the forward name map.
"""

from __future__ import annotations

import os
import pickletools
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from tuner.errors import CheckpointError
from tuner.io import NotSafetensors, safetensors_header

NameMap = Callable[[str], str]
"""Maps a diffusers module name to the original-release module name. A name map may also name some
modules' whole stems itself: a method `stem(name, layout) -> str | None` (None: the usual stem), and back,
`name_of_stem(stem) -> str | None`. SDXL's does, for its text encoders (`lora_te1_...`) and diffusers'
`unet.` prefix. And it may write a layout from another table: `for_layout(layout) -> NameMap`
(`layout_name_map`)."""


def own_stem(name_map: NameMap | None, name: str, layout: str) -> str | None:
    """The stem `name_map` gives module `name` in `layout` itself, or None (the layout's usual stem)."""
    stem = getattr(name_map, "stem", None)
    return stem(name, layout) if stem is not None else None


def layout_name_map(name_map: NameMap | None, layout: str) -> NameMap | None:
    """The name map `layout`'s stems are written from: the name map's own table for that layout (a method
    `for_layout(layout)`; musubi-tuner's names, see `ArchitectureKeys.musubi`), else the name map itself."""
    for_layout = getattr(name_map, "for_layout", None)
    return for_layout(layout) if for_layout is not None else name_map


def own_name(name_map: NameMap | None, stem: str) -> str | None:
    """The module a stem of `own_stem`'s names (the name map's `name_of_stem`), or None."""
    name_of_stem = getattr(name_map, "name_of_stem", None)
    return name_of_stem(stem) if name_of_stem is not None else None


COMFY_PREFIX = "diffusion_model."
KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_")
KOHYA_TEXT_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_")  # kohya's text encoders' (SD, SDXL)
# diffusers' prefix of the denoiser (`unet.` in UNet pipelines) and of its text encoders' LoRA parts
DIFFUSERS_PREFIXES = ("transformer.", "base_model.model.", "unet.", "text_encoder.", "text_encoder_2.")
ADAPTER_LAYOUTS = ("comfy", "comfy_folded", "kohya", "musubi", "diffusers")


def identity_name_map(name: str) -> str:
    return name


def describe_source(source: str | os.PathLike | Mapping[str, torch.Tensor]) -> str:
    """A name for error messages: the file name, or a placeholder for an in-memory state dict."""
    return "<state dict>" if isinstance(source, Mapping) else str(source)


PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl", ".pickle")


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read all tensors (on CPU) and the string metadata of a .safetensors file."""
    if not Path(path).is_file():
        raise CheckpointError(f"adapter file {path} does not exist")
    if is_pickle(path):
        raise CheckpointError(
            f"{path}: not a safetensors file (it is a pickle: refused, never unpickled). tuner does not load "
            "pickled files: loading one can run any "
            'code it contains. If you trust it, convert it once to .safetensors, e.g. python -c "import '
            "torch; from safetensors.torch import save_file; "
            f"save_file(torch.load('{path}', weights_only=True), '{Path(path).with_suffix('.safetensors')}')\""
        )
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises several unrelated types for a corrupt file
        raise CheckpointError(_unreadable(path, e)) from e
    return tensors, metadata


def _unreadable(path: str | os.PathLike, error: Exception) -> str:
    """Why `path` could not be read as safetensors, in words: not safetensors at all (random bytes, another
    format), or a safetensors header whose data is damaged or cut short."""
    try:
        safetensors_header(path)
    except NotSafetensors as why:
        return (
            f"{path}: not a safetensors file ({why}); it is damaged or not an adapter. Give the .safetensors "
            "file the trainer saved."
        )
    except OSError as e:
        return f"{path}: cannot read it ({e.strerror}); check its permissions."
    return f"{path}: a safetensors file whose data is damaged or cut short ({error}); use another copy of it."


def is_pickle(path: str | os.PathLike) -> bool:
    """A file written by `torch.save` or `pickle`: by its name, or by its first bytes (a pickle protocol
    marker, or the zip archive torch.save writes) where, read as safetensors' header length, they would
    point past the end of the file."""
    with open(path, "rb") as f:
        head = f.read(8)
    marker = (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")) or head[
        :4
    ] == b"PK\x03\x04"
    too_long = int.from_bytes(head.ljust(8, b"\0"), "little") + 8 > Path(path).stat().st_size
    if Path(path).suffix.lower() in PICKLE_SUFFIXES or (marker and too_long):
        return True
    return too_long and _parses_as_pickle(path)


def _parses_as_pickle(path: str | os.PathLike) -> bool:
    """Whether the file is a whole pickle of protocol 0 or 1 (no marker byte): its opcodes are read up to
    STOP by `pickletools.genops`, which parses and never runs them."""
    with open(path, "rb") as f:
        try:
            return any(opcode.name == "STOP" for opcode, _, _ in pickletools.genops(f))
        except Exception:  # not a pickle: genops raises ValueError and others on the first bad opcode
            return False


def nonfinite_keys(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Keys of the floating-point tensors that hold NaN or infinity (a file trained to NaN)."""
    return [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]


def split_keys(
    state_dict: Mapping[str, torch.Tensor], suffix_roles: Mapping[str, str], kind: str, source: str
) -> dict[str, dict[str, torch.Tensor]]:
    """Group `<stem>.<suffix>` keys into `{stem: {role: tensor}}` using `suffix_roles` (file suffix ->
    role; several suffixes may share a role, e.g. `lora_A.weight` and `lora_down.weight` are both
    "down"). Any other key is an error, so a file of another adapter type is not half-loaded."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in state_dict.items():
        for suffix, role in suffix_roles.items():
            if key.endswith("." + suffix):
                stem = key[: -len(suffix) - 1]
                roles = grouped.setdefault(stem, {})
                if role in roles:
                    raise CheckpointError(
                        f"{source}: module {stem!r} has two {role!r} tensors (e.g. {key!r})"
                    )
                roles[role] = tensor
                break
        else:
            unknown.append(key)
    if unknown:
        raise CheckpointError(
            f"{source}: {len(unknown)} keys are not {kind} tensors, e.g. {unknown[:5]}; "
            f"expected suffixes {sorted(suffix_roles)}"
        )
    return grouped


class ModuleNameIndex:
    """Looks up which module a file stem refers to, in any of the three layouts."""

    def __init__(
        self,
        module_names: Iterable[str],
        name_map: NameMap | None = None,
        prefix: str = COMFY_PREFIX,
    ) -> None:
        name_map = name_map or identity_name_map
        self._prefix = prefix
        self._names = set(module_names)
        self._stems: dict[str, str] = {}
        self._ambiguous: dict[str, set[str]] = {}
        for name in self._names:
            try:
                originals = [name_map(name)]
            except KeyError:  # a module the original release does not have (name maps are tables)
                originals = []
            stems = {prefix + original for original in originals}
            stems.update(p + name for p in DIFFUSERS_PREFIXES)
            # kohya stems are written from original names by musubi; accept diffusers names too.
            stems.update(k + n.replace(".", "_") for k in KOHYA_PREFIXES for n in (*originals, name))
            stems.update(s for layout in ADAPTER_LAYOUTS if (s := own_stem(name_map, name, layout)))
            for stem in stems:
                self._add(stem, name)

    def _add(self, stem: str, name: str) -> None:
        previous = self._stems.setdefault(stem, name)
        if previous != name:
            self._ambiguous.setdefault(stem, {previous}).add(name)

    def resolve(
        self, stems: Iterable[str], source: str, name_map_inverse: NameMap | None = None
    ) -> dict[str, str]:
        """Map every stem to a module name; unknown or ambiguous stems raise `CheckpointError`.
        `name_map_inverse` (original -> diffusers name) is a fallback for original-layout stems."""
        resolved, unknown, ambiguous = {}, [], []
        for stem in stems:
            if stem in self._ambiguous:
                ambiguous.append(f"{stem} -> {sorted(self._ambiguous[stem])}")
            elif stem in self._stems:
                resolved[stem] = self._stems[stem]
            elif (name := self._via_inverse(stem, name_map_inverse)) is not None:
                resolved[stem] = name
            else:
                unknown.append(stem)
        if ambiguous:
            raise CheckpointError(f"{source}: module names that fit several modules: {ambiguous[:5]}")
        if unknown:
            raise CheckpointError(
                f"{source}: {len(unknown)} modules in the file match no adapted module of the model, "
                f"e.g. {unknown[:5]} (wrong architecture, or a name map that does not fit?)"
            )
        duplicated = _duplicates(resolved)
        if duplicated:
            raise CheckpointError(
                f"{source}: the same module is stored under several names: {duplicated[:5]}"
            )
        return resolved

    def _via_inverse(self, stem: str, name_map_inverse: NameMap | None) -> str | None:
        if name_map_inverse is None or not stem.startswith(self._prefix):
            return None
        try:
            name = name_map_inverse(stem[len(self._prefix) :])
        except KeyError:
            return None
        return name if name in self._names else None


def _duplicates(resolved: Mapping[str, str]) -> list[list[str]]:
    by_module: dict[str, list[str]] = {}
    for stem, name in resolved.items():
        by_module.setdefault(name, []).append(stem)
    return [stems for stems in by_module.values() if len(stems) > 1]
