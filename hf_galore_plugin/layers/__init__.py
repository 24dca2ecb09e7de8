"""The GaLore linear layer, one module per level (docs/architecture.md, "Layers"):

- :mod:`.storage`: :class:`StoredTensor`, one possibly-quantized tensor of a layer held in its buffers;
- :mod:`.function`: the forward of one step (`galore_linear`; autograd derives the backward);
- :mod:`.schedule`: when a layer refreshes (refresh-due rule, staggered phases and their packing);
- :mod:`.refresh`: what a refresh step records, and the refresh (basis, fold, lazy gap, moments);
- :mod:`.linear`: :class:`GaLoreLinear`, the ``nn.Module`` tying them together.
"""

from .function import DequantizedBaseLinear, galore_linear
from .linear import GaLoreLinear
from .schedule import assign_refresh_phases, pack_refresh_phases, refresh_phase_capacity
from .storage import StoredTensor

__all__ = [
    "GaLoreLinear",
    "DequantizedBaseLinear",
    "galore_linear",
    "StoredTensor",
    "assign_refresh_phases",
    "pack_refresh_phases",
    "refresh_phase_capacity",
]
