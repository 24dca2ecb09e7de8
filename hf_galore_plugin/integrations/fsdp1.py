"""Moved to :mod:`hf_galore_plugin.engines.fsdp1`; this name stays for the transformers integration."""

from ..engines.fsdp1 import check_fsdp1_layers, fsdp1_units, group_by_unit, had_gradient, summon_unit

__all__ = ["fsdp1_units", "summon_unit", "group_by_unit", "had_gradient", "check_fsdp1_layers"]
