"""Which tool reads which adapter file: ComfyUI, diffusers and musubi-tuner, each by its own key rules.

`read_by_tools(architecture, modules)` says, per tool, which modules (key stems) of a file it loads and
which it drops, or that it refuses the file, or has no loader for the architecture. None of the tools is
imported: each one's rules are data, from their published loaders (facts, not code): the rules every model
shares here, each model's in its family folder (its record and its key table, `ArchitectureKeys`):

- **ComfyUI** (0.8, `model_lora_keys_unet` in `comfy/lora.py`, name tables in `comfy/utils.py`) builds a key
  map from its model's module names: `diffusion_model.<name>` and `lora_unet_<name with "_">`, with any of
  the suffixes `lora_A/B`, `lora_down/up`, `hada_*`, `lokr_*`, `.alpha` (absent: scale 1) and `dora_scale`,
  plus per-model extras (`ArchitectureKeys.comfy_forms`). Its module names are the release's, but for those
  `ArchitectureKeys.kohya_names` and `comfy_renames` change (HunyuanVideo's `img_mlp.0`), and a fused layer
  (`img_attn.qkv`) has no name for its parts unless an extra maps diffusers' names onto its rows (FLUX.1,
  Chroma, SD3, Z-Image). A key outside the map is logged as "lora key not loaded" and dropped: the file
  loads partially.
- **diffusers** (0.42, `loaders/lora_pipeline.py`, `loaders/lora_conversion_utils.py`): the pipeline's
  `load_lora_weights` (`Architecture.diffusers_loader`) converts known foreign layouts, refuses a file with
  a key lacking "lora" (`.alpha`, `hada_*`, `lokr_*`: "Invalid LoRA checkpoint") or one its converter
  cannot cut, and loads 0 layers with only a warning when no key names a module under `transformer.`. What
  each loader does with each of tuner's layouts was measured on every fixture (`Architecture.diffusers_reads`
  and `diffusers_drops`); `tests/test_receivers.py` loads the files into the real models to keep it true.
  It drops `dora_scale` with a warning.
- **musubi-tuner** (`networks/lora.py` `create_modules` and its `networks/lora_<model>.py`; the models it
  trains: `Architecture.musubi_trains`) names an adapter `lora_unet_` + its model's module name with "_"
  and loads with `strict=False`: a stem its model lacks is dropped without a word. Its model's names are
  `ArchitectureKeys.musubi` where tuner knows them apart from ComfyUI's (`keys.for_layout("musubi")`).
  Files of other layouts it reads only after its `convert_lora.py`, so they count as dropped here.

`layout_table()` renders, per architecture, what each tool does with each layout tuner writes
(docs/architectures.md), from the stems `export_stems` gets out of the real exporter.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tuner.archs.record import Architecture
from tuner.errors import TunerError
from tuner.networks.architectures import (
    ArchitectureKeys,
    architecture_keys,
    detect_architecture,
    names_of_stem,
)
from tuner.networks.delta import LORA, ModuleWeights
from tuner.networks.formats import FOLDED_ALPHA, LAYOUTS, layout_of, layout_state, parse_modules
from tuner.networks.fused import group_parts
from tuner.networks.keys import KOHYA_PREFIXES, KOHYA_TEXT_PREFIXES, describe_source, read_safetensors

TOOLS = ("ComfyUI", "diffusers", "musubi-tuner")
KOHYA = KOHYA_PREFIXES[0]

# ---------------------------------------------------------------------------------------------------
# The rules, as data
# ---------------------------------------------------------------------------------------------------

COMFY_FORMS = ("diffusion_model.{c}", "lora_unet_{c_}")
"""Every ComfyUI model: its module name `c` (dots, or "_" in kohya's spelling). A model's extra forms are
its key table's `ArchitectureKeys.comfy_forms`."""


# ---------------------------------------------------------------------------------------------------
# Reading a file as each tool would
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """What one tool does with one file: the stems it loads and drops, or why it takes none."""

    tool: str
    loaded: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    refused: str = ""
    """Why the tool raises on the file; empty: it does not."""
    absent: str = ""
    """Why the tool has no loader for the architecture; empty: it has."""

    @property
    def verdict(self) -> str:
        """loads / partial (n of m ignored) / none (m ignored) / refused / n/a."""
        if self.absent:
            return "n/a"
        if self.refused:
            return "refused"
        if not self.ignored:
            return "loads"
        total = len(self.ignored) + len(self.loaded)
        return (
            f"partial ({len(self.ignored)} of {total} ignored)" if self.loaded else f"none ({total} ignored)"
        )

    @property
    def silent_loss(self) -> bool:
        """Whether the tool loads the file but drops modules of it (ComfyUI and musubi-tuner say nothing)."""
        return bool(self.ignored) and not self.refused and not self.absent


def read_by_tools(
    architecture: str, modules: Mapping[str, ModuleWeights], metadata: Mapping[str, str] | None = None
) -> dict[str, Reading]:
    """What ComfyUI, diffusers and musubi-tuner do with a file of `architecture` holding `modules` (by
    stem, as `parse_modules` reads them) and `metadata` (a comfy file folding alpha says so there)."""
    from tuner.registry import architecture as record_of

    record = record_of(architecture)
    keys = architecture_keys(architecture)
    readings = {stem: _names(stem, keys) for stem in modules}
    return {
        "ComfyUI": _comfy(keys, readings),
        "diffusers": _diffusers(record, keys, modules, readings, FOLDED_ALPHA in (metadata or {})),
        "musubi-tuner": _musubi(record, keys, readings),
    }


def read_file(path: str | os.PathLike, arch: str | None = None) -> tuple[str, dict[str, Reading]]:
    """(architecture, `read_by_tools`) of an adapter file; the architecture from `arch`, the file's metadata
    or its module names."""
    tensors, metadata = read_safetensors(path)
    modules = parse_modules(tensors, metadata, describe_source(path))
    arch = arch or metadata.get("tuner.architecture")
    arch = arch or detect_architecture(modules, metadata, describe_source(path)).name
    return arch, read_by_tools(arch, modules, metadata)


MEANT_FOR = {"comfy": "ComfyUI", "comfy_folded": "ComfyUI", "kohya": "ComfyUI", "musubi": "musubi-tuner",
             "diffusers": "diffusers"}  # fmt: skip
"""The tool each layout is written for."""


def describe(reading: Reading, shown: int = 3) -> str:
    """One line: the verdict, why a refusal, and a few of the stems dropped."""
    text = reading.verdict + (
        f": {reading.refused or reading.absent}" if reading.refused or reading.absent else ""
    )
    if reading.silent_loss:
        text += f", e.g. {', '.join(reading.ignored[:shown])}"
    return text


def silent_loss_warning(
    architecture: str, modules: Mapping[str, ModuleWeights], metadata: Mapping[str, str], layout: str
) -> str:
    """A one-line warning when the tool `layout` is meant for would drop modules of the file silently; else ""."""
    tool = MEANT_FOR.get(layout)
    reading = read_by_tools(architecture, modules, metadata)[tool] if tool else None
    if reading is None or not reading.silent_loss:
        return ""
    return f"warning: {tool} would load this {layout} file without {len(reading.ignored)} of its modules " \
        f"({describe(reading)}); see `tuner lora info`"  # fmt: skip


def _names(stem: str, keys: ArchitectureKeys) -> tuple[list[str], str | None]:
    """(diffusers names, fused release name or None) a stem stands for; ([], None) when it names no module."""
    try:
        found = names_of_stem(stem, keys)
    except KeyError:
        return [], None
    return ([found], None) if isinstance(found, str) else (list(found[2]), found[1])


def _split(readings: Mapping[str, tuple[list[str], str | None]], accepts) -> tuple[tuple, tuple]:
    loaded = tuple(stem for stem, reading in readings.items() if accepts(stem, *reading))
    return loaded, tuple(stem for stem in readings if stem not in loaded)


def comfy_stems(keys: ArchitectureKeys, names: list[str], fused: str | None) -> set[str]:
    """Every stem ComfyUI maps onto the weight of `names` (one module, or the parts of `fused`)."""
    extras = keys.comfy_forms
    values = _comfy_values(keys, names, fused)
    if fused is not None:
        forms = COMFY_FORMS + tuple(f for f in extras if "{d" not in f)
    elif any(layer.part_of(names[0]) for layer in keys.fused):
        forms = tuple(
            f for f in extras if "{d" in f
        )  # a fused layer's part: only diffusers-name maps cut rows
    else:
        forms = COMFY_FORMS + extras
    return {_fill(form, values) for form in forms if _fillable(form, values)}


def _comfy_values(keys: ArchitectureKeys, names: list[str], fused: str | None) -> dict[str, str]:
    """The names a ComfyUI stem form is filled with: `c` its module's, `o` the release's, `d` diffusers'."""
    if fused is not None:
        values = {"c": fused, "o": fused}
    elif any(layer.part_of(names[0]) for layer in keys.fused):
        values = {"d": names[0]}
    else:
        values = {"d": names[0]}
        try:
            values |= {"c": keys.comfy_name(names[0]), "o": keys(names[0])}
        except KeyError:
            pass
    if "d" in values:
        values["dp"] = _processor_name(values["d"])
    if "c" in values:
        for old, new in keys.comfy_renames:
            values["c"] = values["c"].replace(old, new)
    return values


def comfy_key_map(architecture: str, checkpoint_keys) -> set[str]:
    """Every stem ComfyUI's key map holds for its model of `architecture` loaded from a release file with
    `checkpoint_keys` (its `diffusion_model.<name>.weight` keys, before ComfyUI renames them): what
    `model_lora_keys_unet` builds, minus the diffusers-name slices of fused layers."""
    keys = architecture_keys(architecture)
    stems = set()
    for key in checkpoint_keys:
        if not key.endswith(".weight"):
            continue
        original = key.removeprefix("model.").removeprefix("diffusion_model.").removesuffix(".weight")
        values = {"o": original, "c": original}
        try:
            values["d"] = keys.to_diffusers(original)
            values["c"] = keys.comfy_name(values["d"])
        except KeyError:
            pass  # a fused layer, or a weight adapters do not name
        if "d" in values:
            values["dp"] = _processor_name(values["d"])
        for old, new in keys.comfy_renames:
            values["c"] = values["c"].replace(old, new)
        stems |= {_fill(form, values) for form in COMFY_FORMS + keys.comfy_forms if _fillable(form, values)}
    return stems


def _processor_name(name: str) -> str:
    """SDXL's diffusers-name stems in ComfyUI's map: attention linears under `.processor.`, `to_out` without `.0`."""
    name = name.replace(".to_", ".processor.to_")
    return name.removesuffix(".0") if name.endswith(".to_out.0") else name


def _fillable(form: str, values: Mapping[str, str]) -> bool:
    return all(f"{{{k}" not in form or k in values for k in ("c", "o", "dp", "d"))


def _fill(form: str, values: Mapping[str, str]) -> str:
    for key, value in values.items():
        form = form.replace(f"{{{key}_}}", value.replace(".", "_")).replace(f"{{{key}}}", value)
    return form


def _comfy(keys: ArchitectureKeys, readings) -> Reading:
    def accepts(stem: str, names: list[str], fused: str | None) -> bool:
        if stem.startswith(KOHYA_TEXT_PREFIXES + ("text_encoder.", "text_encoder_2.")):
            return True  # `model_lora_keys_clip`: kohya's and diffusers' text-encoder names
        return bool(names) and stem in comfy_stems(keys, names, fused)

    return Reading("ComfyUI", *_split(readings, accepts))


def musubi_stems(keys: ArchitectureKeys, names: list[str]) -> set[str]:
    """The stems musubi-tuner's model gives `names`: its fused layers as one, the rest under its names."""
    table = keys.for_layout("musubi")
    try:
        groups, plain = group_parts(names, table.fused)
    except TunerError:  # a part of a fused layer alone: musubi-tuner has no name for it
        return set()
    stems = {KOHYA + original.replace(".", "_") for original in groups}
    for name in plain:
        try:
            stems.add(KOHYA + table(name).replace(".", "_"))
        except KeyError:
            pass
    return stems


def _musubi(record: Architecture, keys: ArchitectureKeys, readings) -> Reading:
    if not record.musubi_trains:
        return Reading("musubi-tuner", absent=f"musubi-tuner does not train {record.name}")
    return Reading(
        "musubi-tuner", *_split(readings, lambda stem, names, _: {stem} == musubi_stems(keys, names))
    )


def _diffusers(record: Architecture, keys: ArchitectureKeys, modules, readings, folded: bool) -> Reading:
    if not record.diffusers_loader:
        return Reading("diffusers", absent="its pipeline has no LoRA loader")
    if other := [stem for stem, w in modules.items() if w.kind != LORA]:
        return Reading("diffusers", refused=f"LoRA only: {other[0]} is not (`hada_*` / `lokr_*` keys)")
    layouts = {stem: _layout(stem, keys, names, folded or modules[stem].alpha is None)
               for stem, (names, _) in readings.items()}  # fmt: skip
    outcome = {stem: record.diffusers_reads.get(layout, "ignores") for stem, layout in layouts.items()}
    for stem, layout in layouts.items():
        if (drops := dict(record.diffusers_drops).get(layout)) and drops in stem:
            outcome[stem] = "ignores"
    if refused := next((o for o in outcome.values() if o.startswith("refuses")), None):
        return Reading("diffusers", refused=refused.removeprefix("refuses: "))
    return Reading("diffusers", *_split(readings, lambda stem, *_: outcome[stem] == "loads"))


def _layout(stem: str, keys: ArchitectureKeys, names: list[str], folded: bool) -> str:
    """The tuner layout a stem is in; a kohya-spelled stem of musubi-tuner's own names is `musubi`, a comfy
    stem without `.alpha` (`folded`) `comfy_folded`."""
    layout = layout_of(stem)
    if layout == "comfy" and folded:
        return "comfy_folded"
    if layout == "kohya" and keys.musubi is not None and stem in musubi_stems(keys, names):
        return "musubi"
    return layout


# ---------------------------------------------------------------------------------------------------
# The table of docs/architectures.md
# ---------------------------------------------------------------------------------------------------


def export_stems(architecture: str, layout: str) -> tuple[dict[str, ModuleWeights], dict[str, str]]:
    """The modules (by stem) and metadata of the LoRA training `architecture` with its default targets
    writes in `layout`: the exporter run on its tiny fixture's module names (a model without weights)."""
    record = _record(architecture)
    modules = {
        name: ModuleWeights(LORA, {"down": torch.zeros(1, fan_in), "up": torch.zeros(fan_out, 1)}, 1.0)
        for name, (fan_out, fan_in) in _targets(architecture).items()
    }
    state, metadata = layout_state(modules, layout, record.key_table())
    return parse_modules(state, metadata, f"{architecture} {layout} export"), metadata


def _record(architecture: str):
    from tuner.registry import architecture as record_of

    return record_of(architecture)


@functools.cache
def _targets(architecture: str) -> dict[str, tuple[int, int]]:
    """(out, in) of the default targets of the tiny config of `architecture`'s first variant (the record's
    `tiny_variant`)."""
    from accelerate import init_empty_weights

    from tuner.networks.targets import TargetSpec, find_targets

    record = _record(architecture)
    with init_empty_weights():
        model = record.build_transformer(record.tiny_variant)
    found = find_targets(model, TargetSpec(record.default_targets))
    return {name: (m.out_features, m.in_features) for name, m in found.items()}


def layout_table() -> str:
    """Per architecture and layout, what each tool does with the LoRA file tuner writes (`*`: the default)."""
    from tuner.registry import ARCHITECTURES

    lines = ["| `model.architecture` | `save.format` | " + " | ".join(TOOLS) + " |", "|---|---|---|---|---|"]
    for name, record in ARCHITECTURES.items():
        for layout in LAYOUTS:
            readings = read_by_tools(name, *export_stems(name, layout))
            mark = " (auto)" if layout == record.save_format else ""
            cells = " | ".join(readings[tool].verdict for tool in TOOLS)
            lines.append(f"| `{name}` | `{layout}`{mark} | {cells} |")
    return "\n".join(lines)
