"""Find the nn.Linear layers GaLore trains, replace them in place, and fold them back.

Targets are plain trainable ``nn.Linear`` layers only: never embeddings, norms, biases, frozen layers
(a QLoRA 4-bit base, a peft base layer), peft's LoRA adapter layers, or the output head by default.
``target_modules="all-linear"`` selects what transformers' ``optim_target_modules="all-linear"`` selects:
every ``nn.Linear`` whose weight is its own parameter, the untied output head included (a head tied to the
input embedding is left out, as transformers leaves it: its weight is named as the embedding's). A layer
a target pattern (or "all-linear") matched but that is not projected is named, with the reason, in the
summary line.
With ``GaLoreConfig.experts`` also the fused expert weights of mixture-of-experts models (3-D
parameters of transformers' ``*Experts`` modules whose layout :func:`expert_layout_problem` accepts),
replaced by :class:`~hf_galore_plugin.layers.experts.GaLoreExperts`; routers stay dense.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Sequence
from typing import Any, Callable, Optional, Protocol, TypeVar
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import GaLoreConfig
from .layers import GaLoreLinear
from .layers.experts import EXPERT_PROJECTIONS, GaLoreExperts
from .layers.linear import resolve_sides
from .layers.schedule import StepClock, assign_refresh_phases
from .loss import output_head

logger = logging.getLogger(__name__)

__all__ = [
    "TargetReport",
    "select_targets",
    "replace_targets",
    "unload",
    "iter_galore_layers",
    "swap_submodule",
    "plain_linear",
    "expert_parameters",
    "expert_layout_problem",
    "select_expert_targets",
    "ModuleBuilder",
    "build_in_place",
    "whole_shape",
    "whole_numel",
]

# peft names its adapter sub-modules lora_A / lora_B / lora_embedding_* / lora_magnitude_vector ...
_ADAPTER_NAME = re.compile(r"(^|\.)(lora_|ia3_|vera_|boft_|oft_)")
_HEAD_NAME = re.compile(r"(^|\.)lm_head$")


@dataclass
class TargetReport:
    """What target selection decided, for the log and for error messages."""

    targeted: list[str] = field(default_factory=list)
    targeted_params: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> reason
    skipped_params: int = 0
    matched_skipped: list[str] = field(default_factory=list)  # a target pattern matched, not projected

    # names listed per reason in the summary; the rest are counted (all of them: ``skipped``)
    MAX_NAMED = 8
    # Mixture-of-experts models: expert modules projected (GaLoreConfig.experts), and those left to plain
    # optimizer state with the reason; model_params is the model's parameter count (their share's base).
    experts: list[str] = field(default_factory=list)
    expert_params: int = 0
    expert_rank: int = 0
    unprojected_experts: dict[str, str] = field(default_factory=dict)
    unprojected_expert_params: int = 0
    model_params: int = 0
    # The GaLore scale each replaced layer got (module name, an expert stack's with its projection -> scale).
    layer_scales: dict[str, float] = field(default_factory=dict)

    def scale_summary(self) -> str:
        """Which scale the layers got: one value, or per value the layer kinds (last name part) and count."""
        by_scale: dict[float, list[str]] = {}
        for name, scale in self.layer_scales.items():
            by_scale.setdefault(scale, []).append(name.rsplit(".", 1)[-1])
        if len(by_scale) <= 1:
            return "".join(f"scale {scale:.4g}" for scale in by_scale)
        parts = []
        for scale, kinds in sorted(by_scale.items(), reverse=True):
            listed = ", ".join(dict.fromkeys(kinds))  # each kind once, in model order
            parts.append(f"{scale:.4g} ({listed}: {len(kinds)} layers)")
        return "scale per layer " + "; ".join(parts)

    def summary(self) -> str:
        reasons: dict[str, int] = {}
        for reason in self.skipped.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        why = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())) or "none"
        line = (
            f"GaLore targets {len(self.targeted)} nn.Linear layers ({self.targeted_params:,} weight parameters); "
            f"skipped {len(self.skipped)} ({self.skipped_params:,} parameters): {why}"
        )
        if self.layer_scales:
            line += f"; {self.scale_summary()}"
        if self.matched_skipped:
            by_reason: dict[str, list[str]] = {}
            for name in self.matched_skipped:
                by_reason.setdefault(self.skipped[name], []).append(name)
            named = []
            for reason, names in sorted(by_reason.items()):
                more = f" +{len(names) - self.MAX_NAMED} more" if len(names) > self.MAX_NAMED else ""
                named.append(f"{', '.join(names[: self.MAX_NAMED])}{more} ({reason})")
            line += f"; matched by target_modules but not projected: {'; '.join(named)}"
        if self.experts:
            line += (
                f"; experts: {len(self.experts)} expert modules ({self.expert_params:,} parameters) at "
                f"expert_rank {self.expert_rank}"
            )
        frozen = [name for name, reason in self.unprojected_experts.items() if reason == "frozen"]
        if frozen:
            # frozen experts (e.g. a peft model's base under expert LoRA) hold no optimizer state at all
            line += f"; {len(frozen)} frozen expert modules left as they are (not trained)"
        trained = {name: reason for name, reason in self.unprojected_experts.items() if reason != "frozen"}
        if trained:
            share = self.unprojected_expert_params / max(self.model_params, 1)
            kinds: dict[str, int] = {}
            for reason in trained.values():
                kinds[reason] = kinds.get(reason, 0) + 1
            because = ", ".join(f"{n} {r}" for r, n in sorted(kinds.items()))
            line += (
                f"; {len(trained)} expert modules ({self.unprojected_expert_params:,} parameters, "
                f"{share:.0%} of the model) are not projected and keep plain optimizer state ({because})"
            )
            if any(reason == "experts=False" for reason in self.unprojected_experts.values()):
                line += ": set experts=True (optim_args experts=true) to train them with GaLore"
        return line


def _output_head_names(model: nn.Module) -> set[str]:
    head = output_head(model)
    return {name for name, module in model.named_modules() if module is head or _HEAD_NAME.search(name)}


def _is_head(name: str, heads: set[str]) -> bool:
    # peft wraps a head listed in modules_to_save: its trainable copy `lm_head.modules_to_save.default`
    # is still the output head.
    return name in heads or any(name.startswith(head + ".") for head in heads)


def _matches(name: str, patterns) -> bool:
    # The rule of target_modules and exclude_modules, transformers' optim_target_modules': a string is a regex
    # matched with re.fullmatch, a list matches when one of its entries is a substring of the module name.
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(p in name for p in patterns)


_PATTERN_RULE = (
    "a string is a regex matched with re.fullmatch against the whole module name, a list holds substrings "
    "of module names"
)


def _no_match_hint(pattern: Any, names: list[str]) -> str:
    """The matching rule, and the pattern that matches where a string is only a part of module names."""
    hint = f"({_PATTERN_RULE}"
    if isinstance(pattern, str) and any(pattern in name for name in names):
        hint += (f"; {pattern!r} is part of names above: '.*{pattern}', or the list [{pattern!r}] (in optim_args "
                 f"'{pattern}+'), matches them")  # fmt: skip
    return hint + ")"


# The side(s) of a weight each proj_type projects (projection.resolve_sides), as the messages name them.
_PROJECTED_SIDE = {
    "std": "smaller side",
    "reverse_std": "larger side",
    "left": "output side",
    "right": "input side",
    "full": "both sides",
}


def _projection_limit(proj_type: str, rows: int, cols: int) -> int:
    """The rank from which a basis of `proj_type` projects nothing of a rows x cols weight: every side it keeps
    is covered whole, and the factor is the whole weight, trained at the GaLore scale with nothing saved."""
    left, right = resolve_sides(proj_type, rows, cols)
    return max(side for side, kept in ((rows, left), (cols, right)) if kept)


def _covered(proj_type: str, rank: int, rows: int, cols: int) -> str:
    """What a rank at or above :func:`_projection_limit` covers, for a message."""
    return "both sides" if rank >= max(rows, cols) else f"the {_PROJECTED_SIDE[proj_type]}"


def _unmatched_excludes(config: GaLoreConfig, names: list[str]) -> list[str]:
    """The patterns of ``config.exclude_modules`` (the regex, or each list entry) that match none of `names`."""
    exclude = config.exclude_modules
    if exclude is None:
        return []
    if isinstance(exclude, str):
        return [] if any(_matches(name, exclude) for name in names) else [exclude]
    return [entry for entry in exclude if not any(_matches(name, [entry]) for name in names)]


def _shared_parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> names of every module that registers it (tied weights have more than one)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                names = owners.setdefault(id(param), [])
                if name not in names:
                    names.append(name)
    return owners


def _is_plain_parameter(weight: torch.Tensor) -> bool:
    # A parameter of a model built under FakeTensorMode (the memory planner) is a FakeTensor flagged
    # as a parameter: a plain weight with fake storage, not a quantized or other subclass weight.
    if type(weight) is nn.Parameter:
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return type(weight) is FakeTensor and isinstance(weight, nn.Parameter)


def select_targets(model: nn.Module, config: GaLoreConfig) -> tuple[list[tuple[str, nn.Linear]], TargetReport]:
    """The (name, module) pairs to replace, and a report of what was skipped and why."""
    report = TargetReport()
    explicit = config.target_modules not in (None, "all-linear")
    all_linear = config.target_modules == "all-linear"
    heads = _output_head_names(model)
    excluded = config.exclude_modules
    linear_names: list[str] = []
    # layers a list or regex selects that a basis of this rank does not project (_projection_limit)
    too_small: list[tuple[str, nn.Linear]] = []
    selected: list[tuple[str, nn.Linear]] = []
    sharing = _shared_parameter_owners(model)
    conv1d = [name for name, module in model.named_modules() if type(module).__name__ == "Conv1D"]
    for name, module in model.named_modules():
        if isinstance(module, GaLoreLinear):
            raise ValueError(
                f"model already holds GaLore layers (e.g. {name!r}); call merge_and_unload(model) before "
                "preparing it again"
            )
        if not isinstance(module, nn.Linear):
            continue
        linear_names.append(name)
        weight = module.weight
        numel = whole_numel(weight)

        reason = None
        if _ADAPTER_NAME.search(name):
            reason = "adapter layers (left to plain AdamW)"
        elif not isinstance(weight, nn.Parameter) or not weight.requires_grad:
            reason = "frozen"
        elif not weight.is_floating_point() or not _is_plain_parameter(weight):
            reason = "quantized or non-standard weight"
        elif explicit and not _matches(name, config.target_modules):
            reason = "not in target_modules"
        elif not explicit and not all_linear and _is_head(name, heads):
            reason = "output head"
        elif excluded is not None and _matches(name, excluded):
            reason = "in exclude_modules"
        elif id(weight) in sharing and len(sharing[id(weight)]) > 1:
            others = [owner for owner in sharing[id(weight)] if owner != name]
            if explicit:
                # GaLore replaces the weight by W0 + factor: the other owner would keep the old tensor and the
                # pair would be saved untied under a config that still says tied.
                raise ValueError(
                    f"target_modules selects {name!r}, whose weight is tied to {others[0]!r} (shared parameter, "
                    "e.g. tie_word_embeddings=True): GaLore would untie them. Leave it out of target_modules, or "
                    "untie the model first (config.tie_word_embeddings=False and a separate copy of the weight)."
                )
            reason = f"weight tied to {others[0]}"
        elif not explicit and not all_linear and min(module.out_features, module.in_features) <= config.rank:
            reason = f"smaller side <= rank {config.rank}"
        elif config.rank >= _projection_limit(config.proj_type, module.out_features, module.in_features):
            # 'all-linear' leaves out (and names in the summary) a layer the basis would not project; a list or
            # regex asked for it by name: it is trained with the identity basis, exactly AdamW on the weight
            # (transformers' GaLore accepts such targets, e.g. its default rank 128 on a small test model),
            # and a warning below names it.
            if explicit:
                too_small.append((name, module))
            else:
                reason = f"{_PROJECTED_SIDE[config.proj_type]} <= rank {config.rank}"
        if reason is not None:
            report.skipped[name] = reason
            report.skipped_params += numel
            if all_linear or (explicit and reason != "not in target_modules"):
                report.matched_skipped.append(name)
        else:
            selected.append((name, module))
            report.targeted.append(name)
            report.targeted_params += numel
    unmatched = _unmatched_excludes(config, linear_names + [name for name, m in model.named_modules()
                                                           if expert_parameters(m)])  # fmt: skip
    if unmatched:
        which = (f"exclude_modules={excluded!r}" if isinstance(excluded, str)
                 else f"exclude_modules entry {unmatched[0]!r} (of {excluded!r})")  # fmt: skip
        raise ValueError(
            f"{which} matched no nn.Linear or experts module, so it excludes nothing; linear layers in this "
            f"model are e.g. {linear_names[:8]} {_no_match_hint(unmatched[0], linear_names)}"
        )
    if too_small:
        # the smallest limit first: a rank below it fixes every layer counted
        name, module = min(
            too_small, key=lambda item: _projection_limit(config.proj_type, item[1].out_features, item[1].in_features)
        )
        rows, cols = module.out_features, module.in_features
        more = f" (and {len(too_small) - 1} more layers it selects)" if len(too_small) > 1 else ""
        logger.warning(
            f"rank={config.rank} is at least {_covered(config.proj_type, config.rank, rows, cols)} of {name!r} "
            f"(weight {rows} x {cols}, proj_type={config.proj_type!r}), which target_modules="
            f"{config.target_modules!r} selects{more}: GaLore does not project it, its factor is the whole "
            f"weight (exactly AdamW, no memory saved). Use rank < {_projection_limit(config.proj_type, rows, cols)}, "
            "or leave the layer out of target_modules (or name it in exclude_modules) to train it with plain "
            "optimizer state."
        )
    if not selected:
        linear = linear_names
        if conv1d:
            raise ValueError(
                f"no nn.Linear layer to train with GaLore: this model's projections ({len(conv1d)}, e.g. "
                f"{conv1d[0]!r}) are transformers' Conv1D (GPT-2 style, weight stored transposed), which GaLore "
                "does not target. Train this model with a plain optimizer, or replace its Conv1D layers by "
                "nn.Linear (weight = conv1d.weight.T) before prepare_model."
            )
        if not linear:
            raise ValueError(
                f"no nn.Linear layer to train with GaLore: {type(model).__name__} has no nn.Linear module (GaLore "
                "trains the weights of nn.Linear layers only). Use a plain optimizer for this model."
            )
        adapters = [n for n, r in report.skipped.items() if r.startswith("adapter")]
        frozen = [n for n, r in report.skipped.items() if r == "frozen"]
        if not explicit and len(adapters) + len(frozen) == len(report.skipped) and adapters:
            raise ValueError(
                "no nn.Linear layer to train with GaLore: every nn.Linear is frozen or a LoRA/adapter layer "
                f"({len(adapters)} adapter, {len(frozen)} frozen; e.g. {adapters[0]!r}). A LoRA-only peft model "
                "has nothing for GaLore to train: GaLore trains full nn.Linear weights; list layers in peft's "
                "modules_to_save to train them with GaLore, or train the adapters with a plain optimizer."
            )
        if explicit:
            raise ValueError(
                f"target_modules={config.target_modules!r} matched no trainable nn.Linear layer; linear layers "
                f"in this model are e.g. {[n for n in report.skipped][:8]} "
                f"{_no_match_hint(config.target_modules, linear)}"
            )
        by_rank = [n for n, r in report.skipped.items() if r.endswith(f" <= rank {config.rank}")]
        if by_rank:
            raise ValueError(
                "no nn.Linear layer to train with GaLore: " + report.summary() + ". Lower `rank` "
                f"(now {config.rank}) below the layers' smaller side, or name layers in target_modules"
            )
        raise ValueError(
            "no nn.Linear layer to train with GaLore: " + report.summary() + ". Name the layers to train in "
            "target_modules, or make them trainable (requires_grad=True)"
        )
    return selected, report


# An experts module is recognised by its layout, not by its class: the layout GaLoreExperts computes (gated,
# gate and up concatenated in gate_up_proj (E x 2I x H), down_proj (E x H x I), no bias, not transposed) is
# read from the flags transformers' use_experts_implementation sets on every experts class
# (expert_layout_problem). Qwen3-MoE, Mixtral and OLMoE have it in transformers 5.25.
_NUM_EXPERTS_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts")


def _num_experts(module: nn.Module) -> int | None:
    for owner in (module, getattr(module, "config", None)):
        for attr in _NUM_EXPERTS_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def expert_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The fused expert weights `module` registers itself: 3-D parameters whose first dimension is its
    number of experts (its ``num_experts`` / ``num_local_experts`` attribute, or its config's). Empty for
    anything else (a router's weight is 2-D)."""
    count = _num_experts(module)
    if count is None:
        return {}
    return {
        name: param
        for name, param in module._parameters.items()
        if param is not None and len(whole_shape(param)) == 3 and whole_shape(param)[0] == count
    }


