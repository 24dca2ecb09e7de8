"""The optimizer presets this package declares as entry points (group ``hf_galore_plugin.optimizers``).

Each is a zero-argument callable returning the preset's :class:`GaLoreConfig`; other packages
can declare more names the same way.
"""

from __future__ import annotations

from .config import GaLoreConfig


def galore_adamw() -> GaLoreConfig:
    return GaLoreConfig.preset("galore_adamw")


def galore_adamw_8bit() -> GaLoreConfig:
    return GaLoreConfig.preset("galore_adamw_8bit")


def galore_adafactor() -> GaLoreConfig:
    return GaLoreConfig.preset("galore_adafactor")


def galore_muon() -> GaLoreConfig:
    return GaLoreConfig.preset("galore_muon")


def qgalore_adamw_8bit() -> GaLoreConfig:
    return GaLoreConfig.preset("qgalore_adamw_8bit")
