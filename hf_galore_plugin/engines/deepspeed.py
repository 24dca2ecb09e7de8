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

Inner optimizers that work on a factor's rows and columns (``galore_muon``, ``galore_adafactor``) run under
every ZeRO stage: ZeRO hands the client optimizer one flat fp32 partition per parameter group (ZeRO-3: per
sub-group), cut across parameter boundaries, and :class:`DeepSpeedGaLoreOptimizer` registers on each of them
the fragments of every parameter it holds (:func:`register_zero_fragments`, :mod:`.fragments`), so that Muon
gathers the matrix it orthogonalises and Adafactor sums its row and column statistics over the ranks. The
adapter must be built (it registers) before the engine's first step; DeepSpeed's checkpoints hold the client
optimizer's own state dict, and load into the same flats. DeepSpeed's own Muon (its config's "optimizer"
block, parameters tagged ``use_muon``) is refused next to this package's.

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
from .fragments import Fragment, fragments_of, set_fragments

__all__ = [
    "DeepSpeedGaLoreOptimizer",
    "is_zero3_partitioned",
    "zero3_gathered",
    "import_deepspeed",
    "register_zero_fragments",
]


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


def register_zero_fragments(
    zero_optimizer: Any, model: nn.Module
) -> Optional[list[tuple[torch.Tensor, list[torch.Tensor]]]]:
    """Register on every flat fp32 partition that ZeRO's client optimizer steps the
    :class:`~.fragments.Fragment` of each parameter it holds part of (:func:`~.fragments.set_fragments`), in the
    parameter group's order, which every rank shares; returns each flat with its parameters, in that order.

    Every group, not only the GaLore factors': an optimizer whose rule is per matrix or per tensor (Adafactor's
    factored second moment and update clipping, on the other parameters too) steps each parameter of a flat
    as its own fragment. ZeRO-1/2 (and DeepSpeed's BF16 optimizer, which runs ZeRO-1 with bf16 weights): one
    flat per group, the group's parameters end to end (with alignment padding between them and after the last),
    cut into equal partitions; DeepSpeed records each parameter's part of the partition in ``param._hp_mapping``:
    the elements [lp start, lp start + numel) of the parameter, at hp start in the flat, None where the rank
    holds none. Every parameter of the group is registered on its flat, also one this rank holds nothing of.
    ZeRO-3 cuts each parameter on its own (rank r holds elements [r p, (r + 1) p) of a partition size p, the
    last rank's part padded) and steps a group as sub-groups, each one flat of its parameters' parts end to end
    (``grad_position``): each parameter is registered on its sub-group's flat. The flats are the same tensors
    for the whole run (checkpoint loads copy into them), so the registration lasts as long as the engine. None
    (nothing registered) for a DeepSpeed optimizer of another layout.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    registered: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    if hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3
        for sub, members in enumerate(zero_optimizer.fp16_groups):
            flat = zero_optimizer.fp32_partitioned_groups_flat[sub]
            fragments = []
            for param in members:
                size, numel = int(param.partition_numel()), int(param.ds_numel)
                start = min(zero_optimizer._get_param_partition_rank(param) * size, numel)
                offset = int(zero_optimizer.grad_position[zero_optimizer.get_param_id(param)][1])
                name = names.get(id(param), "")
                if offset + size > flat.numel():
                    raise RuntimeError(
                        f"ZeRO-3 places parameter {name!r} at {offset} (+{size}) in a flat partition of "
                        f"{flat.numel()} elements; this DeepSpeed version lays out its partitions otherwise"
                    )
                process_group = zero_optimizer._get_param_partition_group(param)
                fragments.append(
                    Fragment(torch.Size(param.ds_shape), start, min(start + size, numel), offset, process_group, name)
                )
            set_fragments(flat, fragments)
            registered.append((flat, list(members)))
        return registered
    client = getattr(zero_optimizer, "optimizer", zero_optimizer)
    # The trainable parameters of each group in its order (ZeRO-1/2; the BF16 optimizer's name for them)
    lp_groups = getattr(zero_optimizer, "bit16_groups", None) or getattr(zero_optimizer, "bf16_groups", None)
    if lp_groups is None:
        return None  # not a layout this function knows
    if len(lp_groups) != len(client.param_groups):
        raise RuntimeError(
            f"{type(zero_optimizer).__name__} holds {len(lp_groups)} parameter groups, its client optimizer "
            f"{len(client.param_groups)}: not supported by GaLore under ZeRO"
        )
    for group, members in zip(client.param_groups, lp_groups):
        if len(group["params"]) != 1:
            raise RuntimeError(
                f"ZeRO hands the client optimizer one flat partition per parameter group; a group holds "
                f"{len(group['params'])} tensors instead: this DeepSpeed optimizer is not supported"
            )
        flat = group["params"][0]
        fragments = []
        for param in members:
            name = names.get(id(param), "")
            if not hasattr(param, "_hp_mapping"):
                raise RuntimeError(
                    f"DeepSpeed did not map parameter {name!r} into its flat partition (no _hp_mapping): this "
                    "DeepSpeed optimizer is not supported"
                )
            mapping, shape = param._hp_mapping, torch.Size(param.shape)
            process_group = getattr(param, "_dp_group", None)
            if mapping is None:  # none of its elements on this rank
                fragments.append(Fragment(shape, 0, 0, 0, process_group, name))
                continue
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            if mapping.hp_fragment.data_ptr() != flat.data_ptr() + int(hp.start) * flat.element_size():
                raise RuntimeError(
                    f"DeepSpeed maps parameter {name!r} outside the flat partition its group steps: this DeepSpeed "
                    "optimizer is not supported"
                )
            start = int(lp.start)
            fragments.append(Fragment(shape, start, start + int(lp.numel), int(hp.start), process_group, name))
        set_fragments(flat, fragments)
        registered.append((flat, list(members)))
    return registered


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
    is refused for 8-bit ones, which share blocks with other factors inside the flat partition. Muon keeps
    no step count on the factors, so its partial resets are one process's exactly; Adafactor keeps row and
    column statistics per factor and one step count per flat, so a staggered reset refresh (or a reset of
    some experts) is refused for it at construction, and a staggered first calibration runs with the shared
    step count as AdamW's does.
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
        stacks = any(
            len(getattr(f, "ds_shape", f.shape)) == 3 for f in (m.galore_factor for m in self._layers.values())
        )
        if (
            config.moment_handling == "reset"
            and (pending or any(phases) or stacks)
            and not _resets_fragments(self.optimizer)
        ):
            # A staggered reset refresh (or a reset of some experts of a stack) restarts one factor inside a flat
            # partition, many steps into the run: Adafactor keeps its row and column statistics per matrix and
            # one step count per flat, so one matrix inside a flat cannot restart alone.
            raise NotImplementedError(
                f"moment_handling='reset' with refresh_schedule={config.refresh_schedule!r}"
                f"{' and expert layers' if stacks else ''} under DeepSpeed ZeRO with "
                f"inner_optimizer={config.inner_optimizer!r}: a refresh would restart one factor's "
                f"{type(self.optimizer).__name__} statistics inside a ZeRO flat partition, which this optimizer "
                "cannot do; use moment_handling='keep', refresh_schedule='aligned' (without expert layers), or "
                "galore_adamw / galore_muon"
            )
        _check_not_deepspeed_muon(model, self.optimizer)
        # Every flat partition with the parameters whose fragments it holds (registered on it, in the order every
        # rank shares), so that an optimizer stepping a matrix's rows and columns finds them.
        registered = register_zero_fragments(self.zero_optimizer, model)
        if registered is None and config.inner_optimizer != "adamw":
            raise NotImplementedError(
                f"inner_optimizer={config.inner_optimizer!r} under DeepSpeed ZeRO: the engine's optimizer "
                f"{type(self.zero_optimizer).__name__} lays out its flat partitions in a way GaLore does not know, "
                "so the optimizer cannot find the factors' rows and columns; use galore_adamw, or DeepSpeed's "
                "ZeRO-1/2/3 optimizers"
            )
        self.registered_flats = registered or []
        self._factors_of = {id(flat): factors for flat, factors in self.registered_flats}
        self._pending_resets: set[int] = set()
        # An optimizer without a step count on its factor groups (Muon: `factor_step_count = False`): a reset of
        # some factors of a flat restarts them exactly.
        self._no_step_count = not getattr(self.optimizer, "factor_step_count", True)
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
        self._relink_state()
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
        # group; ZeRO-3: one sub-group's flat, the other groups' "params" empty), so resets apply when the flat
        # that holds their factor steps.
        if not self._pending_resets:
            return
        for group in optimizer.param_groups:
            if not group.get("galore"):
                continue
            for flat in group["params"]:
                factors = self._factors_of.get(id(flat))
                if factors is None:
                    # Flats without fragments (a DeepSpeed optimizer of another layout, galore_adamw only): one flat
                    # per group, its factors named by "galore_layers" (api.galore_param_groups).
                    names = group.get("galore_layers") or []
                    factors = [self.model.get_submodule(name).galore_factor for name in names]
                pending = [i for i, factor in enumerate(factors) if id(factor) in self._pending_resets]
                if not pending:
                    continue
                if len(pending) == len(factors):
                    self._reset_flat(flat)
                else:
                    for index in pending:
                        self._reset_fragment(flat, index, factors[index])
                for index in pending:
                    self._pending_resets.discard(id(factors[index]))
                    self._first_calibrations.discard(id(factors[index]))

    def _reset_flat(self, flat: torch.Tensor) -> None:
        """Every factor of `flat` restarts: its whole state is the client optimizer's fresh state, exactly."""
        state = self.optimizer.state.get(flat)
        if not state:
            return
        if all(isinstance(value, torch.Tensor) for value in state.values()):
            # In place, not a fresh dict: DeepSpeed links views of these tensors (hp fragments) for its
            # checkpoints. All-zero state (step 0, zero moments / zero codes and scales) is AdamW's and Muon's
            # fresh state.
            _zero_state(state)
            return
        # Other values (Adafactor's step count and per-matrix statistics): the client's own reset, whose next step
        # is a first step; ZeRO-1/2 link their views of the state again after that step.
        reset = getattr(self.optimizer, "reset_state", None)
        if reset is None:
            raise NotImplementedError(
                f"{type(self.optimizer).__name__} keeps optimizer state other than tensors and has no reset_state: "
                "GaLore under ZeRO cannot restart it at a calibration"
            )
        reset(flat)
        if hasattr(self.zero_optimizer, "_hp_optimizer_states_linked"):
            self.zero_optimizer._hp_optimizer_states_linked = False

    def _reset_fragment(self, flat: torch.Tensor, index: int, param: torch.Tensor) -> None:
        """Some factors of `flat` restart, this one (its `index`-th fragment) among them."""
        fragments = fragments_of(flat)
        if not self._no_step_count:
            self._warn_partial_reset()
        if id(param) in self._first_calibrations:
            return
        if fragments is None:
            self._zero_moments_of(param)
            return
        state = self.optimizer.state.get(flat)
        if not state:
            return  # not stepped yet: nothing to zero
        # The client's elementwise state (tensors of the flat's shape, by its state rules: AdamW's moments, Muon's
        # momentum) at this rank's elements of the factor, in place: no collective, and none of DeepSpeed's links
        # of the state, which ZeRO-1/2 make for the groups of the step under way only.
        for key in state_rules(self.optimizer):
            value = state.get(key)
            if not (isinstance(value, torch.Tensor) and value.shape == flat.shape):
                raise NotImplementedError(
                    f"cannot reset the {type(self.optimizer).__name__} state of one factor inside a ZeRO flat "
                    f"partition ({key!r} is not an elementwise tensor: 8-bit state, or per-matrix statistics); use "
                    "state_bits=32, or moment_handling='keep'"
                )
            fragments[index].local(value).zero_()

    def _zero_moments_of(self, param: torch.Tensor) -> None:
        utils = import_deepspeed("DeepSpeedGaLoreOptimizer").utils
        safe_get_full_optimizer_state, safe_set_full_optimizer_state = (
            utils.safe_get_full_optimizer_state,
            utils.safe_set_full_optimizer_state,
        )

        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3: the whole factor's, not the partition's
        for key in state_rules(self.optimizer):
            if safe_get_full_optimizer_state(param, key) is None:
                raise NotImplementedError(
                    f"cannot reset the 8-bit optimizer state of one factor inside a ZeRO flat partition (no {key!r}); "
                    "use state_bits=32, or moment_handling='keep'"
                )
            safe_set_full_optimizer_state(param, torch.zeros(shape, dtype=torch.float32), key)

    def _warn_partial_reset(self) -> None:
        if not self._warned_partial:
            warnings.warn(
                "GaLore under ZeRO: resetting the moments of some factors of a parameter group (staggered "
                "calibration or refresh); the group's shared step counter (Adam's bias correction, Adafactor's "
                "decay schedule) is not reset, so their first updates differ from a single process's",
                stacklevel=4,
            )
            self._warned_partial = True

    def _relink_state(self) -> None:
        relink = getattr(self.zero_optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if self.zero_stage in (1, 2) and relink is not None:
            # ZeRO-1/2 link each parameter's view of the optimizer state once, after the first step, to the
            # state that exists then (measured: a factor's view was missing at a later refresh, "exp_avg not
            # found in optimizer state fragment"). Linking again covers every state that exists now.
            self.zero_optimizer._hp_optimizer_states_linked = False
            relink()


def _resets_fragments(client: Any) -> bool:
    """Whether `client` can restart one factor inside a ZeRO flat partition by zeroing the factor's elements of
    state tensors of the flat's shape (by its state rules), as AdamW's moments and Muon's momentum are;
    Adafactor's per-matrix statistics are not such tensors (an optimizer says so with `elementwise_state =
    False`)."""
    return bool(getattr(client, "elementwise_state", True))


def _check_not_deepspeed_muon(model: nn.Module, client: Any) -> None:
    """DeepSpeed's own Muon (ZeRO-1/2) orthogonalises, while it partitions the gradients, those of the parameters
    it tagged ``use_muon`` (its config's "optimizer": {"type": "Muon"}) when the client optimizer's class name
    contains "muon": with this package's Muon as the client every such update would be orthogonalised twice."""
    if "muon" not in type(client).__name__.lower():
        return
    tagged = [name for name, p in model.named_parameters() if getattr(p, "use_muon", False)]
    if tagged:
        raise ValueError(
            f"parameters tagged use_muon=True ({', '.join(tagged[:3])}{', ...' if len(tagged) > 3 else ''}) under "
            "DeepSpeed with the GaLore Muon as the client optimizer: DeepSpeed would apply its own Muon to their "
            "gradients before this optimizer's. Remove the 'optimizer' block (type Muon) from the DeepSpeed config "
            "and leave use_muon unset (galore_muon orthogonalises the GaLore factors itself)"
        )


def _zero_state(state: dict[str, Any] | None) -> None:
    # In place, not a fresh dict: DeepSpeed links views of these tensors (hp fragments) for its
    # checkpoints. All-zero state (step 0, zero moments / zero codes and scales) is AdamW's fresh state.
    for value in (state or {}).values():
        if isinstance(value, torch.Tensor):
            value.zero_()
