"""Each architecture's adapter key data: diffusers <-> original module names, and its fused layers.

An adapter file is portable only if its module names are the ones the loader expects. For the file
tools (`tuner lora info|convert|merge`), which work without loading a model, every architecture supplies
a table, as data:

- `renames`: (diffusers pattern, original pattern) pairs, `{i}` standing for a block index, e.g.
  `("blocks.{i}.attn1.to_q", "blocks.{i}.self_attn.q")` for Wan. A pattern also matches a longer dotted
  name (`...to_q.weight`), so the same table renames full checkpoints.
- `fused`: layers the original release keeps as one matrix and diffusers splits (see `fused.py`), e.g.
  FLUX's `double_blocks.{i}.img_attn.qkv` = rows of `transformer_blocks.{i}.attn.to_q / to_k / to_v`.

An `ArchitectureKeys` is itself a name map (diffusers -> original, `KeyError` outside the table), so a
trainer can pass it wherever a `NameMap` is expected, and its fused layers come along.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property

from tuner.errors import CheckpointError
from tuner.networks.delta import ModuleWeights
from tuner.networks.formats import FUSED_METADATA, layout_of
from tuner.networks.fused import FusedLayer, split
from tuner.networks.keys import COMFY_PREFIX, DIFFUSERS_PREFIXES, KOHYA_PREFIXES, own_name


@dataclass(frozen=True)
class ArchitectureKeys:
    """One architecture's module names in both layouts, and its fused layers."""

    name: str
    renames: tuple[tuple[str, str], ...]
    """(diffusers pattern, original pattern); `{i}` is a block index."""
    fused: tuple[FusedLayer, ...] = ()
    same_names: bool = False
    """The release uses diffusers' names (Qwen-Image): a name outside `renames` maps to itself. The
    renames still list the linear layers, so kohya stems (dots turned into underscores) read back."""
    kohya_names: tuple[tuple[str, str], ...] = ()
    """(diffusers pattern, ComfyUI's module name) for modules ComfyUI names otherwise than the release
    (HunyuanVideo's `img_mlp.fc1` is its `img_mlp.0`): ComfyUI's `lora_unet_` key map is its own module
    names with "_", so their kohya stems spell those (`stem`); the release's spelling still reads back."""
    musubi: ArchitectureKeys | None = None
    """musubi-tuner's own table where its model names or fuses modules otherwise than the release ComfyUI
    loads: the `musubi` layout writes its stems (`for_layout`), fusing only its fused layers. HunyuanVideo
    1.5: Tencent's separate q/k/v where ComfyUI's files fuse them; Z-Image and FramePack: diffusers' names,
    unfused (`MUSUBI_DIFFUSERS_NAMES`). None: this table's names."""
    comfy_forms: tuple[str, ...] = ()
    """The stems ComfyUI's key map (`model_lora_keys_unet`) holds for this model beside every model's
    `diffusion_model.<name>` and `lora_unet_<name>`, as `tuner.networks.receivers` forms (`{o}` the
    release's name, `{c}` ComfyUI's, `{d}` diffusers', `{dp}` with `.processor.`; `_` after the letter:
    dots as "_"); a form with `{d}` maps onto a fused layer's rows too."""
    comfy_renames: tuple[tuple[str, str], ...] = ()
    """(old, new) text replaced in ComfyUI's module names beyond `kohya_names` (which its kohya stems spell
    the same): the renames its model makes as it loads the release (HunyuanVideo's `img_attn.qkv`)."""

    @cached_property
    def _to_original(self) -> list[tuple[re.Pattern[str], str]]:
        return [(_compile(d), o) for d, o in self.renames]

    @cached_property
    def _to_diffusers(self) -> list[tuple[re.Pattern[str], str]]:
        return [(_compile(o), d) for d, o in self.renames]

    @cached_property
    def _from_kohya(self) -> list[tuple[re.Pattern[str], str]]:
        # kohya stems replace every "." by "_"; written from original names (musubi) or diffusers names
        # (OneTrainer's `lora_transformer_`, and tuner's for the parts of a fused layer written apart).
        pairs = [(_compile(o.replace(".", "_"), rest=False), d) for d, o in self.renames]
        diffusers = [d for d, _ in self.renames] + [p for layer in self.fused for p in layer.parts]
        return pairs + [(_compile(d.replace(".", "_"), rest=False), d) for d in diffusers]

    def for_layout(self, layout: str) -> ArchitectureKeys:
        """The table a layout's stems are written from: `musubi` in the `musubi` layout where there is one."""
        return self.musubi if layout == "musubi" and self.musubi is not None else self

    def __call__(self, diffusers_name: str) -> str:
        """The original name of a diffusers module (or tensor key); `KeyError` outside the table."""
        if self.same_names:
            return diffusers_name
        return _rename(diffusers_name, self._to_original, f"{self.name} original")

    def to_diffusers(self, original_name: str) -> str:
        if self.same_names:
            return original_name
        return _rename(original_name, self._to_diffusers, f"{self.name} diffusers")

    def from_kohya(self, body: str) -> str:
        """The diffusers name of a kohya stem without its `lora_unet_` prefix."""
        found = {_fill(d, m) for p, d in self._from_kohya if (m := p.fullmatch(body))}
        if len(found) != 1:
            why = "fits several modules" if found else "matches no module"
            raise KeyError(f"kohya name {body!r} {why} of {self.name}")
        return found.pop()

    @cached_property
    def _kohya_table(self) -> ArchitectureKeys:
        return ArchitectureKeys(f"{self.name} kohya", self.kohya_names)

    def stem(self, name: str, layout: str) -> str | None:
        """The stem of a module the table names itself in the `kohya` layout: ComfyUI's name (`kohya_names`);
        None: the layout's usual stem (`NameMap`)."""
        if layout != "kohya" or not self.kohya_names:
            return None
        try:
            return KOHYA_PREFIXES[0] + self._kohya_table(name).replace(".", "_")
        except KeyError:
            return None

    def comfy_name(self, name: str) -> str:
        """ComfyUI's module name of diffusers module `name`: `kohya_names`' where it lists one, else the
        release's (`KeyError` outside the table)."""
        if self.kohya_names:
            try:
                return self._kohya_table(name)
            except KeyError:
                pass
        return self(name)

    def name_of_stem(self, stem: str) -> str | None:
        """The module a `stem` of `kohya_names` stands for, or None."""
        if not self.kohya_names or not stem.startswith(KOHYA_PREFIXES[0]):
            return None
        try:
            return self._kohya_table.from_kohya(stem.removeprefix(KOHYA_PREFIXES[0]))
        except KeyError:
            return None

    def fused_layer(self, body: str, kohya: bool = False) -> tuple[FusedLayer, str, list[str]] | None:
        """(layer, original name, part names) when a stem body names one of the fused layers."""
        for layer in self.fused:
            if (found := layer.resolve(body, kohya)) is not None:
                return layer, *found
        return None