def expert_layout_problem(module: nn.Module) -> str | None:
    """Why :class:`GaLoreExperts` cannot stand in for the experts module `module` (None: it can)."""
    params = expert_parameters(module)
    if set(params) != set(EXPERT_PROJECTIONS):
        return f"expert parameters {sorted(params)}, not gate_up_proj and down_proj"
    flags = {
        "is_transposed": False,
        "has_bias": False,
        "has_gate": True,
        "is_concatenated": True,
        "has_post_expert_norm": False,
        "_is_expert_parallel": False,
    }
    for flag, supported in flags.items():
        if getattr(module, flag, supported) != supported:
            return f"layout {flag}={getattr(module, flag)!r}"
    gate_up, down_shape = whole_shape(params["gate_up_proj"]), whole_shape(params["down_proj"])
    count, up, down = gate_up
    if up % 2 or tuple(down_shape) != (count, down, up // 2):
        return (
            f"shapes gate_up_proj {tuple(gate_up)} and down_proj {tuple(down_shape)} are not (E, 2I, H) and (E, H, I)"
        )
    if getattr(module, "act_fn", None) is None and getattr(module, "_apply_gate", None) is None:
        return "no act_fn or _apply_gate"
    for param in params.values():
        if not param.requires_grad:
            return "frozen"
        if not param.is_floating_point() or not _is_plain_parameter(param):
            return "quantized or non-standard weight"
    return None


def _check_expert_rank(name: str, params: dict[str, nn.Parameter], config: GaLoreConfig) -> None:
    """Refuse an expert rank at which the experts of a projection are not projected (:func:`_projection_limit`)."""
    rank, proj_type = config.expert_rank, config.proj_type
    limits = {}
    for projection, param in params.items():
        count, rows, cols = whole_shape(param)
        limits[projection] = (_projection_limit(proj_type, rows, cols), count, rows, cols)
    too_small = [projection for projection, (limit, *_) in limits.items() if rank >= limit]
    if not too_small:
        return
    projection = min(too_small, key=lambda p: limits[p][0])  # the smallest limit: a rank below it fits all
    limit, count, rows, cols = limits[projection]
    raise ValueError(
        f"expert_rank={rank} is at least {_covered(proj_type, rank, rows, cols)} of every expert of {name!r}: its "
        f"{projection} holds {count} experts of {rows} x {cols} (proj_type={proj_type!r}), which GaLore would not "
        f"project (each factor would be the whole expert weight). Use expert_rank < {limit}, or leave these "
        "experts to plain optimizer state (exclude_modules, or experts=False)."
    )


def select_expert_targets(model: nn.Module, config: GaLoreConfig, report: TargetReport) -> list[tuple[str, nn.Module]]:
    """The experts modules of `model` to replace by :class:`GaLoreExperts` (with ``config.experts``); every
    experts module left out goes into `report` with its reason."""
    selected = []
    excluded = config.exclude_modules
    for name, module in model.named_modules():
        params = expert_parameters(module)
        if not params:
            continue
        numel = sum(whole_numel(p) for p in params.values())
        problem = expert_layout_problem(module)
        if not any(p.requires_grad for p in params.values()):
            reason = "frozen"
        elif not config.experts:
            reason = "experts=False"
        elif problem is not None:
            reason = f"unsupported: {problem}"
        elif _ADAPTER_NAME.search(name):
            reason = "adapter"
        elif excluded is not None and _matches(name, excluded):
            reason = "in exclude_modules"
        else:
            _check_expert_rank(name, params, config)
            selected.append((name, module))
            report.experts.append(name)
            report.expert_params += numel
            continue
        report.unprojected_experts[name] = reason
        if reason != "frozen":
            report.unprojected_expert_params += numel
    report.expert_rank = config.expert_rank
    report.model_params = sum(whole_numel(p) for p in model.parameters())
    return selected


_Module = TypeVar("_Module", bound=nn.Module)


class ModuleBuilder(Protocol):
    """How :func:`replace_targets` turns one selected module into its GaLore replacement: ``build(original,
    make)`` calls ``make()``, which reads `original`'s parameters and returns the new module, and returns the
    module to put in `original`'s place.

    An engine that partitions parameters in place (DeepSpeed ZeRO-3 after a partitioned load:
    ``integrations.distributed.prepare_zero3_model``) makes `original`'s parameters whole around ``make()``
    and partitions the new module after it, so no rank ever holds more than one whole module.
    """

    def __call__(self, original: nn.Module, make: Callable[[], _Module]) -> _Module: ...


def build_in_place(original: nn.Module, make: Callable[[], _Module]) -> _Module:
    """The :class:`ModuleBuilder` of a model whose parameters are whole (one process, and every engine that
    wraps the model after it is prepared): the module ``make()`` returns."""
    return make()


def whole_shape(param: torch.Tensor) -> torch.Size:
    """The shape of `param` as the model defines it. Selection reads shapes and sizes through it, so a model
    whose parameters an engine partitioned in place is selected and reported as the whole model: DeepSpeed
    ZeRO-3 leaves an empty placeholder and keeps the shape in ``ds_shape``."""
    shape = getattr(param, "ds_shape", None)
    return param.shape if shape is None else torch.Size(shape)


def whole_numel(param: torch.Tensor) -> int:
    """The number of values of `param` as the model defines it (:func:`whole_shape`)."""
    return whole_shape(param).numel()


def _mark_initialized(original: nn.Module, replacement: nn.Module) -> None:
    # A framework's mark that its init has run on the replaced module (transformers' `_is_hf_initialized`,
    # read by its init_weights()) holds for the replacement too: it must not re-initialise loaded weights.
    if getattr(original, "_is_hf_initialized", False):
        object.__setattr__(replacement, "_is_hf_initialized", True)


def fixed_ranks(config: GaLoreConfig, names: list[str], stacks: Sequence[str] = ()) -> Optional[dict[str, int]]:
    """The per-layer ranks of ``config.rank_allocation`` when it names a file (None otherwise): a list of rows
    with 'layer' and 'rank' (``galore_ranks.json`` of an 'auto' run) or {layer name: rank}, holding exactly the
    layers `names` (the targets) and any of the expert stacks `stacks` (one left out stays at ``expert_rank``)."""
    path = config.rank_allocation
    if path in ("uniform", "auto"):
        return None
    where = f"GaLoreConfig.rank_allocation={path!r}"
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read the file of per-layer ranks ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not a JSON file of per-layer ranks ({exc})") from None
    if isinstance(data, list) and all(isinstance(row, dict) and "layer" in row and "rank" in row for row in data):
        data = {row["layer"]: row["rank"] for row in data}
    if not isinstance(data, dict) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1
                                             for r in data.values()):  # fmt: skip
        raise ValueError(
            f"{where}: expected {{layer name: positive int rank}} or the rows of galore_ranks.json (each with "
            "'layer' and 'rank')"
        )
    missing = [name for name in names if name not in data]
    extra = [name for name in data if name not in names and name not in stacks]
    if missing or extra:
        raise ValueError(
            f"{where} does not hold the ranks of this model's GaLore layers: "
            + (f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"not targeted here {extra[:6]}{' ...' if len(extra) > 6 else ''}" if extra else "")
            + ". Use the file written for this model and these target_modules / exclude_modules"
        )
    return {name: data[name] for name in [*names, *stacks] if name in data}


