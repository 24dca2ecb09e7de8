"""Find the nn.Linear layers GaLore trains, replace them in place, and fold them back.

Targets are plain trainable ``nn.Linear`` layers only: never embeddings, norms, biases, frozen layers
(a QLoRA 4-bit base, a peft base layer), peft's LoRA adapter layers, or the output head by default.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from .config import GaLoreConfig
from .layers import GaLoreLinear

logger = logging.getLogger(__name__)

__all__ = ["TargetReport", "select_targets", "replace_targets", "unload", "iter_galore_layers", "swap_submodule", "plain_linear"]

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

    def summary(self) -> str:
        reasons: dict[str, int] = {}
        for reason in self.skipped.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        why = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())) or "none"
        return (
            f"GaLore targets {len(self.targeted)} nn.Linear layers ({self.targeted_params:,} weight parameters); "
            f"skipped {len(self.skipped)} ({self.skipped_params:,} parameters): {why}"
        )


def _output_head_names(model: nn.Module) -> set[str]:
    names = set()
    get_head = getattr(model, "get_output_embeddings", None)
    head = None
    if callable(get_head):
        try:
            head = get_head()
        except (NotImplementedError, AttributeError):
            head = None
    for name, module in model.named_modules():
        if module is head or _HEAD_NAME.search(name):
            names.add(name)
    return names


def _is_head(name: str, heads: set[str]) -> bool:
    # peft wraps a head listed in modules_to_save: its trainable copy `lm_head.modules_to_save.default`
    # is still the output head.
    return name in heads or any(name.startswith(head + ".") for head in heads)


def _matches(name: str, targets) -> bool:
    # Same rules as transformers' optim_target_modules: a string is a regex matched with re.fullmatch,
    # a list matches when one of its entries is a substring of the module name.
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(t in name for t in targets)


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
    heads = _output_head_names(model)
    excluded = list(config.exclude_modules or [])
    selected: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if isinstance(module, GaLoreLinear):
            raise ValueError(
                f"model already holds GaLore layers (e.g. {name!r}); call merge_and_unload(model) before "
                "preparing it again"
            )
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight
        numel = weight.numel()

        def skip(reason: str) -> None:
            report.skipped[name] = reason
            report.skipped_params += numel

        if _ADAPTER_NAME.search(name):
            skip("adapter layers (left to plain AdamW)")
        elif not isinstance(weight, nn.Parameter) or not weight.requires_grad:
            skip("frozen")
        elif not weight.is_floating_point() or not _is_plain_parameter(weight):
            skip("quantized or non-standard weight")
        elif explicit and not _matches(name, config.target_modules):
            skip("not in target_modules")
        elif not explicit and _is_head(name, heads):
            skip("output head")
        elif any(name == e or name.endswith("." + e) for e in excluded):
            skip("in exclude_modules")
        elif not explicit and min(module.out_features, module.in_features) <= config.rank:
            skip(f"smaller side <= rank {config.rank}")
        else:
            selected.append((name, module))
            report.targeted.append(name)
            report.targeted_params += numel
    if not selected:
        if explicit:
            raise ValueError(
                f"target_modules={config.target_modules!r} matched no trainable nn.Linear layer; linear layers "
                f"in this model are e.g. {[n for n in report.skipped][:8]}"
            )
        raise ValueError(
            "no nn.Linear layer to train with GaLore: " + report.summary() + ". Lower `rank` "
            f"(now {config.rank}) below the layers' smaller side, or name layers in target_modules"
        )
    too_big = [n for n, m in selected if config.rank >= max(m.out_features, m.in_features)]
    if too_big and len(too_big) == len(selected):
        raise ValueError(
            f"rank={config.rank} is at least both sides of every targeted layer (e.g. {too_big[0]!r}): GaLore "
            "would be plain AdamW there. Use a smaller rank or train these layers with AdamW"
        )
    return selected, report


def replace_targets(model: nn.Module, config: GaLoreConfig) -> TargetReport:
    """Replace every selected nn.Linear of `model` by a GaLoreLinear, in place."""
    selected, report = select_targets(model, config)
    for index, (name, module) in enumerate(selected):
        swap_submodule(model, name, GaLoreLinear(module, config, layer_index=index))
    logger.info(report.summary())
    return report


def iter_galore_layers(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, GaLoreLinear):
            yield name, module


# Wrappers that engines insert between a model and its layers (FSDP1 units, activation checkpointing);
# module state dicts leave their names out of the keys.
_WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def iter_galore_layers_by_key(model: nn.Module):
    """(state-dict name, layer) for every GaLore layer: its name without engine wrappers' names, as
    the keys of ``model.state_dict()`` spell it."""
    for name, layer in iter_galore_layers(model):
        for wrapper in _WRAPPER_NAMES:
            name = name.replace(wrapper, "")
        yield name, layer


def swap_submodule(model: nn.Module, name: str, module: nn.Module) -> tuple[nn.Module, str]:
    """Put `module` at dotted path `name` of `model`; returns (parent, attribute) to undo it."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
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


@torch.no_grad()
def unload(model: nn.Module) -> nn.Module:
    """Replace every GaLoreLinear by a plain nn.Linear holding the merged weight (dtype as loaded)."""
    for name, layer in list(iter_galore_layers(model)):
        swap_submodule(model, name, plain_linear(layer, layer.effective_weight(layer.weight_dtype)))
    return model
