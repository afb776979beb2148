"""Import one diffusers model module without the ~100 others its package's `__init__` imports.

`diffusers.models.transformers/__init__.py` (likewise `autoencoders`, `unets`, `controlnets`) imports every
model module of its package. Python imports a package before any module in it, so importing
`diffusers.models.transformers.transformer_wan` (or asking `diffusers` for `WanTransformer3DModel`, which
does just that) runs that `__init__` first: about 80 transformer modules for one class (the Wan VAE's
package, 40 more). Once diffusers' own imports are in (below), they cost little CPU (0.1-0.3 s, about
0.1 x `import torch`, measured with diffusers 0.42), but they are code a run never uses, and any of them
can bring in more with a new diffusers.

Importing a module inside a package needs only the package's `__path__`, which its spec gives before its
`__init__` runs. While `deferred_packages()` is active, a finder first in `sys.meta_path` hands out each
subpackage of `diffusers.models` imported for the first time as a module built from its real spec whose
`__init__` has not run yet (`_Deferred`). Its modules import as usual; the first time anything asks the
package for a name it does not hold (`from diffusers.models.transformers import X`, `dir()`, ...), its
real `__init__` runs in it, once, under a lock, and the answer is the one the eager package gives. The
finder is removed when the block ends; no diffusers class or function is changed. A forked process
inherits the deferred packages, which work the same; a spawned one that never enters the block imports
diffusers the ordinary way.

What diffusers imports whatever the module (torch._dynamo from `diffusers.utils.torch_utils`,
`diffusers.quantizers` with transformers and bitsandbytes where installed, `diffusers.hooks` with peft
where installed, `diffusers.loaders`' single-file tables) is not deferred: `benchmarks/startup.py`
prints what it costs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

PARENT = "diffusers.models"
"""The package whose subpackages are deferred (each one level below it)."""

_LOCK = threading.RLock()
_INIT = "__tuner_deferred_init__"  # the real loader, in a deferred package's namespace until it runs


class _Deferred(ModuleType):
    """A package whose `__init__` runs the first time it is asked for a name it does not hold."""

    def __getattr__(self, name: str):
        finish(self)
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None

    def __dir__(self) -> list[str]:
        finish(self)
        return ModuleType.__dir__(self)


def finish(module: ModuleType) -> None:
    """Run a deferred package's real `__init__` now, if it has not run (a no-op for any other module);
    the package is then an ordinary module with its own loader. An `__init__` that fails runs again at
    the next question."""
    with _LOCK:
        loader = module.__dict__.pop(_INIT, None)
        if loader is None:
            return
        module.__loader__ = module.__spec__.loader = loader
        try:
            loader.exec_module(module)
        except BaseException:
            module.__dict__[_INIT] = loader
            raise
        # Only now: a thread asking meanwhile waits on the lock in `_Deferred.__getattr__`.
        module.__class__ = ModuleType


class _DeferringLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader):
        self.real = real

    def __getattr__(self, name: str):  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self.real, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _Deferred(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        module.__dict__[_INIT] = self.real


class _DeferringFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.rpartition(".")[0] != PARENT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.submodule_search_locations is None:  # a plain module: nothing to defer
            return None
        spec.loader = _DeferringLoader(spec.loader)
        return spec


@contextmanager
def deferred_packages() -> Iterator[None]:
    """Within the block, a subpackage of `diffusers.models` imported for the first time defers its
    `__init__` (see the module's docstring). Each block adds its own finder and removes it at its end, so
    nested and concurrent blocks need no coordination."""
    finder = _DeferringFinder()
    with _LOCK:
        sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        with _LOCK:
            sys.meta_path.remove(finder)


def diffusers_class(name: str) -> type:
    """The diffusers class `name` (`WanTransformer3DModel`), importing only the module that defines it."""
    with deferred_packages():
        import diffusers

        return getattr(diffusers, name)