MUSUBI_DIFFUSERS_NAMES = ArchitectureKeys("musubi-tuner (diffusers' names)", (), same_names=True)
"""The `musubi` table of an architecture whose musubi-tuner model keeps diffusers' module names (Z-Image,
FramePack): its `lora_unet_` stems are those with "_", unfused (`layers_0_attention_to_q`)."""

COMFY_DIFFUSERS_FORMS = ("transformer.{d}", "lora_transformer_{d_}", "{d}")
"""The `comfy_forms` of `comfy.model_base.Flux` and its subclasses (FLUX.1, Kontext, Chroma, FLUX.2):
diffusers' names (`flux_to_diffusers`), onto the fused rows too."""
COMFY_BARE_FORMS = ("{c}", "transformer.{c}")
"""The `comfy_forms` of Qwen-Image's and Kandinsky 5's models: the module name, bare or under `transformer.`
(`{c}` is the release's name: theirs are diffusers')."""


def _compile(pattern: str, rest: bool = True) -> re.Pattern[str]:
    body = re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)")
    return re.compile(body + (r"(?P<rest>\..+)?" if rest else ""))


def _fill(target: str, m: re.Match[str]) -> str:
    groups = m.groupdict()
    return target.replace("{i}", groups.get("i") or "") + (groups.get("rest") or "")


def _rename(name: str, rules: list[tuple[re.Pattern[str], str]], direction: str) -> str:
    for pattern, target in rules:
        if m := pattern.fullmatch(name):
            return _fill(target, m)
    raise KeyError(f"no rule maps {name!r} to the {direction} layout")


# ---------------------------------------------------------------------------------------------------
# The tables of the registered architectures (`tuner.registry`), imported only when asked for.
# ---------------------------------------------------------------------------------------------------


