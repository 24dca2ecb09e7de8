"""DeepSpeed ZeRO as a GaLore engine: the adapter a refresh talks to, and ZeRO-3 gathering.

A refresh folds the factor B into W0 and restarts B at zero. ZeRO keeps its own fp32 master
partition of every trainable parameter and copies it back into the model after each step, so a
zeroed B in the model alone would be overwritten by the stale master (the fold would then count
B twice). :class:`DeepSpeedGaLoreOptimizer` is what the layers talk to instead of the bare
optimizer (an :class:`~hf_galore_plugin.engines.contract.EngineAdapter`): it writes the folded
factor into the master copy and resets optimizer state on ZeRO's flat partitions.

    engine, *_ = deepspeed.initialize(model=model, optimizer=create_optimizer(model, lr=...), config=...)
    galore_optimizer = DeepSpeedGaLoreOptimizer(engine)
    ...
    engine.backward(loss); engine.step()
    if <gradient-accumulation boundary>:
        after_step(model, galore_optimizer)

Needs the ``[deepspeed]`` extra; nothing here imports deepspeed before a ZeRO parameter or engine is
in hand.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterable, Optional

import torch
from torch import nn

from ..state import state_of
from ..utils import require
from .basis import BasisChange, state_rules
from .capabilities import check_moment_handling, check_residual, check_state_offload

__all__ = ["DeepSpeedGaLoreOptimizer", "is_zero3_partitioned", "zero3_gathered", "import_deepspeed"]


def import_deepspeed(feature: str):
    """``import deepspeed``, or an ImportError naming the ``[deepspeed]`` extra that `feature` needs."""
    require("deepspeed", feature=feature)
    import deepspeed

    return deepspeed


def is_zero3_partitioned(module: nn.Module) -> bool:
    """True when DeepSpeed ZeRO-3 manages `module`'s parameters (``ds_id`` is set by zero.Init / the engine)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def zero3_gathered(params: Iterable[Any], *, modifier_rank: Optional[int] = None):
    """Context in which the ZeRO-3 parameters among `params` are whole (a collective: every rank enters).

    With ``modifier_rank=0`` rank 0's values are partitioned again on exit (changes of the other
    ranks are dropped); with None every change is dropped. A no-op for parameters ZeRO-3 does not own.
    """
    partitioned = [p for p in params if p is not None and hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    deepspeed = import_deepspeed("gathering ZeRO-3 parameters")
    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)


