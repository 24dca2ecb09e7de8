"""Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", arXiv 2502.16982) on GaLore factors, AdamW on
every other parameter: one optimizer, one state dict.

The rule is ``torch.optim.Muon``'s, with its defaults (momentum 0.95, Nesterov, 5 quintic Newton-Schulz steps
with coefficients (3.4445, -4.7750, 2.0315), eps 1e-7, the iteration in bfloat16) and its "match_rms_adamw"
rate, so a rate tuned for AdamW carries over. Per Muon parameter and step (fp32 arithmetic, fp64 for an fp64
parameter; a bf16 / fp16 parameter steps in an fp32 copy, its momentum is fp32):

- M = mu M + (1 - mu) g (torch's momentum: an average; Newton-Schulz normalises its input, so the (1 - mu) is a
  constant factor that does not change the update); the matrix orthogonalised is (1 - mu) g + mu M with
  ``nesterov``, else M.
- O = NS(that matrix): divided by its Frobenius norm (at least eps), transposed to wide if it is tall, then
  ``ns_steps`` times X <- a X + (b A + c A^2) X with A = X X^T, in ``ns_dtype``. The result is close to U V^T of
  the matrix's SVD (singular values between about 0.7 and 1.2 rather than 1: torch's note).
- p <- p (1 - lr weight_decay), then p <- p - lr 0.2 sqrt(max(rows, cols)) O: an m x k matrix of singular values
  near 1 has RMS about 1 / sqrt(max(m, k)), so the step's RMS is about 0.2 lr, AdamW's typical update RMS.

A tensor of more than 2 dimensions (an expert stack's E x m x r factor) is a batch of matrices (the last two
dimensions), each orthogonalised on its own. Which groups step by Muon: a group's ``"muon"`` key, by default its
``"galore"`` flag (the factor groups of ``hf_galore_plugin.create_optimizer``); every other group steps by AdamW
(``betas``, ``eps``; the arithmetic of ``optim.functional.adamw_step_fp32``, torch's single-tensor AdamW), as
Muon is used in practice for embeddings, norms, the output head, biases and layers GaLore does not project.

On a GaLore factor B (W = W0 + s B Q^T, Q n x r orthonormal): the factor's gradient is s G Q and its momentum s
M_G Q, with M_G the momentum of the projected dense gradient G Q Q^T. NS commutes with a right factor with
orthonormal columns (NS(X Q^T) = NS(X) Q^T: X X^T is unchanged and every term ends in X), and is invariant to a
positive scale of its input (up to eps), so the weight moves by s lr 0.2 sqrt(max(m, r)) NS(M_G Q) Q^T: Muon on
the dense weight restricted to the subspace, with the step scaled by s. GaLore's ``scale='auto'`` (sqrt(n / r))
makes the step's RMS torch's Muon's of a full-rank gradient. The rate adjustment uses the factor's shape, which
equals the dense weight's max(m, n) under ``proj_type='std'`` (the basis projects the smaller side). A left basis
(W = W0 + s P B) is the mirror image.

State per Muon parameter: "momentum_buffer" (fp32 or fp64 as above, the parameter's shape; torch's key). Per AdamW parameter:
"step" (int), "exp_avg", "exp_avg_sq" (fp32). Plain tensors and numbers, so ``torch.load(weights_only=True)``
works.

Under FSDP2 a parameter is a DTensor sharded on rows (``Shard(0)``, replicated over any other mesh dimension),
and so is its state (DTensors placed like it: distributed checkpoints reshard them). The orthogonalisation needs
the whole matrix: each rank forms the matrix to orthogonalise on its own rows, all-gathers it (one m x r matrix
per factor and step, the size of the factor), runs the same Newton-Schulz on the same input as every other rank,
and keeps its own rows of the result; the momentum stays sharded. An expert stack sharded on its expert
dimension holds whole matrices and orthogonalises them where they are. The AdamW groups step each rank's shard
(elementwise).

An engine's 1-D slice (FSDP1's views with ``use_orig_params=True``; DeepSpeed ZeRO's flat partitions) steps by
the fragments its engine registered on it (``engines.fragments``: elements [start, stop) of each matrix
flattened row-major, possibly none), one by one in the order every rank shares: the momentum of the local
elements, then one all-reduce of the matrix to orthogonalise (zeros outside each rank's elements), the same
Newton-Schulz on every rank, and the local elements of the result at the whole matrix's rate. Whether the slice
steps at all is decided once per slice and step by one all-reduced flag (`engines.fragments.any_rank`: a rank
without elements has no gradient where the others have one; skipping follows the flag, never a local None, so
every rank makes the same collectives). Cost: one all-reduce of the factor's size per factor and step, and one
flag (a host sync) per slice. The momentum is a 1-D tensor of the slice's shape (elementwise, sharded as the slice is); a rank
without elements keeps none. In ``state_dict`` every registered slice carries the momentum and AdamW's moments
(the keys it lacks as zeros without memory, dropped by ``load_state_dict``): FSDP1's optimizer state dict needs
the same elementwise keys on every parameter of a unit. 'project' is refused there (``engines.capabilities``);
'reset' of some experts zeroes their elements. A 1-D tensor without registered fragments is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import torch

from hf_galore_plugin.engines.basis import LINEAR, BasisChange
from hf_galore_plugin.engines.collectives import check_matrix_layout, gather_rows, is_dtensor, local_rows, local_shard
from hf_galore_plugin.engines.fragments import (
    expert_elements,
    any_rank,
    fragments_of,
    gather_fragment,
    is_placeholder,
    uniform_elementwise_state,
)
from hf_galore_plugin.optim.functional import adamw_step_fp32

__all__ = ["Muon", "MUON_STATE_KEYS", "NS_COEFFICIENTS", "newton_schulz", "rms_matching_factor"]

MUON_STATE_KEYS = ("momentum_buffer",)
_ADAMW_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")
# The quintic's coefficients (Keller Jordan's, torch.optim.Muon's): the slope at zero is maximised so that 5
# steps lift small singular values towards 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def newton_schulz(
    matrix: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The approximate orthogonalisation of `matrix` (2-D, or a batch over leading dimensions) by `steps`
    quintic Newton-Schulz iterations in `dtype`; the result has `dtype`.

    A 2-D input runs the same operations in the same order as ``torch.optim.Muon``'s iteration (``addmm``), so
    in bfloat16 the two agree bit for bit on one machine."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        # X X^T is then the smaller Gram matrix.
        x = x.mT
    if x.dim() == 2:
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        shape = x.shape
        x = x.reshape(-1, *shape[-2:])
        x = x / torch.linalg.matrix_norm(x, keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        x = x.reshape(shape)
    return x.mT if tall else x


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    if value not in _NS_DTYPES:
        raise ValueError(
            f"Muon: ns_dtype={value!r} is invalid; use one of torch.bfloat16 (torch.optim.Muon's), torch.float16, "
            "torch.float32, torch.float64"
        )
    return value


def _check_group(group: dict[str, Any]) -> None:
    def bad(name: str, fix: str) -> ValueError:
        return ValueError(f"Muon: {name}={group[name]!r} is invalid; {fix}")

    if not float(group["lr"]) >= 0.0:
        raise bad("lr", "use a learning rate >= 0 (an AdamW rate: the update's RMS is matched to AdamW's)")
    if not float(group["weight_decay"]) >= 0.0:
        raise bad("weight_decay", "use a value >= 0")
    if not 0.0 <= float(group["momentum"]) < 1.0:
        raise bad("momentum", "use a value in [0, 1) (torch.optim.Muon: 0.95)")
    if not isinstance(group["nesterov"], bool):
        raise bad("nesterov", "use True (torch.optim.Muon's default) or False")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
        raise bad("ns_steps", "use an integer in [1, 100) (torch.optim.Muon: 5)")
    if len(group["ns_coefficients"]) != 3:
        raise bad("ns_coefficients", f"use three floats (a, b, c), e.g. {NS_COEFFICIENTS}")
    if not float(group["ns_eps"]) > 0.0:
        raise bad("ns_eps", "use a value > 0 (torch.optim.Muon: 1e-7)")
    group["ns_dtype"] = _dtype(group["ns_dtype"])
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= float(beta) < 1.0 for beta in betas):
        raise bad("betas", "use two AdamW coefficients in [0, 1), e.g. (0.9, 0.999)")
    if not float(group["eps"]) >= 0.0:
        raise bad("eps", "use AdamW's eps >= 0, e.g. 1e-8")


def _uses_muon(group: dict[str, Any]) -> bool:
    return bool(group.get("muon", group.get("galore", False)))


def _refuse_partitioned(param: torch.Tensor, building: bool = False) -> None:
    check_matrix_layout(
        param, optimizer="Muon", needs="Newton-Schulz needs the whole matrix", preset="galore_muon", building=building
    )
    for fragment in fragments_of(param) or ():
        if len(fragment.shape) < 2:
            raise RuntimeError(
                f"Muon: {fragment.name or 'a parameter'} of shape {tuple(fragment.shape)} is not a matrix; Muon "
                "orthogonalises matrices (GaLore factors). Step it in a group without 'muon' (AdamW)."
            )


def _zeros(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A zero state tensor of `param`'s shape in `dtype`: a DTensor placed like a DTensor `param`."""
    if is_dtensor(param):
        return torch.zeros_like(param, dtype=dtype)
    return torch.zeros(param.shape, dtype=dtype, device=param.device)


