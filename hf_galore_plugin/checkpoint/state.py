"""``galore_state.pt``: the exact GaLore state of a checkpoint, its format and its checks.

A Trainer checkpoint of a prepared model holds the merged plain model (``model.safetensors``, loads
anywhere) and, beside it, ``galore_state.pt``: every GaLore layer's own tensors (W0, possibly quantized,
the factor, the bases, the schedule counters), the step and the settings they were saved with, and the
optimizer name, so that a resume continues exactly. This module writes and reads the file and checks it
against itself (a CRC-32 of every tensor, written with it), the checkpoint it sits in (the step of
``trainer_state.json``, the merged weights of the model file) and the model it is loaded into (settings,
schedule counters). No transformers import.

These checks stand without the manifest (a checkpoint's manifest may be rewritten over damaged files, or
missing), so together they cover what it covers of the GaLore state: the merged weights witness W0 and the
factor, but not a basis whose factor is zero (every layer right after its refresh: W0 + scale * 0 Q^T does
not depend on Q), and only to rounding; the tensors' own checksums witness every byte.

Every refusal ends with what to do. The default advice is a resume's; a caller that loads the checkpoint
for another purpose (the Trainer's ``load_best_model_at_end``) passes its own as `advice`.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..config import GaLoreConfig, kept_on_resume
from ..inject import iter_galore_layers, iter_galore_layers_by_key
from ..state import prepared_state, state_of
from .files import GaLoreCheckpointError, write_atomically

__all__ = [
    "GALORE_STATE_NAME",
    "GALORE_STATE_FORMAT",
    "FIXED_FIELDS",
    "MUTABLE_FIELDS",
    "compare_galore_config",
    "check_galore_counters",
    "apply_mutable_changes",
    "save_galore_checkpoint",
    "read_galore_checkpoint",
    "read_checkpoint_state",
    "check_merged_weights",
    "SavedLayout",
    "tensor_checksums",
    "check_tensor_checksums",
]

logger = logging.getLogger(__name__)

GALORE_STATE_NAME = "galore_state.pt"
# galore_state.pt is a dict of plain values and tensors (loads with weights_only=True):
#   {"format": GALORE_STATE_FORMAT, "global_step": int | None, "optimizer": str | None,
#    "config": GaLoreConfig.to_dict(), "state": galore_state_dict(model),
#    "checksums": {key of "state": CRC-32 of its dtype, shape and bytes}}
# The step and the config bind the file to its checkpoint; the merged weights of the checkpoint's own
# model file are compared with the ones this state gives when the Trainer loads both; the checksums
# bind every tensor to the bytes written (torch's zip reader does not check its own CRCs). A file
# without "checksums" is read without them: they are optional in this format.
GALORE_STATE_FORMAT = "hf_galore_plugin.galore_state.v2"

# Fields the saved tensors depend on: the factor's shape (rank, proj_type), the meaning of the factor
# (scale), the layout of W0, of the bases and of the optimizer state, the set of layers, the layers'
# random streams (seed: galore_seed, which stochastic rounding and random bases continue from). A resume
# with another value would change the model or fail deep inside load_state_dict: refused.
FIXED_FIELDS = (
    "rank",
    "scale",
    "proj_type",
    "weight_storage",
    "weight_group_size",
    "basis_storage",
    "basis_group_size",
    "state_bits",
    "state_block_size",
    "error_feedback",
    "target_modules",
    "experts",
    "expert_rank",
    "exclude_modules",
    "seed",
)
# Fields that only steer what happens from now on (refresh schedule, learning-rate scale, how the next
# basis is computed): a resume takes the new value and logs it.
MUTABLE_FIELDS = tuple(name for name in GaLoreConfig.field_names() if name not in FIXED_FIELDS)


def _normalized(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def compare_galore_config(
    saved: dict[str, Any], current: GaLoreConfig, *, where: str, advice: Optional[str] = None
) -> dict[str, tuple[Any, Any]]:
    """Check a saved config against the current one, field by field.

    A difference in a :data:`FIXED_FIELDS` field raises :class:`GaLoreCheckpointError` naming the field,
    both values and `where` (and `advice`, else a resume's); returns {field: (saved, current)} for the
    :data:`MUTABLE_FIELDS` that changed.
    """
    now = current.to_dict()
    fixed = [
        (name, saved[name], now[name])
        for name in FIXED_FIELDS
        if name in saved and _normalized(saved[name]) != _normalized(now[name])
    ]
    if fixed:
        listed = "; ".join(f"{name}: saved {old!r}, now {new!r}" for name, old, new in fixed)
        raise GaLoreCheckpointError(
            f"{where} was saved with other GaLore settings that its tensors depend on ({listed}). "
            + (
                advice
                or "Resume with the saved values (optim_args / GaLoreConfig), or start a new run from the merged "
                "model (from_pretrained of the checkpoint folder) to use the new ones."
            )
        )
    return {
        name: (saved[name], now[name])
        for name in MUTABLE_FIELDS
        if name in saved and _normalized(saved[name]) != _normalized(now[name])
    }


def check_galore_counters(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    saved: dict[str, Any],
    *,
    global_step: Optional[int],
    where: str,
    advice: Optional[str] = None,
) -> None:
    """Check the schedule counters of a saved GaLore `state` (saved with config dict `saved`) against each
    other, the step it belongs to (`global_step`; the optimizer steps a Trainer skipped on fp16 overflow
    are not counted, so a layer may be behind it, never ahead) and the rules of the schedule; the layers of
    `model`, prepared with the current config, give the values fixed by the settings (seed, phase). Raises
    :class:`GaLoreCheckpointError` naming the layer, the counter and the bound it breaks (and `advice`, else
    a resume's)."""
    from ..layers.linear import COUNTER_NAMES

    gap, growth = int(saved["update_proj_gap"]), int(saved["lazy_growth"])
    max_gap = saved["max_proj_gap"] if saved["max_proj_gap"] is not None else 8 * gap
    lazy = bool(saved["lazy_refresh"])
    prepared = state_of(model)
    now = prepared.config if prepared is not None else None
    same = {name: now is not None and _normalized(getattr(now, name)) == _normalized(saved[name]) for name in saved}
    phases_fixed = all(same.get(name, False) for name in _PHASE_FIELDS)
    problems: list[str] = []
    steps: dict[str, int] = {}
    for name, layer in iter_galore_layers_by_key(model):
        keys = {counter: f"{name}.{counter}" for counter in COUNTER_NAMES}
        if not all(key in state and state[key].numel() == 1 for key in keys.values()):
            continue  # the strict load names missing or misshapen entries
        c = {counter: int(state[key].reshape(())) for counter, key in keys.items()}
        step = steps[name] = c["galore_step"]

        def bad(counter: str, rule: str, layer_name: str = name, values: dict[str, int] = c) -> None:
            problems.append(f"layer {layer_name!r} {counter}={values[counter]} ({rule})")

        if step < 0 or (global_step is not None and step > global_step):
            bad("galore_step", f"the checkpoint is step {global_step}; a layer counts at most that many steps")
        if not -1 <= c["galore_last_refresh"] < max(step, 0):
            bad("galore_last_refresh", f"must be -1 or a step before galore_step={step}")
        if not 0 <= c["galore_num_refreshes"] <= max(step, 0) or (
            c["galore_num_refreshes"] > 0 and c["galore_last_refresh"] < 0
        ):
            bad("galore_num_refreshes", f"at most one refresh per step up to {step}, and a step of the last one")
        grown, ok_gap = gap, c["galore_gap"] == gap
        while lazy and not ok_gap and grown < max_gap:
            grown = min(grown * growth, max_gap)
            ok_gap = c["galore_gap"] == grown
        if not ok_gap:
            bad("galore_gap", f"update_proj_gap={gap}" + (f" grown by {growth}x up to {max_gap}" if lazy else ""))
        if not 0 <= c["galore_agree_count"] < (int(saved["lazy_window"]) if lazy else 1):
            bad("galore_agree_count", f"below lazy_window={saved['lazy_window']}" if lazy else "0 without lazy_refresh")
        if c["galore_rng_counter"] < 0:
            bad("galore_rng_counter", "a count of random draws")
        if same["seed"] and c["galore_seed"] != layer.counter("galore_seed"):
            bad("galore_seed", f"seed={saved['seed']} gives {layer.counter('galore_seed')} for this layer")
        if saved["refresh_schedule"] == "aligned":
            if c["galore_phase"] != 0:
                bad("galore_phase", "0 under refresh_schedule='aligned'")
        elif (
            phases_fixed
            # Phases still waiting for the first forward's token count are not known yet: the range is checked.
            and layer.pending_phase_packing is None
            and c["galore_phase"] != layer.counter("galore_phase")
        ):
            bad("galore_phase", f"these settings give this layer phase {layer.counter('galore_phase')}")
        elif not 0 <= c["galore_phase"] < gap:
            bad("galore_phase", f"a phase within update_proj_gap={gap}")
    if len(set(steps.values())) > 1:
        listed = ", ".join(f"{name}: {step}" for name, step in list(steps.items())[:4])
        problems.insert(0, f"galore_step differs between layers ({listed}, ...), which all count every step")
    if problems:
        raise GaLoreCheckpointError(
            f"{where}: the GaLore state's counters break the schedule they were saved with: "
            + "; ".join(problems[:4])
            + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            + ". The file was damaged or edited after it was written. "
            + (advice or "Resume from an earlier complete checkpoint of this run.")
        )


# Changes that restart a lazily grown gap from the (new) base gap: its growth was measured with the old rule.
_GAP_FIELDS = ("update_proj_gap", "max_proj_gap", "lazy_refresh", "lazy_growth")
# Changes that move the staggered phases: the schedule itself, the budget, and what a record and a kept input weigh.
_PHASE_FIELDS = (
    "refresh_schedule", "refresh_budget_mb", "refresh_tokens", "update_proj_gap", "basis_method", "oversampling"
)  # fmt: skip


def apply_mutable_changes(model: nn.Module, changed: dict[str, tuple[Any, Any]], *, where: str) -> None:
    """Make changed schedule settings take effect on loaded layers (their counters hold the saved ones):
    a changed gap rule restarts every layer's gap from ``update_proj_gap``; a changed schedule, budget,
    gap or record size assigns the phases anew (:func:`~hf_galore_plugin.layers.assign_refresh_phases`,
    as ``prepare_model`` does), so from the resumed step each layer refreshes at the steps its new phase
    gives (all phases 0 under ``'aligned'``). Every other field is read from the layers' config as it is
    used. Logs each change.

    Settings that only a changed default moved (:func:`~hf_galore_plugin.config.kept_on_resume`) keep the
    checkpoint's value instead, so a run started before the default changed continues as it started.
    """
    from ..layers import assign_refresh_phases

    layers = [layer for _, layer in iter_galore_layers(model)]
    if not changed or not layers:
        return
    config = layers[0].config  # one object, shared by the layers, the model's state and GaLoreCallback
    kept = kept_on_resume(changed, config)
    if kept:
        for name, value in kept.items():
            setattr(config, name, value)
        logger.warning(
            "%s was written with %s, the defaults before the bounded refresh: this run keeps them and continues "
            "as it started (runs started now use %s)",
            where,
            ", ".join(f"{name}={value!r}" for name, value in kept.items()),
            ", ".join(f"{name}={changed[name][1]!r}" for name in kept),
        )
        changed = {name: pair for name, pair in changed.items() if name not in kept}
    if any(name in changed for name in _GAP_FIELDS):
        for layer in layers:
            layer._set_counter("galore_gap", config.update_proj_gap)
            layer._set_counter("galore_agree_count", 0)
    phases = ""
    if kept or any(name in changed for name in _PHASE_FIELDS):
        # Kept settings: the loaded phases are the saved ones, which packing under the kept settings gives
        # again; assigning them also sets the layers' host copies, which prepare_model set for the new ones.
        assigned = assign_refresh_phases(layers)
        phases = f" (refresh phases now {sorted(set(assigned))} of update_proj_gap={config.update_proj_gap})"
    for layer in layers:
        layer._update_refresh_due()
    if changed:
        logger.warning(
            "%s: GaLore settings changed since the checkpoint and take effect from now on: %s%s",
            where,
            "; ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in changed.items()),
            phases,
        )


def save_galore_checkpoint(
    path: str,
    state: dict[str, torch.Tensor],
    config: GaLoreConfig,
    *,
    global_step: Optional[int] = None,
    optimizer_name: Optional[str] = None,
) -> None:
    """Write ``galore_state.pt`` atomically: a temporary file in the same folder, fsync, rename, fsync
    of the folder. A reader sees the previous file or the complete new one, never a partial one. A full
    disk raises :class:`CheckpointDiskFullError` naming the file; the temporary is removed. The file holds
    the checksum of every tensor of `state` (:func:`tensor_checksums`)."""

    payload = {
        "format": GALORE_STATE_FORMAT,
        "global_step": None if global_step is None else int(global_step),
        "optimizer": optimizer_name,
        "config": config.to_dict(),
        "state": state,
        "checksums": tensor_checksums(state),
    }
    write_atomically(path, lambda handle: torch.save(payload, handle))


def read_galore_checkpoint(
    path: str, *, checkpoint: Optional[str] = None, advice: Optional[str] = None
) -> dict[str, Any]:
    """Read ``galore_state.pt``; returns the dict :func:`save_galore_checkpoint` wrote.

    An unreadable file, or one without this format's marker (``"format"``: nothing else says which step,
    settings and optimizer its tensors belong to), raises :class:`GaLoreCheckpointError` naming the file
    and its checkpoint (and `advice`, else a resume's).
    """
    where = f"checkpoint {checkpoint}" if checkpoint else f"file {path}"
    try:
        size = os.path.getsize(path)
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - every reader failure means the same to the user
        # The loader's own text may recommend weights_only=False (running arbitrary pickled code):
        # never pass that on. Its first line without that advice is enough to tell the cause.
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights_only" in cause:
            cause = "it does not hold plain tensors and values (GaLore's own format)"
        raise GaLoreCheckpointError(
            f"GaLore state {path} ({size if 'size' in locals() else '?'} bytes) of {where} cannot be read: "
            f"{type(exc).__name__}: {cause[:300]}. The file is truncated or damaged (a copy that did not "
            "finish, a damaged disk, or it was replaced after the checkpoint was written). "
            + (advice or "Resume from an earlier complete checkpoint of this run, or restore this file.")
        ) from None
    if isinstance(loaded, dict) and loaded.get("format") == GALORE_STATE_FORMAT:
        return loaded
    raise GaLoreCheckpointError(
        f"GaLore state {path} of {where} is not a galore_state.pt written by hf_galore_plugin: found a "
        f"{type(loaded).__name__} with keys {sorted(loaded)[:5] if isinstance(loaded, dict) else '-'}, without "
        f"format {GALORE_STATE_FORMAT!r}, so nothing says which step and settings its tensors belong to. "
        + (
            advice
            or "Resume from a checkpoint whose files a GaLore run wrote together, or start a new run from the "
            "checkpoint's merged weights (from_pretrained of the checkpoint folder)."
        )
    )


def _saved_global_step(folder: str) -> Optional[int]:
    """The step of the checkpoint's own ``trainer_state.json``, or None where it has none (or not readable)."""
    path = os.path.join(folder, "trainer_state.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as handle:
            return int(json.load(handle)["global_step"])
    except (ValueError, KeyError, TypeError, OSError):
        return None


def read_checkpoint_state(
    folder: str,
    prepared: Optional[nn.Module] = None,
    optimizer_name: Optional[str] = None,
    *,
    optimizer_aliases: Optional[dict[str, str]] = None,
    advice: Optional[str] = None,
) -> dict[str, Any]:
    """Read and check checkpoint `folder`'s ``galore_state.pt``: its step against the checkpoint's own
    ``trainer_state.json``, its settings against the model's (:data:`FIXED_FIELDS` refused, the others
    returned as changes), its counters against the schedule, its tensors against their checksums, its
    optimizer name against `optimizer_name` (None: the run trains with an optimizer of its own, nothing to
    compare; `optimizer_aliases` maps a name to the name whose optimizer it runs, so a checkpoint of either
    resumes under the other). A refusal ends with `advice` (else a resume's). Returns the file's dict plus
    ``"changed"``."""
    path = os.path.join(folder, GALORE_STATE_NAME)
    if not os.path.isfile(path):
        raise GaLoreCheckpointError(
            f"checkpoint {folder} has no {GALORE_STATE_NAME}: the GaLore layers (base weight, factor, basis, "
            "counters) cannot be restored exactly. "
            + (
                advice
                or "Resume from a checkpoint written by a GaLore run, or start a new run from the merged model "
                "with from_pretrained."
            )
        )
    payload = read_galore_checkpoint(path, checkpoint=folder, advice=advice)
    step = _saved_global_step(folder)
    if step is not None and step != payload["global_step"]:
        raise GaLoreCheckpointError(
            f"{path} belongs to step {payload['global_step']}, but checkpoint {folder} is step {step} "
            f"(trainer_state.json): the file was copied from another checkpoint or left by another run. "
            + (advice or "Resume from a checkpoint whose files were written together.")
        )
    payload["changed"] = {}
    if prepared is not None:
        payload["changed"] = compare_galore_config(
            payload["config"], prepared_state(prepared).config, where=f"checkpoint {folder}", advice=advice
        )
        check_galore_counters(
            prepared,
            payload["state"],
            payload["config"],
            global_step=step if step is not None else payload["global_step"],
            where=f"checkpoint {folder} ({GALORE_STATE_NAME})",
            advice=advice,
        )
    check_tensor_checksums(payload, where=path, advice=advice)
    aliases = optimizer_aliases or {}
    saved_name, name = payload["optimizer"], optimizer_name
    if name is not None and saved_name is not None and aliases.get(saved_name, saved_name) != aliases.get(name, name):
        raise GaLoreCheckpointError(
            f"checkpoint {folder} was trained with optim={saved_name!r}, this run uses optim={name!r}: "
            "the optimizer state and GaLore layers differ between them. "
            + (advice or f"Resume with optim={saved_name!r}, or start a new run from the merged model.")
        )
    return payload


def _tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's dtype, shape and bytes (row-major), read in place from CPU memory."""
    value = tensor.detach()
    if value.device.type != "cpu":
        value = value.cpu()
    value = value.contiguous()
    crc = zlib.crc32(f"{value.dtype}{tuple(value.shape)}".encode())
    nbytes = value.numel() * value.element_size()
    if nbytes:
        crc = zlib.crc32((ctypes.c_char * nbytes).from_address(value.data_ptr()), crc)
    return crc


def tensor_checksums(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """{key: CRC-32 of the tensor's dtype, shape and bytes} for every tensor of `state`: what
    ``galore_state.pt`` holds beside its tensors, so that damage to any of them is seen without the
    checkpoint's manifest. The tensors are hashed by a thread pool (zlib releases the GIL on large ones)."""
    keys = list(state)
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        return dict(zip(keys, pool.map(lambda key: _tensor_crc32(state[key]), keys)))


def _listed(keys: list[str]) -> str:
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return ", ".join(f"state.{key}" for key in keys[:4]) + more


def check_tensor_checksums(payload: dict[str, Any], *, where: str, advice: Optional[str] = None) -> None:
    """Every tensor of a read ``galore_state.pt`` (`payload`, :func:`read_galore_checkpoint`) must have the
    checksum written with it, and the file the tensors written: else :class:`GaLoreCheckpointError` naming
    `where` and the tensors (and `advice`, else a resume's). A file written without checksums passes."""
    saved = payload.get("checksums")
    if saved is None:
        return
    state = payload["state"]
    if not isinstance(saved, dict):
        problems = [f"its checksums are a {type(saved).__name__}, not the table of its tensors"]
    else:
        now = tensor_checksums({key: value for key, value in state.items() if isinstance(value, torch.Tensor)})
        damaged = [key for key in now if key in saved and saved[key] != now[key]]
        damaged += [key for key in state if not isinstance(state[key], torch.Tensor)]
        added = [key for key in state if key not in saved]
        missing = [key for key in saved if key not in state]
        problems = [
            f"{label}: {_listed(keys)}"
            for label, keys in (
                ("tensors whose bytes differ from those written", damaged),
                ("tensors not written with the file", added),
                ("tensors written with the file and missing now", missing),
            )
            if keys
        ]
    if problems:
        raise GaLoreCheckpointError(
            f"{where} is damaged: "
            + "; ".join(problems)
            + f" (each tensor's CRC-32 was written with it; step {payload.get('global_step')}). The file changed "
            "after it was written (damaged on disk or in a copy, or edited), and its checkpoint's manifest, missing "
            "or rewritten since, did not catch it. "
            + (advice or "Resume from an earlier complete checkpoint of this run, or restore this file.")
        )


# The model file's tensors holding the merged weight `merged` of model key `key` ({file key: tensor}), or
# None where the layout cannot be told for this weight alone.
SavedLayout = Callable[[str, torch.Tensor], Optional[dict[str, torch.Tensor]]]


def check_merged_weights(
    model: nn.Module,
    checkpoint_weights: dict[str, torch.Tensor],
    folder: str,
    *,
    advice: Optional[str] = None,
    saved_layout: Optional[SavedLayout] = None,
) -> None:
    """The merged weight of every GaLore layer (expert stacks included) that the loaded GaLore state gives must
    be the one the checkpoint's model file holds (to rounding: both come from the same tensors when they
    belong together), and the file must hold it.

    `checkpoint_weights`: the model file's tensors, by key. `saved_layout`: where and how the file holds a
    merged weight (transformers writes some models' weights in their checkpoint layout: other names, an expert
    stack as one tensor per expert and projection); default: under the model's own key, as is. A layer whose
    layout it cannot tell (None) is not compared, and a warning names it. A refusal ends with `advice` (else a
    resume's)."""
    advice = advice or "Resume from a checkpoint whose files were written together."
    missing: list[str] = []
    not_compared: list[str] = []
    for layer_name, layer in iter_galore_layers_by_key(model):
        key = layer.merged_weight_key(layer_name)
        with torch.no_grad():
            loaded = layer.effective_weight(torch.float32)
            expected = {key: loaded} if saved_layout is None else saved_layout(key, loaded)
            if expected is None:
                not_compared.append(layer_name)
                continue
            absent = [name for name in expected if name not in checkpoint_weights]
            if absent:
                # The model file of a checkpoint holds every layer's merged weight: one it lacks is not witnessed.
                missing.append(f"{layer_name!r} ({', '.join(absent[:2])}{', ...' if len(absent) > 2 else ''})")
                continue
            if any(checkpoint_weights[name].is_meta for name in expected):
                continue  # loaded without data: nothing to compare
            diff = scale = 0.0
            rtol = 1e-5
            for name, value in expected.items():
                saved = checkpoint_weights[name]
                saved32 = saved.to(device=value.device, dtype=torch.float32)
                if saved32.shape != value.shape:
                    raise GaLoreCheckpointError(
                        f"checkpoint {folder}: the merged weight of layer {layer_name!r} is {tuple(saved32.shape)} "
                        f"in the model file ({name}), {tuple(value.shape)} by {GALORE_STATE_NAME}: they were not "
                        f"written together. {advice}"
                    )
                if saved.is_floating_point():
                    rtol = max(rtol, 2 * torch.finfo(saved.dtype).eps)
                scale = max(scale, float(saved32.abs().max()) if saved32.numel() else 0.0)
                diff = max(diff, float((value - saved32).abs().max()) if saved32.numel() else 0.0)
            if not diff <= rtol * max(scale, 1e-12):
                raise GaLoreCheckpointError(
                    f"checkpoint {folder}: its model file and {GALORE_STATE_NAME} disagree: the merged weight of "
                    f"{layer_name!r} they give differs by {diff:.3g} (largest weight {scale:.3g}). They were not "
                    "written together (one was left by another run in the same output_dir, or copied from another "
                    f"checkpoint), or one of them was damaged after they were written. {advice}"
                )
    if missing:
        raise GaLoreCheckpointError(
            f"checkpoint {folder}: its model file holds no merged weight of GaLore layer(s) {'; '.join(missing[:4])}"
            f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}, which a GaLore checkpoint holds beside "
            f"{GALORE_STATE_NAME}: it is not the model file written with it. {advice}"
        )
    if not_compared:
        logger.warning(
            "checkpoint %s: the merged weights of GaLore layer(s) %s were not compared with its model file: the "
            "model's checkpoint layout joins them with other weights, which this check does not rebuild",
            folder,
            not_compared[:4] + (["..."] if len(not_compared) > 4 else []),
        )
