"""Engines: how GaLore layers run under each parallel engine, below the public API.

- :mod:`.contract`: what a refresh needs from the optimizer and from the engine (``typing.Protocol``\\ s,
  and the functions that apply them with their defaults); the layers depend on this, not on an engine.
- :mod:`.basis`: a refresh's change of basis as the optimizer receives it (transport matrices, policy,
  experts) and the rules by which state tensors in torch's layout follow it.
- :mod:`.capabilities`: what each engine (single process, DDP, FSDP1, FSDP2, ZeRO-1/2/3) supports, and
  the one place that refuses what it does not.
- :mod:`.collectives`: DTensor and ``torch.distributed`` helpers.
- :mod:`.fragments`: which elements of which matrix an engine's 1-D slice holds (FSDP1, ZeRO), and the
  collectives over them, for optimizers that step a matrix's rows and columns (Muon, Adafactor).
- :mod:`.fsdp1`: FSDP1 (``use_orig_params=True``) unit lookup, gathering and fragment registration.
- :mod:`.deepspeed`: the DeepSpeed ZeRO adapter and its fragment registration (needs the ``[deepspeed]`` extra).

Nothing here imports the layers, the API or the integrations.
"""

from .capabilities import CAPABILITIES, ENGINES, EngineCapabilities, UnsupportedByEngine, check_moment_handling
from .contract import EngineAdapter, StateOptimizer

__all__ = [
    "CAPABILITIES",
    "ENGINES",
    "EngineCapabilities",
    "UnsupportedByEngine",
    "check_moment_handling",
    "EngineAdapter",
    "StateOptimizer",
]
