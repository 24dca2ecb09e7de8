"""The plain-PyTorch API: prepare a model, build its optimizer, step, merge.

    model = prepare_model(model, GaLoreConfig.preset("qgalore_adamw_8bit", rank=128))
    optimizer = create_optimizer(model, model.galore_config, lr=1e-3, weight_decay=0.01)
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        after_step(model, optimizer)   # runs a basis refresh when one is due
        optimizer.zero_grad()
    model = merge_and_unload(model)    # plain nn.Linear layers, merged weights
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
from torch import nn

from .config import GaLoreConfig
from .engines.capabilities import check_moment_handling
from .engines.collectives import is_dtensor
from .engines.contract import gathers_parameters
from .engines.fsdp1 import check_fsdp1_layers, fsdp1_units, group_by_unit, had_gradient, summon_unit
from .inject import galore_state_per_layer, iter_galore_layers, iter_galore_layers_by_key, replace_targets, unload
from .layers import GaLoreLinear

__all__ = [
    "prepare_model",
    "create_optimizer",
    "galore_param_groups",
    "install_base_decay_hook",
    "after_step",
    "merge_and_unload",
    "merged_state_dict",
    "galore_layers",
    "galore_state_dict",
    "load_galore_state_dict",
    "galore_stats",
]


def prepare_model(model: nn.Module, config: GaLoreConfig) -> nn.Module:
    """Replace the targeted nn.Linear layers of `model` by GaLore layers, in place; returns `model`."""
    if not isinstance(config, GaLoreConfig):
        raise TypeError(
            f"config must be a hf_galore_plugin.GaLoreConfig, got {type(config).__name__}; "
            "use GaLoreConfig.preset('galore_adamw') or GaLoreConfig(rank=..., ...)"
        )
    existing = getattr(model, "galore_config", None)
    if existing is not None:
        if existing == config:
            return model
        raise ValueError("model was already prepared with a different GaLoreConfig; merge_and_unload(model) first")
    report = replace_targets(model, config)
    model.galore_config = config
    model.galore_report = report
    return model


def galore_layers(model: nn.Module) -> list[tuple[str, GaLoreLinear]]:
    return list(iter_galore_layers(model))


def galore_param_groups(
    model: nn.Module, param_groups: Iterable[dict[str, Any]], config: GaLoreConfig, *, eps: float = 1e-8
) -> list[dict[str, Any]]:
    """Split every GaLore factor out of `param_groups` into groups tagged ``"galore": True``.

    The factor's true gradient is ``scale * R`` (R = the projected gradient GaLore's Adam sees), so
    the group's eps is multiplied by ``scale``: Adam(scale * R, eps * scale) == Adam(R, eps) exactly,
    and the weight moves by ``lr * scale * update`` as in GaLore. Each GaLore group also records the
    names of its layers (``"galore_layers"``), for engines that replace its parameters by flat
    partitions (DeepSpeed ZeRO).
    """
    owners = {id(layer.galore_factor): name for name, layer in iter_galore_layers(model)}
    result = []
    for group in param_groups:
        params = list(group["params"])
        plain = [p for p in params if id(p) not in owners]
        lowrank = [p for p in params if id(p) in owners]
        if plain:
            result.append({**group, "params": plain})
        if lowrank:
            result.append(
                {
                    **group,
                    "params": lowrank,
                    "eps": group.get("eps", eps) * config.scale,
                    "galore": True,
                    "galore_layers": [owners[id(p)] for p in lowrank],
                }
            )
    return result


def install_base_decay_hook(optimizer: torch.optim.Optimizer, model: nn.Module):
    """Apply each GaLore group's decoupled weight decay to the frozen base through its scalar multiplier.

    AdamW decays the factor itself; the base W0 is not a parameter of the optimizer, so after every step
    ``alpha *= 1 - lr * weight_decay`` with the group's lr of that step (a post-hook runs before any LR
    scheduler step). Together the whole effective weight decays, as GaLore's AdamW does.

    Layers are looked up at every step, not when the hook is installed: FSDP2 replaces parameters
    by DTensors and accelerate swaps them into an optimizer built before wrapping. A layer decays when
    its factor had a gradient this step (as AdamW skips parameters without one; under FSDP1, when the
    factor's unit had one: a rank whose shard holds none of the factor sees no gradient of its own, and
    the multiplier, a replicated buffer, must move on every rank alike). When an engine has
    replaced a group's parameters by its own flat partitions (DeepSpeed ZeRO), every layer recorded
    in the group's ``"galore_layers"`` decays on each step the engine takes (ZeRO steps the whole
    partition, unused factors included; a step it skips on fp16 overflow never reaches this hook;
    ZeRO-3 must keep each GaLore group in one sub-group: its default ``sub_group_size`` of 1e9 does).
    """

    def hook(opt: torch.optim.Optimizer, args, kwargs) -> None:
        layers: Optional[dict[str, GaLoreLinear]] = None
        units: Optional[dict[int, nn.Module]] = None
        for group in opt.param_groups:
            wd = group.get("weight_decay", 0.0)
            # ZeRO-3 steps one sub-group at a time and leaves the other groups' "params" empty meanwhile.
            if not group.get("galore") or not wd or not group["params"]:
                continue
            if layers is None:
                layers = dict(iter_galore_layers(model))
                by_factor = {id(layer.galore_factor): layer for layer in layers.values()}
            factor = 1.0 - float(group["lr"]) * wd
            owned = [(p, by_factor.get(id(p))) for p in group["params"]]
            if any(layer is not None for _, layer in owned):
                for p, layer in owned:
                    if layer is None:
                        continue
                    if p.grad is None:
                        # Only then can FSDP1 matter (an empty local view of a factor that did take part):
                        # its units are looked up at most once per step, never when every factor has a grad.
                        if units is None:
                            units = fsdp1_units(model)
                        if not had_gradient(p, units):
                            continue
                    layer.base_multiplier.mul_(factor)
            else:
                for name in group.get("galore_layers", ()):
                    layers[name].base_multiplier.mul_(factor)

    return optimizer.register_step_post_hook(hook)


def create_optimizer(
    model: nn.Module,
    config: Optional[GaLoreConfig] = None,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    param_groups: Optional[list[dict[str, Any]]] = None,
):
    """AdamW (fp32 or 8-bit state per `config`) over every trainable parameter of a prepared model.

    `param_groups` (e.g. a decay / no-decay split) replaces the default single group of all
    trainable parameters with ``weight_decay``.
    """
    from .optim import AdamW

    config = config or getattr(model, "galore_config", None)
    if config is None:
        raise ValueError("model is not prepared: call prepare_model(model, config) first, or pass config")
    if not galore_layers(model):
        raise ValueError("model has no GaLore layers: call prepare_model(model, config) before create_optimizer")
    # FSDP1 (use_orig_params) and ZeRO-3 keep 1-D slices of the factor; their refreshes gather it
    # (engines.fsdp1, DeepSpeedGaLoreOptimizer). Anything else must hold the 2-D factor.
    fsdp1_managed = check_fsdp1_layers(galore_layers(model), fsdp1_units(model))
    for name, layer in galore_layers(model):
        if id(layer) not in fsdp1_managed and not hasattr(layer.galore_factor, "ds_id"):
            layer._check_factor_layout()
        if is_dtensor(layer.galore_factor):
            check_moment_handling(
                "fsdp2",
                moment_handling=config.moment_handling,
                left_basis=layer.left_rank is not None and not layer.left_identity,
                layer=name,
            )
    if param_groups is None:
        param_groups = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    groups = galore_param_groups(model, param_groups, config, eps=eps)
    optimizer = AdamW(
        groups,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        state_bits=config.state_bits,
        block_size=config.state_block_size,
        error_feedback=config.error_feedback,
    )
    install_base_decay_hook(optimizer, model)
    return optimizer


def after_step(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, root: Optional[nn.Module] = None
) -> dict[str, Any]:
    """Call once after every ``optimizer.step()``: counts the step and refreshes bases that are due.

    Under FSDP1 pass the wrapped model (or `model` and its wrapper as `root`): a refresh gathers the
    layers' FSDP units, one at a time. Returns ``{"refreshed": [layer names], "similarity": mean similarity or None}``.
    """
    layers = list(iter_galore_layers(model))
    stepped: dict[str, tuple[bool, Optional[float]]] = {}
    due_layers = [(name, layer) for name, layer in layers if layer.refresh_due]
    if due_layers and not gathers_parameters(optimizer):
        units = fsdp1_units(root if root is not None else model)
        # FSDP1: W0 and the factor are 1-D shards; each unit with refreshing layers is gathered once
        # (a collective: the refresh schedule, a function of the shared counters, is the same on all ranks).
        for unit, members in group_by_unit(due_layers, units) if units else ():
            if unit is not None:
                with summon_unit(unit, writeback=True):
                    for name, layer in members:
                        stepped[name] = (True, layer.after_optimizer_step(optimizer))
    refreshed, similarities = [], []
    for name, layer in layers:
        if name in stepped:
            due, similarity = stepped[name]
        else:
            due = layer.refresh_due
            similarity = layer.after_optimizer_step(optimizer)
        if due and similarity is not None:
            refreshed.append(name)
            if not math.isnan(similarity):
                similarities.append(similarity)
    return {
        "refreshed": refreshed,
        "similarity": sum(similarities) / len(similarities) if similarities else None,
    }


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Fold every GaLore layer back into a plain nn.Linear with the merged weight; returns `model`."""
    unload(model)
    for attr in ("galore_config", "galore_report"):
        if hasattr(model, attr):
            delattr(model, attr)
    return model


