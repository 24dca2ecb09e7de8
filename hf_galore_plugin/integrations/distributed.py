"""Engine-specific glue for GaLore layers under DeepSpeed ZeRO (FSDP2 and DDP need none).

A refresh folds the factor B into W0 and restarts B at zero. ZeRO keeps its own fp32 master
partition of every trainable parameter and copies it back into the model after each step, so a
zeroed B in the model alone would be overwritten by the stale master (the fold would then count
B twice). :class:`DeepSpeedGaLoreOptimizer` is what the layers talk to instead of the bare
optimizer: it writes the folded factor into the master copy and resets optimizer state on ZeRO's
flat partitions.

    engine, *_ = deepspeed.initialize(model=model, optimizer=create_optimizer(model, lr=...), config=...)
    galore_optimizer = DeepSpeedGaLoreOptimizer(engine)
    ...
    engine.backward(loss); engine.step()
    if <gradient-accumulation boundary>:
        after_step(model, galore_optimizer)
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from ..inject import iter_galore_layers

__all__ = ["DeepSpeedGaLoreOptimizer"]


class DeepSpeedGaLoreOptimizer:
    """The optimizer protocol GaLore layers use (``param_changed``, ``reset_state``), for a DeepSpeed engine.

    Supported: ZeRO stages 1, 2 and 3, fp32 / bf16 / fp16 (the master copy is updated with
    ``deepspeed.utils.safe_set_full_fp32_param``). ZeRO-3 partitions W0 and B themselves: a refresh
    gathers the two parameters of that one layer (``gathered_parameters``) and partitions them again.

    Optimizer-state resets (the calibration refresh, ``moment_handling='reset'``) are applied just
    before the engine's next optimizer step. ZeRO steps a whole group as one flat partition with
    one step counter: when every factor of a group is reset together (the calibration step of all
    layers) the whole state restarts exactly as in one process; when only some are, their fp32
    moments are zeroed and the shared step counter (Adam's bias correction) keeps running.
    """

    def __init__(self, engine: Any) -> None:
        self.zero_stage = engine.zero_optimization_stage()
        if self.zero_stage not in (1, 2, 3):
            raise NotImplementedError(
                f"DeepSpeedGaLoreOptimizer needs ZeRO stage 1, 2 or 3 (got {self.zero_stage}); without ZeRO pass "
                "the engine's optimizer to after_step directly"
            )
        model = engine.module
        config = getattr(model, "galore_config", None)
        if config is None:
            raise ValueError("the engine's model has no GaLore layers: call prepare_model(model, config) first")
        if config.moment_handling == "project":
            raise NotImplementedError(
                "moment_handling='project' is not supported under DeepSpeed ZeRO (the moments of one factor are "
                "spread over flat partitions); use moment_handling='keep' or 'reset'"
            )
        self.engine = engine
        self.model = model
        self.zero_optimizer = engine.optimizer
        self.optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the client optimizer
        self._pending_resets: set[int] = set()
        self._warned_partial = False
        self.optimizer.register_step_pre_hook(self._apply_pending_resets)

    # ------------------------------------------------------------------ protocol used by GaLoreLinear
    def gathered_parameters(self, layer: torch.nn.Module):
        """Context in which `layer`'s parameters are whole on every rank (ZeRO-3); rank 0's result is kept."""
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        # Every rank computes the same fold from the same all-reduced gradient; modifier_rank=0 makes
        # DeepSpeed re-partition rank 0's copy on exit.
        params = [p for p in (layer.weight, layer.galore_factor) if p is not None]
        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)

    def param_changed(self, param: torch.Tensor) -> None:
        """The layer changed `param` in the model (in place): make the engine's fp32 master follow."""
        from deepspeed.utils import safe_set_full_fp32_param

        safe_set_full_fp32_param(param, param.detach().float())

    def reset_state(self, param: torch.Tensor) -> None:
        """Forget `param`'s optimizer state, at the engine's next optimizer step."""
        self._pending_resets.add(id(param))

    # ------------------------------------------------------------------ internals
    def _apply_pending_resets(self, optimizer, args, kwargs) -> None:
        # ZeRO steps the client optimizer one group at a time (ZeRO-1/2: param_groups holds just that
        # group; ZeRO-3: the other groups' "params" are empty), so resets apply when their group steps.
        if not self._pending_resets:
            return
        factors = {name: layer.galore_factor for name, layer in iter_galore_layers(self.model)}
        for group in optimizer.param_groups:
            names = group.get("galore_layers")
            if not group.get("galore") or not names or not group["params"]:
                continue
            pending = [factors[n] for n in names if id(factors[n]) in self._pending_resets]
            if not pending:
                continue
            if len(pending) == len(names):
                for flat in group["params"]:
                    _zero_state(optimizer.state.get(flat))
            else:
                for param in pending:
                    self._zero_moments_of(param)
            for param in pending:
                self._pending_resets.discard(id(param))

    def _zero_moments_of(self, param: torch.Tensor) -> None:
        from deepspeed.utils import safe_get_full_optimizer_state, safe_set_full_optimizer_state

        if not self._warned_partial:
            warnings.warn(
                "GaLore under ZeRO: resetting the moments of some factors of a parameter group; the group's "
                "shared step counter (Adam bias correction) is not reset",
                stacklevel=2,
            )
            self._warned_partial = True
        for key in ("exp_avg", "exp_avg_sq"):
            if safe_get_full_optimizer_state(param, key) is None:
                raise NotImplementedError(
                    f"cannot reset the 8-bit optimizer state of one factor inside a ZeRO flat partition (no {key!r}); "
                    "use state_bits=32, or moment_handling='keep' with all layers calibrated at the first step"
                )
            safe_set_full_optimizer_state(param, torch.zeros(param.shape, dtype=torch.float32), key)


def _zero_state(state: dict[str, Any] | None) -> None:
    # In place, not a fresh dict: DeepSpeed links views of these tensors (hp fragments) for its
    # checkpoints. All-zero state (step 0, zero moments / zero codes and scales) is AdamW's fresh state.
    for value in (state or {}).values():
        if isinstance(value, torch.Tensor):
            value.zero_()
