"""What each engine can do with GaLore layers, and the one place that refuses what it cannot.

Every refusal comes from the table: a check names the engine, and the error text comes from the
engine's row, so one limitation reads the same wherever it is caught (at ``create_optimizer``, at an
engine adapter's construction, or at a refresh). docs/architecture.md ("Capabilities per engine")
describes each engine's layout and gathering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

__all__ = [
    "ENGINES",
    "EngineCapabilities",
    "CAPABILITIES",
    "UnsupportedByEngine",
    "check_moment_handling",
    "check_residual",
    "check_state_offload",
]

ENGINES = ("single", "ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3")


class UnsupportedByEngine(NotImplementedError, ValueError):
    """A GaLore setting the engine cannot run. Both a ValueError (a bad configuration) and a
    NotImplementedError (a limitation of this package), so either ``except`` catches it."""


@dataclass(frozen=True)
class EngineCapabilities:
    label: str
    # The engine keeps its own fp32 master copy of B: a refresh must tell it (EngineAdapter.param_changed).
    master_copy: bool
    # moment_handling='project': "all" layouts, "right" basis only, or "none".
    project_moments: Literal["all", "right", "none"]
    # Why 'project' is limited, and what to use instead (empty where it is not limited).
    project_reason: str = ""
    project_alternative: str = ""
    # Why state_offload='cpu' is refused, and what to use instead (empty where it runs).
    state_offload_reason: str = ""
    state_offload_alternative: str = ""
    # Why residual=True (Fira's residual, written into W0 in each layer's backward) is refused (empty where it runs).
    residual_reason: str = ""


_ZERO_REASON = "the moments of one factor are spread over ZeRO's flat partitions"
_ZERO_OFFLOAD_REASON = "ZeRO owns the optimizer state of its flat fp32 partitions and steps them itself"
_ZERO_RESIDUAL_REASON = (
    "the residual needs each factor's own Adam update from this package's AdamW, while ZeRO steps flat fp32 "
    "partitions itself, and ZeRO-3 partitions W0, which the residual writes in the backward"
)
_ZERO_OFFLOAD_ALTERNATIVE = (
    'DeepSpeed\'s own optimizer offload: "zero_optimization": {"offload_optimizer": '
    '{"device": "cpu", "pin_memory": true}} in the DeepSpeed config'
)


def _zero(label: str) -> EngineCapabilities:
    """A DeepSpeed ZeRO stage: fp32 master copy, optimizer state in flat partitions."""
    return EngineCapabilities(
        label=label,
        master_copy=True,
        project_moments="none",
        project_reason=_ZERO_REASON,
        state_offload_reason=_ZERO_OFFLOAD_REASON,
        state_offload_alternative=_ZERO_OFFLOAD_ALTERNATIVE,
        residual_reason=_ZERO_RESIDUAL_REASON,
    )


CAPABILITIES: dict[str, EngineCapabilities] = {
    "single": EngineCapabilities(
        label="a single process",
        master_copy=False,
        project_moments="all",
    ),
    "ddp": EngineCapabilities(
        label="DDP",
        master_copy=False,
        project_moments="all",
    ),
    "fsdp1": EngineCapabilities(
        label="FSDP1",
        master_copy=False,
        project_moments="none",
        project_reason=(
            "it transports the Adam moments with a 2-D change of coordinates, but FSDP1 keeps them as "
            "1-D slices of a flat shard"
        ),
        project_alternative="FSDP2 (fully_shard / accelerate fsdp_version: 2)",
        residual_reason=(
            "the residual is written into W0 in the backward, where FSDP1 holds an unsharded copy it discards, "
            "and the optimizer sees the factor as a 1-D slice whose Adam update has no rows"
        ),
    ),
    "fsdp2": EngineCapabilities(
        label="FSDP2",
        master_copy=False,
        project_moments="right",
        project_reason="the optimizer sees the factor's local rows only, and a left-basis transport mixes all rows",
        project_alternative="proj_type='right'",
        state_offload_reason="its optimizer state is DTensors placed like the sharded parameters",
        state_offload_alternative=(
            "FSDP2's own CPUOffloadPolicy (fully_shard(..., offload_policy=CPUOffloadPolicy()), or accelerate's "
            "fsdp_offload_params: true), which keeps parameters, gradients and optimizer state on the host"
        ),
        residual_reason=(
            "the residual is written into W0 in the backward, where FSDP2 holds an all-gathered copy of the "
            "sharded W0 it frees after the layer"
        ),
    ),
    "zero1": _zero("DeepSpeed ZeRO-1"),
    "zero2": _zero("DeepSpeed ZeRO-2"),
    "zero3": _zero("DeepSpeed ZeRO-3"),
}


def check_moment_handling(
    engine: str, *, moment_handling: str, left_basis: bool = True, layer: Optional[str] = None
) -> None:
    """Raise :class:`UnsupportedByEngine` when `engine` cannot run `moment_handling` for a layer
    (`left_basis`: the layer has a non-identity left basis)."""
    if engine not in CAPABILITIES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    caps = CAPABILITIES[engine]
    if moment_handling != "project" or caps.project_moments == "all":
        return
    if caps.project_moments == "right" and not left_basis:
        return
    subject = f"GaLore layer {layer!r}" if layer is not None else "GaLore"
    scope = " with a left basis" if caps.project_moments == "right" else ""
    alternative = f", or {caps.project_alternative}" if caps.project_alternative else ""
    raise UnsupportedByEngine(
        f"{subject}: moment_handling='project'{scope} is not supported under {caps.label}: {caps.project_reason}. "
        f"Use moment_handling='keep' (the default) or 'reset'{alternative}."
    )


def check_residual(engine: str, *, residual: bool, layer: Optional[str] = None) -> None:
    """Raise :class:`UnsupportedByEngine` when `engine` cannot run ``residual=True`` (Fira's residual)."""
    if engine not in CAPABILITIES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    caps = CAPABILITIES[engine]
    if not residual or not caps.residual_reason:
        return
    subject = f"GaLore layer {layer!r}" if layer is not None else "GaLore"
    raise UnsupportedByEngine(
        f"{subject}: residual=True is not supported under {caps.label}: {caps.residual_reason}. Use residual=False, "
        "or train in one process or under DDP."
    )


def check_state_offload(engine: str, *, state_offload: str) -> None:
    """Raise :class:`UnsupportedByEngine` when `engine` cannot run ``state_offload`` (the value given)."""
    if engine not in CAPABILITIES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    caps = CAPABILITIES[engine]
    if state_offload == "none" or not caps.state_offload_reason:
        return
    raise UnsupportedByEngine(
        f"state_offload={state_offload!r} is not supported under {caps.label}: {caps.state_offload_reason}. "
        f"Use state_offload='none' with {caps.state_offload_alternative}."
    )
