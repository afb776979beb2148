"""The documentation that depends on the records, generated from them.

The README's architecture table, example list and `save.format = "auto"` summary, and
`docs/architectures.md`'s variants, adapter-layout and tool tables are written between markers

    <!-- generated: NAME (python -m tuner.archs.docs --write) -->
    ...
    <!-- end generated: NAME -->

from the records (`tuner.registry`), the shipped variant configs (`archs/<family>/configs/transformer/`)
and the example TOMLs (`examples/`). `python -m tuner.archs.docs --write` rewrites them;
`tests/test_generated_docs.py` fails while any fragment differs from what this module renders.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

from tuner.archs.record import Architecture
from tuner.config import tomllib
from tuner.io import write_text
from tuner.registry import ARCHITECTURES, SAVE_LAYOUTS

REPO = Path(__file__).resolve().parents[3]
_LAYOUT_TEXT = {
    "comfy": "the release's names under `diffusion_model.` with a per-module `alpha`",
    "comfy_folded": "the release's names under `diffusion_model.`, alpha folded into `lora_B`",
    "kohya": "`lora_unet_` + the release's names with `lora_down` / `lora_up` / `alpha`",
    "diffusers": "the PEFT layout under `transformer.`, alpha folded in",
}


def examples(root: Path = REPO) -> dict[str, list[tuple[str, str | None]]]:
    """architecture -> [(training TOML, its dataset TOML or None)] of the example configs, by file name."""
    found: dict[str, list[tuple[str, str | None]]] = {}
    for path in sorted((root / "examples").glob("*.toml")):
        data = tomllib.loads(path.read_text())
        if "model" not in data:
            continue
        dataset = data.get("data", {}).get("dataset_config")
        found.setdefault(data["model"]["architecture"], []).append((path.name, dataset))
    return found


def _code_list(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def architecture_table(root: Path = REPO) -> str:
    shipped = examples(root)
    lines = [
        '| architecture | `model.architecture` | variants | `save.format = "auto"` loads in | example |',
        "|---|---|---|---|---|",
    ]
    for name, record in ARCHITECTURES.items():
        example = _code_list([train for train, _ in shipped.get(name, [])]) or "—"
        loads = f"`{record.save_format}`: {record.save_format_loads}"
        lines.append(
            f"| {record.title} | `{name}` | {_code_list(list(record.variants))} | {loads} | {example} |"
        )
    return "\n".join(lines)


def example_list(root: Path = REPO) -> str:
    lines = []
    for name, pairs in examples(root).items():
        files = "; ".join(
            f"`{train}`" + (f" with `{dataset}`" if dataset else "") for train, dataset in pairs
        )
        lines.append(f"   - `{name}`: {files}")
    return "\n".join(lines)


def auto_layouts() -> str:
    lines = []
    for layout in SAVE_LAYOUTS:
        names = [n for n, r in ARCHITECTURES.items() if r.save_format == layout]
        if names:
            lines.append(f"  - `{layout}` ({_LAYOUT_TEXT[layout]}): {_code_list(names)}")
    return "\n".join(lines)


def record_fields() -> str:
    """The fields of `Architecture` with their docstrings (the one description of each)."""
    tree = ast.parse(inspect.getsource(Architecture))
    body = tree.body[0].body
    lines = ["| field | what it holds |", "|---|---|"]
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr):
            doc = " ".join(inspect.cleandoc(after.value.value).split()).replace("|", "\\|")
            lines.append(f"| `{node.target.id}` | {doc} |")
    return "\n".join(lines)


def model_data() -> str:
    """What each architecture's record says of its model (the fields caching, generation and the loop read)."""
    lines = [
        "| `model.architecture` | spatial step | frames | video / images | control images | timesteps (auto) "
        "| objective | sound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in ARCHITECTURES.items():
        frames = f"{r.frame_multiple}N+{r.frame_remainder}" if r.frame_multiple > 1 else "any"
        frames += f", ≥ {r.min_frames}" if r.min_frames > 1 else ""
        media = "/".join(
            kind for kind, ok in (("video", r.supports_video), ("images", r.supports_images)) if ok
        )
        controls = "–".join(dict.fromkeys(map(str, r.control_images))) if r.control_images[1] else "—"
        sound = f"{r.audio_format[0]} Hz × {r.audio_format[1]}" if r.audio_format else "—"
        lines.append(
            f"| `{name}` | {r.spatial_step} | {frames} | {media} | {controls} | {r.timestep_mode} "
            f"| {r.objective} | {sound} |"
        )
    return "\n".join(lines)


def sampling_table() -> str:
    """Each record's `SamplingDefaults`: what `tuner generate` and `[sample]` use for what they are not given."""
    lines = [
        "| `model.architecture` | steps | guidance | embedded guidance | shift | negative prompt | from |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, record in ARCHITECTURES.items():
        rows = [(f"`{name}`", record.sampling)]
        rows += [(f"`{name}`, file name ~ `{pattern}`", named) for pattern, named in record.sampling.by_name]
        for label, d in rows:
            form = "" if d.cfg_form == "plain" else f" (`{d.cfg_form}`)"
            negative = f"`{d.negative_prompt!r}`" if len(d.negative_prompt) < 20 else "the pipeline's"
            cells = (label, d.steps, f"{d.guidance:g}{form}", _or_dash(d.embedded_guidance), _or_dash(d.shift),
                     negative if d.negative_prompt else "—", d.source.replace("|", "\\|"))  # fmt: skip
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _or_dash(value: float | str | None) -> str:
    return "—" if value is None else value if isinstance(value, str) else f"{value:g}"


def variants_table() -> str:
    lines = ["| `model.architecture` | transformer variants | files |", "|---|---|---|"]
    for name, record in ARCHITECTURES.items():
        where = f"`archs/{record.folder}/configs/transformer/`"
        lines.append(f"| `{name}` | {_code_list(list(record.variants))} ({where}) | {record.checkpoints} |")
    return "\n".join(lines)


def adapter_layouts() -> str:
    lines = ['| `model.architecture` | `save.format = "auto"` | loads in |', "|---|---|---|"]
    for name, record in ARCHITECTURES.items():
        lines.append(f"| `{name}` | `{record.save_format}` | {record.save_format_loads} |")
    return "\n".join(lines)


def tool_table() -> str:
    """Per architecture and layout, what ComfyUI, diffusers and musubi-tuner do with the file."""
    from tuner.networks.receivers import layout_table

    return layout_table()


def pipeline_table() -> str:
    """Per architecture, whether `distributed.strategy = "pipeline"` cuts it into stages, else why not."""
    from tuner.archs.model import pipeline_architectures

    offered = set(pipeline_architectures())
    lines = ['| `model.architecture` | `strategy = "pipeline"` |', "|---|---|"]
    for name, record in ARCHITECTURES.items():
        lines.append(f"| `{name}` | {'yes' if name in offered else 'refused: ' + record.pipeline_refused} |")
    return "\n".join(lines)


FRAGMENTS: dict[str, tuple[str, Callable[[], str]]] = {
    "record-fields": ("docs/architectures.md", record_fields),
    "architectures": ("README.md", architecture_table),
    "examples": ("README.md", example_list),
    "auto-layouts": ("README.md", auto_layouts),
    "model-data": ("docs/architectures.md", model_data),
    "sampling-defaults": ("docs/architectures.md", sampling_table),
    "variants": ("docs/architectures.md", variants_table),
    "adapter-layouts": ("docs/architectures.md", adapter_layouts),
    "tools": ("docs/architectures.md", tool_table),
    "pipeline-stages": ("docs/distributed.md", pipeline_table),
}
"""name -> (file relative to the repository, what renders it)."""


def _pattern(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- generated: {re.escape(name)} [^\n]*-->\n)(.*?)(<!-- end generated: {re.escape(name)} -->)",
        re.S,
    )


def stale(root: Path = REPO) -> list[str]:
    """The fragments whose text differs from what the records render (a missing marker counts)."""
    out = []
    for name, (file, render) in FRAGMENTS.items():
        match = _pattern(name).search((root / file).read_text())
        if match is None or match.group(2) != render() + "\n":
            out.append(f"{file}: {name}")
    return out


def write(root: Path = REPO) -> list[str]:
    """Rewrite every fragment in place; return the ones that changed. A file without a fragment's
    markers is an error naming them, and then nothing is written."""
    for name, (file, _) in FRAGMENTS.items():  # every marker first: nothing is written when one is missing
        if not _pattern(name).search((root / file).read_text()):
            raise SystemExit(
                f"{file}: no '<!-- generated: {name} ... -->' marker; add the pair where the fragment goes"
            )
    changed = []
    for name, (file, render) in FRAGMENTS.items():
        path = root / file
        text = path.read_text()
        new = _pattern(name).sub(lambda m, r=render: m.group(1) + r() + "\n" + m.group(3), text)
        if new != text:
            write_text(path, new)
            changed.append(f"{file}: {name}")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the fragments (else: list stale ones)")
    args = parser.parse_args(argv)
    if args.write:
        print("\n".join(write()) or "all fragments up to date")
        return 0
    out = stale()
    print("\n".join(out) or "all fragments up to date")
    return 1 if out else 0


if __name__ == "__main__":
    sys.exit(main())
