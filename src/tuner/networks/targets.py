"""Which linear layers of a model get an adapter.

Every adapter type (LoRA, LoHa, LoKr, DoRA) adapts `nn.Linear` modules picked by name. The choice is
made from three lists of regular expressions, each *full-matched* against the module's qualified name
as `model.named_modules()` spells it (diffusers names, e.g. `blocks.0.attn1.to_q`):

- `defaults`: the architecture's usual targets. Plain data that lives with the architecture (for Wan,
  the attention and FFN projections inside `blocks`), never code.
- `exclude`: the user removes some of those (e.g. every cross-attention layer).
- `include`: the user adds layers back, and include wins over exclude, as in the tools our users come
  from, so "exclude all of block 0 except its q projection" is `exclude=[r"blocks\\.0\\..*"]`,
  `include=[r"blocks\\.0\\.attn1\\.to_q"]`. Unlike those tools, include may also reach linear layers
  outside the defaults (e.g. `proj_out`), which is the only way to train them.

So a linear layer is adapted when it matches `include`, or when it matches `defaults` and not `exclude`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from torch import nn

from tuner.errors import TunerError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetSpec:
    """Regexes (full match on qualified module names) that select the linear layers to adapt."""

    defaults: tuple[str, ...]
    """The architecture's default targets."""
    include: tuple[str, ...] = ()
    """Extra targets chosen by the user; they win over `exclude` and may lie outside `defaults`."""
    exclude: tuple[str, ...] = ()
    """Default targets the user does not want adapted."""


def _compile(patterns: tuple[str, ...], field: str) -> list[re.Pattern[str]]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as e:
            raise TunerError(
                f"target {field} pattern {pattern!r} is not a valid regular expression: {e}"
            ) from e
    return compiled


def _matches(patterns: list[re.Pattern[str]], name: str) -> bool:
    return any(p.fullmatch(name) for p in patterns)


def find_targets(model: nn.Module, spec: TargetSpec) -> dict[str, nn.Linear]:
    """Return the `nn.Linear` modules of `model` selected by `spec`, keyed by qualified name, in
    `named_modules()` order. Raises `TunerError` naming the patterns when nothing is selected."""
    defaults = _compile(spec.defaults, "default")
    include = _compile(spec.include, "include")
    exclude = _compile(spec.exclude, "exclude")

    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    selected = {
        name: m
        for name, m in linears.items()
        if _matches(include, name) or (_matches(defaults, name) and not _matches(exclude, name))
    }
    if not selected:
        raise TunerError(
            f"no linear layer of {type(model).__name__} matches the adapter targets "
            f"(defaults={list(spec.defaults)}, include={list(spec.include)}, exclude={list(spec.exclude)}); "
            f"patterns must fully match names such as {list(linears)[:3]}"
        )
    # A user pattern that matches no linear layer at all is most likely a typo; it is not an error
    # because a pattern list may be shared between variants of an architecture.
    for pattern in (*include, *exclude):
        if not any(pattern.fullmatch(name) for name in linears):
            logger.warning("adapter target pattern %r matches no linear layer", pattern.pattern)
    return selected
