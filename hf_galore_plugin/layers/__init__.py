"""The GaLore linear layer, one module per level (docs/architecture.md, "Layers"):

- :mod:`.storage`: :class:`StoredTensor`, one possibly-quantized tensor of a layer held in its buffers;
- :mod:`.function`: the autograd function and the low-rank matmuls (the per-step code);
- :mod:`.schedule`: when a layer refreshes (refresh-due rule, staggered phases and their packing);
- :mod:`.refresh`: what a refresh step records, and the refresh (basis, fold, lazy gap, moments);
- :mod:`.linear`: :class:`GaLoreLinear`, the ``nn.Module`` tying them together.
"""

from .function import GaLoreLinearFunction
from .linear import GaLoreLinear
from .schedule import assign_refresh_phases, pack_refresh_phases, refresh_phase_capacity
from .storage import StoredTensor

__all__ = [
    "GaLoreLinear",
    "GaLoreLinearFunction",
    "StoredTensor",
    "assign_refresh_phases",
    "pack_refresh_phases",
    "refresh_phase_capacity",
]