class DeepSpeedGaLoreOptimizer:
    """The optimizer protocol GaLore layers use (``param_changed``, ``change_basis``), for a DeepSpeed engine.

    Supported: ZeRO stages 1, 2 and 3, fp32 / bf16 / fp16 (the master copy is updated with
    ``deepspeed.utils.safe_set_full_fp32_param``). ZeRO-3 partitions W0 and B themselves: a refresh
    gathers the two parameters of that one layer (``gathered_parameters``) and partitions them again.

    Optimizer-state resets (the calibration refresh, ``moment_handling='reset'``) are applied just
    before the engine's next optimizer step. ZeRO steps a whole group as one flat partition with
    one step counter: when every factor of a group is reset together (the aligned schedule's
    calibration of all layers) the whole state restarts exactly as in one process; when only some
    are (the staggered schedule's calibrations, a lazy or staggered ``moment_handling='reset'``),
    their moments restart at zero and the shared step counter (Adam's bias correction) keeps running.
    A first calibration has nothing to zero (below); any other partial reset zeroes fp32 moments and
    is refused for 8-bit ones, which share blocks with other factors inside the flat partition.
    """

    def __init__(self, engine: Any) -> None:
        self.zero_stage = engine.zero_optimization_stage()
        if self.zero_stage not in (1, 2, 3):
            raise NotImplementedError(
                f"DeepSpeedGaLoreOptimizer needs ZeRO stage 1, 2 or 3 (got {self.zero_stage}); without ZeRO pass "
                "the engine's optimizer to after_step directly"
            )
        model = engine.module
        state = state_of(model)
        if state is None:
            raise ValueError("the engine's model has no GaLore layers: call prepare_model(model, config) first")
        config = state.config
        check_moment_handling(f"zero{self.zero_stage}", moment_handling=config.moment_handling)
        check_state_offload(f"zero{self.zero_stage}", state_offload=config.state_offload)
        check_residual(f"zero{self.zero_stage}", residual=config.residual)
        self._layers = {
            id(m.galore_factor): m
            for m in model.modules()
            if isinstance(getattr(m, "galore_factor", None), torch.Tensor)
        }
        phases = [int(m.galore_phase) for m in self._layers.values()]
        pending = any(getattr(m, "pending_phase_packing", None) is not None for m in self._layers.values())
        if config.state_bits == 8 and config.moment_handling == "reset" and (pending or any(p > 0 for p in phases)):
            # Checked here rather than at the first staggered refresh, many steps into the run; phases still to be
            # packed at the first forward may spread the layers.
            raise NotImplementedError(
                "moment_handling='reset' with refresh_schedule='staggered' under DeepSpeed ZeRO with 8-bit state: a "
                "refresh would reset one factor's 8-bit moments inside a ZeRO flat partition, which is not supported; "
                "use moment_handling='keep', refresh_schedule='aligned' or state_bits=32"
            )
        self.engine = engine
        self.model = model
        self.zero_optimizer = engine.optimizer
        self.optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the client optimizer
        self._pending_resets: set[int] = set()
        self._first_calibrations: set[int] = set()
        self._warned_partial = False
        self.optimizer.register_step_pre_hook(self._apply_pending_resets)

    # ------------------------------------------------------------------ EngineAdapter / StateOptimizer (engines.contract)
    def gathered_parameters(self, layer: torch.nn.Module):
        """Context in which `layer`'s parameters are whole on every rank (ZeRO-3); rank 0's result is kept."""
        # Every rank computes the same fold from the same all-reduced gradient; modifier_rank=0 makes
        # DeepSpeed re-partition rank 0's copy on exit.
        return zero3_gathered((layer.weight, layer.galore_factor), modifier_rank=0)

    def param_changed(self, param: torch.Tensor) -> None:
        """The layer changed `param` in the model (in place): make the engine's fp32 master follow."""
        safe_set_full_fp32_param = import_deepspeed("DeepSpeedGaLoreOptimizer").utils.safe_set_full_fp32_param

        safe_set_full_fp32_param(param, param.detach().float())

    def reset_state(self, param: torch.Tensor) -> None:
        """Forget `param`'s optimizer state, at the engine's next optimizer step."""
        self._pending_resets.add(id(param))
        layer = self._layers.get(id(param))
        if layer is not None and not layer.calibrated:
            # A first calibration (the refresh counts itself only after this reset): the layer's basis was
            # zero until now, so its factor only ever had zero gradients and its Adam moments are exactly
            # zero (in fp32, and as 8-bit codes of the code book's exact zero), whatever shares its blocks.
            self._first_calibrations.add(id(param))

    def change_basis(
        self,
        param: torch.Tensor,
        *,
        left: Optional[torch.Tensor] = None,
        right: Optional[torch.Tensor] = None,
        policy: str,
        experts: Optional[torch.Tensor] = None,
    ) -> None:
        """`param`'s basis changed (:mod:`.basis`): a reset of the whole state is :meth:`reset_state`; a reset
        of some experts (moment_handling='reset' when some experts kept their basis) and a projection change the
        client optimizer's fp32 state in ZeRO's partitions, at once (a collective: every rank calls it), key by
        key by the client optimizer's state rules. moment_handling='project' is refused at construction."""
        change = BasisChange(policy=policy, left=left, right=right, experts=experts).for_state(
            lambda: self.reset_state(param)
        )
        if change is None:
            return
        rules = state_rules(self.optimizer)
        values = self._full_state(param, list(rules))
        changed = [change.apply(value, rule, param) for value, rule in zip(values, rules.values())]
        self._set_full_state(param, dict(zip(rules, changed)))

    def transform_state(self, param: torch.Tensor, fn: Any) -> None:
        """Replace `param`'s fp32 Adam moments by ``fn(exp_avg, exp_avg_sq)`` in ZeRO's partitions, at once (a
        collective: every rank calls it)."""
        exp_avg, exp_avg_sq = fn(*self._full_state(param, ["exp_avg", "exp_avg_sq"]))
        self._set_full_state(param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})

    def _full_state(self, param: torch.Tensor, keys: list[str]) -> list[torch.Tensor]:
        """`param`'s whole fp32 state tensors under `keys`, read from ZeRO's partitions (a collective)."""
        utils = import_deepspeed("DeepSpeedGaLoreOptimizer").utils
        relink = getattr(self.zero_optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if self.zero_stage in (1, 2) and relink is not None:
            # ZeRO-1/2 link each parameter's view of the optimizer state once, after the first step, to the
            # state that exists then (measured: a factor's view was missing at a later refresh, "exp_avg not
            # found in optimizer state fragment"). Linking again covers every state that exists now.
            self.zero_optimizer._hp_optimizer_states_linked = False
            relink()
        values = [utils.safe_get_full_optimizer_state(param, key) for key in keys]
        if any(value is None for value in values):
            raise NotImplementedError(
                "cannot transform the 8-bit optimizer state of one factor inside a ZeRO flat partition; use "
                "state_bits=32, or moment_handling='keep'"
            )
        return [value.float() for value in values]

    def _set_full_state(self, param: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        utils = import_deepspeed("DeepSpeedGaLoreOptimizer").utils
        for key, value in values.items():
            utils.safe_set_full_optimizer_state(param, value, key)

    # ------------------------------------------------------------------ internals
    def _apply_pending_resets(self, optimizer, args, kwargs) -> None:
        # ZeRO steps the client optimizer one group at a time (ZeRO-1/2: param_groups holds just that
        # group; ZeRO-3: the other groups' "params" are empty), so resets apply when their group steps.
        if not self._pending_resets:
            return
        for group in optimizer.param_groups:
            names = group.get("galore_layers")
            if not group.get("galore") or not names or not group["params"]:
                continue
            # "galore_layers" holds the module names of the group's layers (api.galore_param_groups).
            factors = [self.model.get_submodule(n).galore_factor for n in names]
            pending = [f for f in factors if id(f) in self._pending_resets]
            if not pending:
                continue
            if len(pending) == len(names):
                for flat in group["params"]:
                    _zero_state(optimizer.state.get(flat))
            else:
                self._warn_partial_reset()
                for param in pending:
                    if id(param) not in self._first_calibrations:
                        self._zero_moments_of(param)
            for param in pending:
                self._pending_resets.discard(id(param))
                self._first_calibrations.discard(id(param))

    def _warn_partial_reset(self) -> None:
        if not self._warned_partial:
            warnings.warn(
                "GaLore under ZeRO: resetting the moments of some factors of a parameter group (staggered "
                "calibration or refresh); the group's shared step counter (Adam bias correction) is not reset, so "
                "their first updates differ from a single process's",
                stacklevel=3,
            )
            self._warned_partial = True

    def _zero_moments_of(self, param: torch.Tensor) -> None:
        utils = import_deepspeed("DeepSpeedGaLoreOptimizer").utils
        safe_get_full_optimizer_state, safe_set_full_optimizer_state = (
            utils.safe_get_full_optimizer_state,
            utils.safe_set_full_optimizer_state,
        )

        for key in state_rules(self.optimizer):
            if safe_get_full_optimizer_state(param, key) is None:
                raise NotImplementedError(
                    f"cannot reset the 8-bit optimizer state of one factor inside a ZeRO flat partition (no {key!r}); "
                    "use state_bits=32, or moment_handling='keep'"
                )
            safe_set_full_optimizer_state(param, torch.zeros(param.shape, dtype=torch.float32), key)


def _zero_state(state: dict[str, Any] | None) -> None:
    # In place, not a fresh dict: DeepSpeed links views of these tensors (hp fragments) for its
    # checkpoints. All-zero state (step 0, zero moments / zero codes and scales) is AdamW's fresh state.
    for value in (state or {}).values():
        if isinstance(value, torch.Tensor):
            value.zero_()
