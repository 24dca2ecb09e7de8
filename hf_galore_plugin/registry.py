"""Entry-point loader for optimizer presets (group ``hf_galore_plugin.optimizers``).

Each entry point names a zero-argument callable that returns a
:class:`hf_galore_plugin.config.GaLoreConfig`. Any installed package can add names to the
group. A broken entry point never breaks ``import hf_galore_plugin``: it is reported with
its name and the distribution that declared it when somebody asks for it.
"""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint, entry_points

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hf_galore_plugin.optimizers"

__all__ = ["ENTRY_POINT_GROUP", "OptimizerEntryPointError", "list_optimizer_entry_points", "load_optimizer_preset"]


class OptimizerEntryPointError(RuntimeError):
    """An entry point of group ``hf_galore_plugin.optimizers`` could not be loaded or used."""


def list_optimizer_entry_points() -> dict[str, EntryPoint]:
    """All declared optimizer names, from every installed distribution (first one wins)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found and found[ep.name].value != ep.value:
            logger.warning(
                "optimizer name %r is declared twice (%s and %s); using the first",
                ep.name,
                found[ep.name].value,
                ep.value,
            )
            continue
        found.setdefault(ep.name, ep)
    return found


def load_optimizer_preset(name: str):
    """Load entry point `name` and call it; returns the preset's GaLoreConfig."""
    from .config import GaLoreConfig

    eps = list_optimizer_entry_points()
    if name not in eps:
        raise KeyError(
            f"unknown optimizer {name!r}; installed names are {sorted(eps)} (entry point group {ENTRY_POINT_GROUP!r})"
        )
    ep = eps[name]
    dist = getattr(ep, "dist", None)
    origin = f"{ep.value!r} from distribution {dist.name if dist else '?'!r}"
    try:
        factory = ep.load()
    except Exception as exc:  # an ImportError, SyntaxError, ... inside a third-party package
        raise OptimizerEntryPointError(
            f"optimizer entry point {name!r} ({origin}) failed to load: {type(exc).__name__}: {exc}. "
            "Fix or uninstall the package that declares it."
        ) from exc
    if not callable(factory):
        raise OptimizerEntryPointError(
            f"optimizer entry point {name!r} ({origin}) is not callable; it must name a function "
            "returning a GaLoreConfig"
        )
    config = factory()
    if not isinstance(config, GaLoreConfig):
        raise OptimizerEntryPointError(
            f"optimizer entry point {name!r} ({origin}) returned {type(config).__name__}, "
            "expected hf_galore_plugin.GaLoreConfig"
        )
    return config