def _galore_linear(
    linear: nn.Linear, config: GaLoreConfig, layer_index: int, rank: Optional[int] = None
) -> GaLoreLinear:
    layer = GaLoreLinear(linear, config, layer_index=layer_index, rank=rank)
    _mark_initialized(linear, layer)
    return layer


def _galore_experts(
    experts: nn.Module, config: GaLoreConfig, layer_index: int, ranks: Optional[dict[str, int]] = None
) -> GaLoreExperts:
    replacement = GaLoreExperts(experts, config, layer_index=layer_index, ranks=ranks)
    for projection in EXPERT_PROJECTIONS:
        _mark_initialized(experts, getattr(replacement, projection))
    return replacement


def _experts_per_token(model: nn.Module) -> int:
    """Experts each token is routed to (the model config's ``num_experts_per_tok``; 1 where it names none:
    GaLoreExperts' forward then sets its stacks' count from the routing it is given)."""
    value = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def replace_targets(model: nn.Module, config: GaLoreConfig, *, build: ModuleBuilder = build_in_place) -> TargetReport:
    """Replace every selected nn.Linear of `model` by a GaLoreLinear, in place; with ``config.experts`` every
    supported experts module by a GaLoreExperts. Each replacement is built through `build` (:class:`ModuleBuilder`),
    one module at a time; every engine's preparation goes through here, so all of them select, seed, phase and
    report alike."""
    selected, report = select_targets(model, config)
    experts = select_expert_targets(model, config, report)
    stacks = [f"{name}.{projection}" for name, _ in experts for projection in EXPERT_PROJECTIONS]
    ranks = fixed_ranks(config, [name for name, _ in selected], stacks) or {}
    layers: list[GaLoreLinear] = []
    for index, (name, module) in enumerate(selected):
        # One at a time: a quantized W0 replaces the original weight before the next layer is built.
        layer = build(module, functools.partial(_galore_linear, module, config, index, ranks.get(name)))
        layers.append(layer)
        report.layer_scales[name] = layer.scale
        swap_submodule(model, name, layer)
    routed = _experts_per_token(model)
    for name, experts_module in experts:
        # Seeds continue the linear layers' indices: two stacks (gate_up_proj, down_proj) per module.
        stack_ranks = {p: ranks[f"{name}.{p}"] for p in EXPERT_PROJECTIONS if f"{name}.{p}" in ranks}
        replacement = build(
            experts_module, functools.partial(_galore_experts, experts_module, config, len(layers), stack_ranks)
        )
        for projection in EXPERT_PROJECTIONS:
            # what a recording stack keeps: its rows, top-k per token (the staggered packing counts them)
            getattr(replacement, projection).rows_per_token = routed
        layers.extend(getattr(replacement, projection) for projection in EXPERT_PROJECTIONS)
        for projection in EXPERT_PROJECTIONS:
            report.layer_scales[f"{name}.{projection}"] = getattr(replacement, projection).scale
        swap_submodule(model, name, replacement)
    assign_refresh_phases(layers)
    logger.info(report.summary())
    return report