def architecture_keys(name: str) -> ArchitectureKeys:
    """The key table of architecture `name` (FLUX.1 Kontext shares FLUX.1's, Qwen-Image-Edit Qwen-Image's:
    a file says which in its metadata)."""
    from tuner.registry import ARCHITECTURES

    if name not in ARCHITECTURES:
        raise CheckpointError(
            f"no adapter key table for architecture {name!r}; known: {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name].key_table()


def detect_architecture(
    stems: Iterable[str], metadata: Mapping[str, str], where: str, context: Iterable[str] = ()
) -> ArchitectureKeys:
    """The architecture of an adapter file: from tuner's metadata, else the one table that names every
    module of the file. When several do and read it differently, `context` (stems of every weight
    matrix of the model, where one is at hand) decides: the table that names the most of them."""
    if arch := metadata.get("tuner.architecture"):
        return architecture_keys(arch)
    from tuner.registry import ARCHITECTURES

    stems = list(stems)
    # one entry per distinct table: architectures that share module names (FLUX.1 and Kontext) are one
    tables = list({id(keys): keys for keys in map(architecture_keys, ARCHITECTURES)}.values())
    fitting = [keys for keys in tables if _names_all(stems, keys)]
    if len(fitting) > 1 and len({_reading(stems, keys) for keys in fitting}) == 1:
        return fitting[0]  # the tables that fit read these modules alike (Chroma's are FLUX.1's blocks)
    if len(fitting) > 1 and (context := list(context)):
        # FLUX.1, Chroma and FLUX.2 share their attention layers' names, not their modulations'
        scores = sorted(((sum(_names_all([c], keys) for c in context), i) for i, keys in enumerate(fitting)),
                        reverse=True)  # fmt: skip
        if scores[0][0] > scores[1][0]:
            return fitting[scores[0][1]]
    if len(fitting) != 1:
        why = "fit several" if fitting else "fit none"
        raise CheckpointError(
            f"{where}: cannot tell the architecture: its module names {why} of {', '.join(ARCHITECTURES)}; "
            "pass --arch"
        )
    return fitting[0]


def _reading(stems: list[str], keys: ArchitectureKeys) -> str:
    """How a table reads `stems` (their diffusers names or fused parts) and the layout its architecture
    saves by default: two tables with the same reading convert the file the same way."""
    from tuner.registry import ARCHITECTURES

    names = [repr(names_of_stem(stem, replace(keys, same_names=False))) for stem in stems]
    record = ARCHITECTURES.get(keys.name)
    return repr((names, record.save_format if record else None))


def _names_all(stems: list[str], keys: ArchitectureKeys) -> bool:
    """Whether the table names every stem; a table that passes unknown names through (`same_names`)
    only counts the names it lists, or it would fit every file."""
    keys = replace(keys, same_names=False)
    try:
        for stem in stems:
            names_of_stem(stem, keys)
    except KeyError:
        return False
    return True


def canonical_modules(
    modules: Mapping[str, ModuleWeights], keys: ArchitectureKeys, metadata: Mapping[str, str], where: str
) -> dict[str, ModuleWeights]:
    """The modules of a file keyed by diffusers module name, whatever layout their stems are in; fused
    layers are split into their parts."""
    records = json.loads(metadata.get(FUSED_METADATA, "{}"))
    out: dict[str, ModuleWeights] = {}
    for stem, weights in modules.items():
        try:
            found = names_of_stem(stem, keys)
        except KeyError as e:
            raise CheckpointError(f"{where}: module {stem!r} is not a module of {keys.name} ({e})") from None
        if isinstance(found, str):
            pieces = {found: weights}
        else:
            layer, original, parts = found
            pieces = split(weights, parts, layer, records.get(original))
        for name, piece in pieces.items():
            if name in out:
                raise CheckpointError(f"{where}: module {name} is stored twice (under several names)")
            out[name] = piece
    return out


def names_of_stem(stem: str, keys: ArchitectureKeys) -> str | tuple[FusedLayer, str, list[str]]:
    """The diffusers name a stem stands for, or (layer, original, parts) for a fused layer."""
    if (name := own_name(keys, stem)) is not None:  # stems the table names itself (SDXL's text encoders)
        return name
    layout = layout_of(stem)
    if layout == "diffusers":
        return next(stem.removeprefix(p) for p in DIFFUSERS_PREFIXES if stem.startswith(p))
    if layout == "comfy":
        original = stem.removeprefix(COMFY_PREFIX)
        return keys.fused_layer(original) or keys.to_diffusers(original)
    if layout == "kohya" and stem.startswith(KOHYA_PREFIXES):
        body = next(stem.removeprefix(p) for p in KOHYA_PREFIXES if stem.startswith(p))
        return keys.fused_layer(body, kohya=True) or keys.from_kohya(body)
    raise KeyError(f"unknown stem layout of {stem!r}")