def rms_matching_factor(shape: torch.Size) -> float:
    """torch's "match_rms_adamw" factor of a matrix of `shape` (its last two dimensions): 0.2 sqrt(max(m, n))."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


class Muon(torch.optim.Optimizer):
    """Muon on the groups it orthogonalises (GaLore factor groups by default), AdamW on the others (module
    docstring); every keyword may be set per group.

    Args:
        lr: the rate of both rules (an AdamW rate: Muon's step is RMS-matched to AdamW's).
        weight_decay: decoupled, ``p *= 1 - lr * weight_decay`` in both rules.
        momentum, nesterov, ns_coefficients, ns_steps: torch.optim.Muon's.
        ns_eps: torch.optim.Muon's ``eps`` (the floor of the norm the iteration divides by).
        ns_dtype: the dtype of the iteration (torch.optim.Muon: bfloat16).
        betas, eps: AdamW's, for the groups that step by AdamW.

    A GaLore refresh changes the basis of a factor through `change_basis` (keep, reset, project).
    """

    basis_state_rules = {"momentum_buffer": LINEAR}
    # The factor groups keep a momentum only (no step count, no bias correction): an engine that restarts one
    # factor inside a flat partition (DeepSpeedGaLoreOptimizer) by zeroing its elements restarts it exactly.
    factor_step_count = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_steps: int = 5,
        ns_eps: float = 1e-7,
        ns_dtype: torch.dtype = torch.bfloat16,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "ns_steps": ns_steps,
            "ns_eps": ns_eps,
            "ns_dtype": ns_dtype,
            "betas": tuple(betas),
            "eps": eps,
        }
        _check_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["ns_coefficients"] = tuple(group["ns_coefficients"])
        group["betas"] = tuple(group["betas"])
        _check_group(group)
        if _uses_muon(group):
            for param in group["params"]:
                _refuse_partitioned(param, building=True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if _uses_muon(group):
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        lr, wd, mu = float(group["lr"]), float(group["weight_decay"]), float(group["momentum"])
        for param in group["params"]:
            if fragments_of(param) is not None:
                # An engine's 1-D slice (FSDP1, ZeRO): stepped whatever its local gradient, see _muon_fragments.
                self._muon_fragments(param, group)
                continue
            if param.grad is None:
                continue
            _refuse_partitioned(param)
            if param.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            # A DTensor (FSDP2) steps its local rows with the local rows of its state.
            local = local_shard(param)
            # fp32 arithmetic, or the parameter's own where it is wider (fp64)
            dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
            grad = local_shard(param.grad).to(dtype)
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = _zeros(param, dtype)
            buf = local_shard(state["momentum_buffer"])
            buf.lerp_(grad, 1.0 - mu)
            direction = grad.lerp(buf, mu) if group["nesterov"] else buf
            # Row shards of a matrix: every rank orthogonalises the whole matrix and keeps its rows. A stack sharded
            # on its expert dimension holds whole matrices.
            gathered = is_dtensor(param) and param.dim() == 2
            if gathered:
                direction = gather_rows(direction, param)
            update = newton_schulz(
                direction,
                group["ns_steps"],
                group["ns_coefficients"],
                float(group["ns_eps"]),
                _dtype(group["ns_dtype"]),
            )
            if gathered:
                start, stop = local_rows(param)
                update = update[start:stop]
            work = local if local.dtype == dtype else local.to(dtype)
            work.mul_(1.0 - lr * wd)
            work.add_(update, alpha=-lr * rms_matching_factor(param.shape))
            if work is not local:
                local.copy_(work)

    def _muon_fragments(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        """One step of a 1-D tensor holding fragments of matrices (module docstring): per fragment, in the order
        every rank shares, the momentum of the local elements, one all-reduce of the matrix to orthogonalise, the
        same Newton-Schulz on every rank, the local elements of the result; nothing where no rank has a gradient."""
        _refuse_partitioned(param)
        lr, wd, mu = float(group["lr"]), float(group["weight_decay"]), float(group["momentum"])
        dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
        if param.grad is not None and param.grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        # No local gradient (FSDP1: no local elements): zeros; the parameter steps where any rank has a gradient
        # (one process would skip it where none has), decided alike on every rank.
        fragments = fragments_of(param) or ()
        if not any_rank(param.grad is not None, fragments, param.device):
            return
        grad = torch.zeros(param.numel(), dtype=dtype, device=param.device)
        if param.grad is not None:
            grad = param.grad.reshape(-1).to(dtype)
        state = self.state[param]
        # A rank without local elements keeps no state (there is nothing of it to step); its all-reduces are
        # zeros. FSDP1's optimizer state dict gives such a rank no state either.
        if param.numel() and "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros(param.shape, dtype=dtype, device=param.device)
        buf = state["momentum_buffer"].view(-1) if param.numel() else grad
        local = param.data.view(-1)
        for fragment in fragments:
            g, b = fragment.local(grad), fragment.local(buf)
            b.lerp_(g, 1.0 - mu)
            direction = g.lerp(b, mu) if group["nesterov"] else b
            whole = gather_fragment(direction, fragment)  # the matrix on every rank
            update = newton_schulz(
                whole.view(fragment.shape),
                group["ns_steps"],
                group["ns_coefficients"],
                float(group["ns_eps"]),
                _dtype(group["ns_dtype"]),
            ).reshape(-1)[fragment.start : fragment.stop]
            target = fragment.local(local)
            work = target if target.dtype == dtype else target.to(dtype)
            work.mul_(1.0 - lr * wd)
            work.add_(update, alpha=-lr * rms_matching_factor(fragment.shape))
            if work is not target:
                target.copy_(work)

    def _adamw_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = (float(b) for b in group["betas"])
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError("Muon's AdamW does not support sparse gradients")
            state = self.state[param]
            if not state:
                state["step"] = 0
                state["exp_avg"] = _zeros(param, torch.float32)
                state["exp_avg_sq"] = _zeros(param, torch.float32)
            state["step"] = int(state["step"]) + 1
            # Elementwise: a DTensor (FSDP2) steps its local shard.
            adamw_step_fp32(
                local_shard(param), local_shard(param.grad), local_shard(state["exp_avg"]),
                local_shard(state["exp_avg_sq"]), step=state["step"], lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
            )  # fmt: skip

    def reset_state(self, param: torch.Tensor) -> None:
        """Forget `param`'s state: its next step starts from a zero momentum."""
        self.state.pop(param, None)

    def initialize_state(self) -> None:
        """Give every trainable parameter without state its zero state, without stepping (a zero momentum, AdamW's
        step 0): for loaders that fill the optimizer's existing state in place (FSDP1's sharded checkpoint through
        accelerate). A zero state steps exactly as a missing one. A registered 1-D slice without local elements
        keeps none (as its step does)."""
        for group in self.param_groups:
            for param in group["params"]:
                if not param.requires_grad or self.state.get(param):
                    continue
                if _uses_muon(group):
                    if fragments_of(param) is not None and not param.numel():
                        continue
                    dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
                    self.state[param]["momentum_buffer"] = _zeros(param, dtype)
                else:
                    self.state[param].update(
                        step=0, exp_avg=_zeros(param, torch.float32), exp_avg_sq=_zeros(param, torch.float32)
                    )

    @torch.no_grad()
    def change_basis(
        self,
        param: torch.Tensor,
        *,
        left: Optional[torch.Tensor] = None,
        right: Optional[torch.Tensor] = None,
        policy: str,
        experts: Optional[torch.Tensor] = None,
    ) -> None:
        """`param`'s GaLore basis changed (`hf_galore_plugin.engines.basis`): 'keep' leaves the momentum, 'reset'
        drops it (for some experts of a stack: their rows restart at zero), 'project' moves it into the new
        coordinates exactly (T^T M, M T): the momentum is a linear function of past gradients. No-op before the
        first step."""
        change = BasisChange(policy=policy, left=left, right=right, experts=experts).for_state(
            lambda: self.reset_state(param)
        )
        if change is None:
            return
        state = self.state.get(param)
        fragments = fragments_of(param)
        if fragments is not None:
            # An engine's 1-D slices: a reset of some experts zeroes their local elements; 'project' is refused
            # before the first step by the engines that hand the optimizer such slices
            # (engines.capabilities.check_moment_handling).
            if policy != "reset" or experts is None:
                raise RuntimeError(
                    f"Muon: moment_handling={policy!r} cannot move the momentum of a parameter held as 1-D slices "
                    "(FSDP1, DeepSpeed ZeRO); use moment_handling='keep' or 'reset'"
                )
            if state and "momentum_buffer" in state:
                for fragment in fragments:
                    fragment.local(state["momentum_buffer"].view(-1))[expert_elements(fragment, experts)] = 0.0
            return
        if state and "momentum_buffer" in state:
            state["momentum_buffer"].copy_(change.apply(state["momentum_buffer"], LINEAR, param))

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with each group's ``ns_dtype`` as its name ("bfloat16"): distributed checkpoints
        (DCP) hold numbers, strings and tensors only. `load_state_dict` takes either."""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            group["ns_dtype"] = str(_dtype(group["ns_dtype"])).removeprefix("torch.")
        # Registered 1-D slices (FSDP1): every one carries the momentum and AdamW's moments (the keys it lacks as
        # zeros without memory, dropped by the loader), as FSDP1's optimizer state dict needs of a unit.
        params = [p for g in self.param_groups for p in g["params"]]
        uniform_elementwise_state(state_dict["state"], dict(enumerate(params)))
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, except every state tensor keeps its saved dtype (the fp32 momentum of a bf16 parameter
        stays fp32): torch casts floating state to the parameter's dtype."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        saved = {p: state_dict["state"][i] for i, p in zip(saved_ids, params) if i in state_dict["state"]}
        super().load_state_dict(state_dict)
        kept: dict[int, tuple[str, ...]] = {}
        for group in self.param_groups:
            group["ns_coefficients"] = tuple(group["ns_coefficients"])
            group["betas"] = tuple(group["betas"])
            group["ns_dtype"] = _dtype(group["ns_dtype"])
            for param in group["params"]:
                kept[id(param)] = MUON_STATE_KEYS if _uses_muon(group) else _ADAMW_STATE_KEYS
        for param, values in saved.items():
            # A registered 1-D slice's state dict carries every elementwise key of its unit (state_dict): only
            # its own rule's are state.
            own = kept[id(param)] if fragments_of(param) is not None else tuple(values)
            # (a ZeRO checkpoint loads before its flats are registered: the placeholders go by their layout)
            self.state[param] = {
                key: value.to(device=param.device) if isinstance(value, torch.Tensor) else value
                for key, value in values.items()
                if key in own and not is_placeholder(value)
            }

    def state_nbytes(self) -> int:
        """Bytes of every state tensor this process holds (local shards of DTensors)."""
        return sum(
            local_shard(v).numel() * v.element_size() for state in self.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)
        )  # fmt: skip