def iter_galore_layers(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, GaLoreLinear):
            yield name, module


# Wrappers that engines insert between a model and its layers (FSDP1 units, activation checkpointing);
# module state dicts leave their names out of the keys.
_WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def state_dict_name(module_name: str) -> str:
    """A module's name as the keys of ``model.state_dict()`` spell it: without engine wrappers' names."""
    for wrapper in _WRAPPER_NAMES:
        module_name = module_name.replace(wrapper, "")
    return module_name


def iter_galore_layers_by_key(model: nn.Module):
    """(state-dict name, layer) for every GaLore layer (:func:`state_dict_name`)."""
    for name, layer in iter_galore_layers(model):
        yield state_dict_name(name), layer


def galore_state_per_layer(
    model: nn.Module, state: dict[str, torch.Tensor]
) -> list[tuple[GaLoreLinear, dict[str, torch.Tensor]]]:
    """(layer, its entries of `state` without the layer prefix) for every GaLore layer of `model`.

    `state` is keyed as :func:`hf_galore_plugin.galore_state_dict` keys it; a key of no layer is a KeyError.
    """
    layers = dict(iter_galore_layers_by_key(model))
    per_layer: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layers}
    for key, value in state.items():
        name, _, sub = key.rpartition(".")
        if name not in per_layer:
            raise KeyError(f"GaLore state holds {key!r} but the model has no GaLore layer {name!r}")
        per_layer[name][sub] = value
    return [(layer, per_layer[name]) for name, layer in layers.items()]


