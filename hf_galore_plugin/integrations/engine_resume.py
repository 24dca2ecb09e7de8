"""Engine-specific resume: what DeepSpeed's and FSDP1's own checkpoint loads need besides the Trainer's.

- DeepSpeed loads its engine checkpoint in ``transformers.trainer.deepspeed_load_checkpoint``; ZeRO-3
  does not restore frozen parameters such as W0, which refreshes change, so ``galore_state.pt`` is
  loaded after it, on every rank.
- FSDP's checkpoint is the engine's own (distributed checkpoint) and holds the layers' own tensors, not
  merged weights: ``galore_state.pt`` is loaded shard by shard after it.
- FSDP1's optimizer load fills the structure of the current optimizer's state, which is empty before
  the first step: the optimizer gets zero state first.
"""

from __future__ import annotations

import functools
from contextvars import ContextVar
from typing import Any, Callable, Optional

from ..checkpoint.state import apply_mutable_changes, read_checkpoint_state
from ..registry import LAYERWISE_ALIASES
from ..engines.contract import unwrap_optimizer
from ..state import state_of
from .distributed import load_gathered_galore_state_dict
from .names import trainer_optimizer_name
from .patching import mark

__all__ = [
    "LOAD_ADVICE",
    "load_fsdp_galore_state",
    "wrap_load_optimizer_and_scheduler",
    "wrap_deepspeed_load_checkpoint",
]

# What a refused checkpoint's message tells the user to do. None: a resume's advice (the checks' own);
# a load for another purpose sets its own around the Trainer's load (``load_best_model_at_end``:
# :func:`hf_galore_plugin.integrations.loading.wrap_load_best_model`), which reaches the engines' load
# paths here through transformers' code.
LOAD_ADVICE: ContextVar[Optional[str]] = ContextVar("hf_galore_plugin_load_advice", default=None)


def load_fsdp_galore_state(trainer: Any, prepared: Any, load: Callable[[], Any], folder: str) -> Any:
    """Run `load` (the Trainer's load of FSDP checkpoint `folder`), then load its ``galore_state.pt`` into
    the sharded GaLore layers of `prepared` (every rank)."""
    result = load()
    root = getattr(trainer, "model_wrapped", None) or trainer.model
    payload = read_checkpoint_state(
        folder,
        prepared,
        trainer_optimizer_name(trainer),
        optimizer_aliases=LAYERWISE_ALIASES,
        advice=LOAD_ADVICE.get(),
    )
    load_gathered_galore_state_dict(prepared, payload["state"], root=root)  # every rank
    apply_mutable_changes(prepared, payload["changed"], where=f"checkpoint {folder}")
    return result


def _is_fsdp1(trainer: Any) -> bool:
    if not getattr(trainer, "is_fsdp_enabled", False):
        return False
    plugin = getattr(getattr(trainer.accelerator, "state", None), "fsdp_plugin", None)
    return getattr(plugin, "fsdp_version", 1) == 1


def wrap_load_optimizer_and_scheduler(original: Callable) -> Callable:
    """FSDP1 sharded checkpoints: accelerate's load_fsdp_optimizer reads the saved state into the
    structure of the current optimizer's FSDP.optim_state_dict, which is empty for an optimizer that has
    not stepped yet, so a resume silently restarts the Adam moments (torch's AdamW too, accelerate 1.x /
    torch 2.13). Our optimizer first gets zero state for every parameter so there is something to fill."""

    @functools.wraps(original)
    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None and _is_fsdp1(self):
            optimizer = unwrap_optimizer(self.optimizer)
            if hasattr(optimizer, "initialize_state"):
                optimizer.initialize_state()
        return original(self, checkpoint)

    return mark(_load_optimizer_and_scheduler)


def wrap_deepspeed_load_checkpoint(original: Callable) -> Callable:
    """After the engine loaded its checkpoint (ZeRO partitions, fp32 masters, optimizer state), restore
    the GaLore layers from ``galore_state.pt``: ZeRO-3 does not restore frozen parameters such as W0,
    which refreshes change."""

    @functools.wraps(original)
    def deepspeed_load_checkpoint(deepspeed_engine, checkpoint_path, *args, **kwargs):
        result = original(deepspeed_engine, checkpoint_path, *args, **kwargs)
        state = state_of(deepspeed_engine.module)
        if state is not None:
            prepared = state.model
            payload = read_checkpoint_state(checkpoint_path, prepared, advice=LOAD_ADVICE.get())
            load_gathered_galore_state_dict(prepared, payload["state"])  # every rank
            apply_mutable_changes(prepared, payload["changed"], where=f"checkpoint {checkpoint_path}")
        return result

    return mark(deepspeed_load_checkpoint)
