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

__all__ = [
    "ENTRY_POINT_GROUP",
    "LAYERWISE_ALIASES",
    "OptimizerEntryPointError",
    "list_optimizer_entry_points",
    "load_optimizer_preset",
]

# transformers' layerwise GaLore names -> the name whose preset serves them. transformers' layerwise mode
# steps each parameter in a gradient hook so that no full set of dense gradients exists at once; the
# plugin's step never holds a dense gradient of a GaLore layer (its trainable factor is rank-sized), so the
# ordinary optimizer gives that memory benefit and keeps gradient accumulation, DDP and clipping, which the
# layerwise mode refuses. A name is served this way only while the plugin serves the name it maps to.
LAYERWISE_ALIASES = {
    "galore_adamw_layerwise": "galore_adamw",
    "galore_adamw_8bit_layerwise": "galore_adamw_8bit",
    # transformers passes galore_adafactor_layerwise Adafactor's own defaults (relative_step=True) together with
    # its lr, which Adafactor refuses; served as galore_adafactor (lr-driven, as transformers' galore_adafactor).
    "galore_adafactor_layerwise": "galore_adafactor",
}


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
    """Load entry point `name` (or the one a layerwise alias maps to) and call it; returns its GaLoreConfig."""
    from .config import GaLoreConfig

    eps = list_optimizer_entry_points()
    if name not in eps and LAYERWISE_ALIASES.get(name) in eps:
        name = LAYERWISE_ALIASES[name]
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
