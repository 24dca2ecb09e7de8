"""transformers' layerwise GaLore names (``galore_adamw_layerwise``, ``galore_adamw_8bit_layerwise``),
served by the plugin's ordinary optimizer while the plugin serves the name each maps to
(:data:`hf_galore_plugin.registry.LAYERWISE_ALIASES`)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

from ..registry import LAYERWISE_ALIASES

logger = logging.getLogger(__name__)

__all__ = ["LAYERWISE_KIND", "layerwise_served", "log_layerwise"]

LAYERWISE_KIND = "layerwise"  # the kind served_optimizer_names() reports for these names
_logged: set[str] = set()


def layerwise_served(served: Mapping[str, str], known_names: Collection[str]) -> dict[str, str]:
    """The layerwise names to serve: those transformers knows (`known_names`, the values of its
    ``OptimizerNames``) whose base name the plugin serves (`served`: name -> kind)."""
    return {
        alias: LAYERWISE_KIND
        for alias, base in LAYERWISE_ALIASES.items()
        if base in served and alias in known_names and alias not in served
    }


def log_layerwise(name: str, no_takeover_env: str) -> bool:
    """Log once per name that `name` runs the plugin's ordinary optimizer, and why that loses nothing of the
    layerwise mode; True when `name` is a layerwise name."""
    base = LAYERWISE_ALIASES.get(name)
    if base is None:
        return False
    if name not in _logged:
        _logged.add(name)
        logger.warning(
            "optim=%r is served by hf_galore_plugin as %r: its normal step never holds a dense gradient of a GaLore "
            "layer (the trainable factor is rank-sized), so the memory benefit of transformers' layerwise mode is "
            "already there, and gradient accumulation, DDP and gradient clipping keep working (set %s=1 to use "
            "transformers' layerwise implementation instead)",
            name,
            base,
            no_takeover_env,
        )
    return True
