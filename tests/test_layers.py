"""How tuner's modules may import each other: in layers, without circles, never a private name.

The layers, lowest first. A module imports modules of its own layer and of the layers below it, never
of a layer above (imports inside functions count as much as those at the top: they are the same
dependency, paid later):

    0  foundation    errors, io, dtypes
    1  records       registry, archs.record, archs.<family>.record: plain data; the code a record names
                     (trainer, key layout, fixture) is a "module:attribute" string, imported when asked for
    2  loading       models: reading checkpoint files and loading them into diffusers / transformers
    3  parts         networks (adapters, key layouts), fp8, attention, offload, compile, diffusion (the
                     flow-matching and DDPM math), optimizers, hub, fixtures: each attaches to a model or a
                     run from outside and knows nothing of configs
    4  config        the typed schema, which validates against the parts' names
    5  data, memory  datasets from a config's tables; a config's memory settings applied to a model
    6  archs         the family folders: what each architecture computes (`archs.model.ArchitectureModel`
                     and its subclasses), loaders, key tables, fixtures
    7  cache, caption, tools, distributed: they run a family's model (never the training loop)
    8  generate      sampling with the base model and adapters (also what the trainer's samples use)
    9  trainers      the training loop and its parts, run over a family's model
   10  entry points  cli, demo, ui

A module's layer is that of the longest name in `LAYERS` it falls under. A new module outside every
name fails `test_every_module_has_a_layer`: give it a place rather than a way around.

No circle: no module imports, directly or through others, a module that imports it back (importing
`tuner.a.b` runs `tuner/a/__init__.py` too, so that counts as importing `tuner.a`). No private names:
no module imports `_name` from another module, or reads `module._name` of a module it imported.
"""

from __future__ import annotations

import ast
import fnmatch
from collections import defaultdict
from pathlib import Path

import tuner

SRC = Path(tuner.__file__).parent.parent

LAYERS = {
    "tuner.errors": 0,
    "tuner.io": 0,
    "tuner.dtypes": 0,
    "tuner.ranks": 0,
    "tuner.registry": 1,
    "tuner.archs.record": 1,
    "tuner.archs.*.record": 1,
    "tuner.models": 2,
    "tuner.networks": 3,
    "tuner.fp8": 3,
    "tuner.attention": 3,
    "tuner.offload": 3,
    "tuner.compile": 3,
    "tuner.diffusion": 3,
    "tuner.optimizers": 3,
    "tuner.hub": 3,
    "tuner.fixtures": 3,
    "tuner.config": 4,
    "tuner.data": 5,
    "tuner.memory": 5,
    "tuner.archs": 6,
    "tuner.cache": 7,
    "tuner.caption": 7,
    "tuner.tools": 7,
    "tuner.distributed": 7,
    "tuner.generate": 8,
    "tuner.trainers": 9,
    "tuner.cli": 10,
    "tuner.demo": 10,
    "tuner.__main__": 10,
    "tuner.ui": 10,
}

# Exceptions, each with its reason (none today: an entry must name the import it allows, and this test fails
# on any other). (importer, imported module) / (importer, module, private name) / an edge of a circle
ALLOWED_UPWARD: set[tuple[str, str]] = set()
ALLOWED_PRIVATE: set[tuple[str, str, str]] = set()
ALLOWED_CIRCLE_EDGES: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((SRC / "tuner").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


class _Imports(ast.NodeVisitor):
    """The tuner modules one module imports, and the private names it takes from them."""

    def __init__(self, name: str, is_package: bool):
        self.package = name if is_package else name.rpartition(".")[0]
        self.modules: set[str] = set()
        self.private: set[tuple[str, str]] = set()
        self.aliases: dict[str, str] = {}  # local name -> tuner module bound to it

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.startswith("tuner."):
                self.modules.add(alias.name)
                if alias.asname:
                    self.aliases[alias.asname] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parent = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        if base != "tuner" and not base.startswith("tuner."):
            return
        for alias in node.names:
            if f"{base}.{alias.name}" in MODULES:
                self.modules.add(f"{base}.{alias.name}")
                self.aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
            else:
                self.modules.add(base)
                if _private(alias.name):
                    self.private.add((base, alias.name))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases and _private(node.attr):
            self.private.add((self.aliases[node.value.id], node.attr))
        self.generic_visit(node)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _imports(name: str) -> _Imports:
    path = MODULES[name]
    found = _Imports(name, path.name == "__init__.py")
    found.visit(ast.parse(path.read_text(encoding="utf-8")))
    found.modules.discard("tuner")
    found.modules.discard(name)
    return found


IMPORTS = {name: _imports(name) for name in MODULES}


def layer(module: str) -> int | None:
    """The layer of the longest entry of `LAYERS` that `module` is or lies under."""
    matches = [
        pattern
        for pattern in LAYERS
        if fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*")
    ]
    return LAYERS[max(matches, key=len)] if matches else None


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "tuner" and layer(m) is None] == []


def test_no_module_imports_a_higher_layer():
    upward = sorted(
        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
        for module, found in IMPORTS.items()
        for target in found.modules
        if module != "tuner" and (module, target) not in ALLOWED_UPWARD and layer(target) > layer(module)
    )
    assert upward == []


def test_the_allowed_upward_imports_are_still_there():
    """An allowance whose import is gone must go too, so it cannot cover a new one later."""
    assert sorted(pair for pair in ALLOWED_UPWARD if pair[1] not in IMPORTS[pair[0]].modules) == []
    present = {(m, *p) for m, found in IMPORTS.items() for p in found.private}
    assert sorted(set(ALLOWED_PRIVATE) - present) == []


def test_no_module_imports_a_private_name_of_another():
    private = sorted(
        f"{module} uses {source}.{name}"
        for module, found in IMPORTS.items()
        for source, name in found.private
        if (module, source, name) not in ALLOWED_PRIVATE
    )
    assert private == []


def _graph() -> dict[str, set[str]]:
    """module -> the modules importing it runs: those it imports and their parent packages."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, found in IMPORTS.items():
        for target in found.modules:
            if (module, target) in ALLOWED_CIRCLE_EDGES:
                continue
            while target != "tuner":
                if target != module and not module.startswith(target + "."):
                    graph[module].add(target)
                target = target.rpartition(".")[0]
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(MODULES):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle():
    assert _circles(_graph()) == []


def test_the_checks_see_what_they_check():
    """The graph holds function-level imports, parent packages and circles; the layer lookup takes the
    longest entry."""
    assert "tuner.hub" in IMPORTS["tuner.config"].modules  # imported inside load_config
    assert layer("tuner.archs.wan.record") == 1 and layer("tuner.archs.wan.loaders") == 6
    assert _circles({"tuner.io": {"tuner.errors"}, "tuner.errors": {"tuner.io"}}) == [
        ["tuner.errors", "tuner.io"]
    ]
    assert "tuner.networks" in _graph()["tuner.fp8"]  # fp8 imports tuner.networks.layouts