def swap_submodule(model: nn.Module, name: str, module: nn.Module) -> tuple[nn.Module, str]:
    """Put `module` at dotted path `name` of `model`; returns (parent, attribute) to undo it."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
    StepClock.generation += 1  # step drivers re-read the model's layers
    return parent, child


def plain_linear(layer: GaLoreLinear, weight: torch.Tensor, *, requires_grad: bool = True) -> nn.Linear:
    """An nn.Linear with `weight` (merged) and the layer's own bias, allocating nothing else."""
    linear = nn.Linear(
        layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta", dtype=weight.dtype
    )
    linear.weight = nn.Parameter(weight, requires_grad=requires_grad)
    if layer.bias is not None:
        linear.bias = layer.bias
    return linear


def swap_in_merged_experts(model: nn.Module, merged: dict[str, torch.Tensor]) -> list[tuple[nn.Module, str, nn.Module]]:
    """Put each GaLoreExperts module's stock experts module in its place, holding the merged weights of
    `merged` (keys as :func:`hf_galore_plugin.merged_state_dict` writes them); returns the swaps for
    :func:`restore_experts`."""
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    keys = {id(layer): key for key, layer in iter_galore_layers_by_key(model)}
    for name, module in list(model.named_modules()):
        if isinstance(module, GaLoreExperts):
            stock: Any = module.stock
            for projection in EXPERT_PROJECTIONS:
                weight = merged[keys[id(getattr(module, projection))]]
                stock._parameters[projection] = nn.Parameter(weight, requires_grad=False)
            swaps.append((*swap_submodule(model, name, stock), module))
    return swaps


def restore_experts(swaps: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Undo :func:`swap_in_merged_experts`: the GaLoreExperts modules back, the stock modules emptied."""
    for parent, child, module in swaps:
        setattr(parent, child, module)
        for projection in EXPERT_PROJECTIONS:
            module.stock._parameters[projection] = None  # type: ignore[union-attr]
    if swaps:
        StepClock.generation += 1


@torch.no_grad()
def unload(model: nn.Module) -> nn.Module:
    """Replace every GaLoreLinear by a plain nn.Linear holding the merged weight (dtype as loaded), and every
    GaLoreExperts module by the stock experts module holding the merged 3-D weights."""
    for name, module in list(model.named_modules()):
        if isinstance(module, GaLoreExperts):
            swap_submodule(model, name, module.merged_module())
    for name, layer in list(iter_galore_layers(model)):
        swap_submodule(model, name, plain_linear(layer, layer.effective_weight(layer.weight_dtype)))
    return model
