"""The GaLore linear layer, one module per level (docs/architecture.md, "Layers"):

- :mod:`.storage`: :class:`StoredTensor`, one possibly-quantized tensor of a layer held in its buffers;
- :mod:`.function`: the forward of one step (`galore_linear`; autograd derives the backward);
- :mod:`.schedule`: when a layer refreshes (refresh-due rule, staggered phases and their packing);
- :mod:`.counters`: a layer's counters, their host copies and its step clock, in one object;
- :mod:`.rank`: a layer's own rank under ``rank_allocation='auto'``;
- :mod:`.refresh`: what a refresh step records, and the refresh (basis, fold, lazy gap, change of basis);
- :mod:`.weights`: W0, the bases, the factor and alpha of a layer (the ``nn.Module`` every kind builds on);
- :mod:`.base`: :class:`~.base.GaLoreLayerBase`, the counters and the refresh's plumbing shared by the kinds;
- :mod:`.linear`: :class:`GaLoreLinear`, the layer that replaces an ``nn.Linear``;
- :mod:`.expert_refresh`, :mod:`.experts`: the expert stacks of mixture-of-experts models and their refresh.
"""

from .function import WrittenOutLinear, galore_linear
from .linear import GaLoreLinear
from .schedule import assign_refresh_phases, pack_refresh_phases, refresh_phase_capacity
from .storage import StoredTensor

__all__ = [
    "GaLoreLinear",
    "WrittenOutLinear",
    "galore_linear",
    "StoredTensor",
    "assign_refresh_phases",
    "pack_refresh_phases",
    "refresh_phase_capacity",
]