@torch.no_grad()
def merged_state_dict(model: nn.Module, state_dict: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """The state dict the merged model would have (plain nn.Linear keys), without changing `model`."""
    state_dict = dict(model.state_dict() if state_dict is None else state_dict)
    for name, layer in iter_galore_layers_by_key(model):
        prefix = f"{name}." if name else ""
        for key in layer.state_dict(keep_vars=True):
            state_dict.pop(prefix + key, None)
        state_dict[prefix + "weight"] = layer.effective_weight(layer.weight_dtype)
        if layer.bias is not None:
            state_dict[prefix + "bias"] = layer.bias.detach()
    return state_dict


def galore_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of every GaLore layer (W0 incl. quantized parts, factor, bases, counters), detached."""
    state = {}
    for name, layer in iter_galore_layers_by_key(model):
        for key, value in layer.state_dict().items():
            state[f"{name}.{key}"] = value.detach().clone()
    return state


def load_galore_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`galore_state_dict` saved, exactly (strict: every layer, every key)."""
    for layer, layer_state in galore_state_per_layer(model, state):
        with torch.no_grad():
            layer.load_state_dict(layer_state, strict=True)


def galore_stats(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, float]:
    """Numbers worth logging: refreshes, subspace similarity, gaps, state bytes, quantization error."""
    layers = galore_layers(model)
    if not layers:
        return {}
    similarities = [float(l.galore_last_similarity) for _, l in layers]
    similarities = [s for s in similarities if not math.isnan(s)]
    gaps = [int(l.galore_gap) for _, l in layers]
    stats: dict[str, float] = {
        "galore/layers": float(len(layers)),
        "galore/refreshes": float(sum(int(l.galore_num_refreshes) for _, l in layers)),
        "galore/gap_mean": sum(gaps) / len(gaps),
        "galore/gap_max": float(max(gaps)),
    }
    if similarities:
        stats["galore/similarity"] = sum(similarities) / len(similarities)
    nbytes: dict[str, int] = {}
    for _, layer in layers:
        for role, n in layer.state_nbytes().items():
            nbytes[role] = nbytes.get(role, 0) + n
    for role, n in nbytes.items():
        stats[f"galore/bytes_{role}"] = float(n)
    if optimizer is not None and hasattr(optimizer, "state_nbytes"):
        stats["galore/bytes_optimizer_state"] = float(optimizer.state_nbytes())
    errors: dict[str, list[float]] = {}
    for _, layer in layers:
        for role, error in layer.quantization_error().items():
            errors.setdefault(role, []).append(error)
    for role, values in errors.items():
        stats[f"galore/{role}_quant_error"] = sum(values) / len(values)
    return stats
