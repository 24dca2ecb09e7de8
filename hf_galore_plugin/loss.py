"""Chunked linear cross-entropy: the causal-LM loss without the full logits.

The loss of a causal LM is ``cross_entropy(head(h), y)`` over N tokens and a vocabulary of V: the plain
path forms the N x V logits, their fp32 copy and the cross-entropy's N x V temporaries (at seq 2048 and a
128k vocabulary: 0.98 GiB per fp32 copy, about 3 GiB in all). Here the tokens are taken ``chunk_tokens`` at
a time; for each chunk the forward computes the logits, the loss and at once the gradient of the loss with
respect to the logits (softmax minus the smoothed one-hot target), pushes it through the head (dH for the
chunk's rows, the head's parameter gradients accumulated over chunks) and frees the chunk. The backward only
scales the stored gradients by the incoming gradient. Memory: O(chunk_tokens x V) instead of O(N x V); work:
the same three matmuls as the plain path (no recomputation).

Two ways through the head:

- a plain ``nn.Linear`` (the usual untied head): its weight and bias directly; the weight gradient is
  accumulated in place (``addmm_``) in the compute dtype, so no V x H temporary is formed per chunk;
- any other module (a :class:`~hf_galore_plugin.layers.GaLoreLinear` head, a wrapper): through the module's
  own forward and autograd, per chunk (``torch.autograd.grad``), accumulating the gradients of its trainable
  parameters in fp32 (for a GaLore head: the small factor). The module's backward runs inside this loss's
  forward, so a GaLore head's refresh record (gradient or sketch) is taken there, of the gradient of this
  loss divided by its denominator: every micro-batch of a step carries the same outer factor (gradient
  accumulation, loss scaling), which leaves the recorded subspace unchanged.

:func:`enable_chunked_loss` installs it on a Hugging Face causal LM (no transformers import: the model is
used through ``get_output_embeddings()`` and its ``forward``'s ``labels``): a training call (labels given,
autograd enabled) computes exactly what transformers' ``ForCausalLMLoss`` computes (labels shifted by one,
``ignore_index``, ``num_items_in_batch``, ``shift_labels``) plus optional label smoothing (what the
Trainer's ``LabelSmoother`` computes), and returns ``logits=None``; every other call is the model's own.

A batch with nothing to predict (every target ``ignore_index``) behaves as in transformers' loss: its loss is
``0 / denominator`` (NaN where the denominator is 0: the mean of no rows, or ``num_items_in_batch=0``) and every
gradient is exactly zero, so training goes on. Such a batch is logged once per process (a warning read from the
device without a sync, see :class:`_NothingToPredictWatch`).
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = [
    "linear_cross_entropy",
    "LinearCrossEntropyFunction",
    "default_chunk_tokens",
    "enable_chunked_loss",
    "disable_chunked_loss",
    "chunked_loss_settings",
    "output_head",
    "ChunkedLossForward",
    "CHUNK_ELEMENTS",
]

logger = logging.getLogger(__name__)

# The default chunk holds at most this many logits: 128 MiB as fp32, whatever the vocabulary (256 tokens at
# 128k, 1048 at 32k). Large enough that each chunk's matmuls run at full GEMM speed, small enough that a few
# chunk-sized fp32 buffers stay a fraction of a GiB.
CHUNK_ELEMENTS = 1 << 25

# Model configs whose logits are not the head's output (a transform follows the head): the chunked loss
# computes cross_entropy(head(h)) and would silently drop the transform, so such models are refused.
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,  # Gemma 2/3: tanh soft-capping
    "logit_scale": 1.0,  # Cohere: logits * logit_scale
    "logits_scaling": 1.0,  # Granite: logits / logits_scaling
}


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk when none are given: as many as keep one chunk's fp32 logits within CHUNK_ELEMENTS."""
    return max(1, CHUNK_ELEMENTS // max(1, int(vocab_size)))


def _check_chunk_tokens(chunk_tokens: Optional[int]) -> None:
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):  # fmt: skip
        raise ValueError(
            f"chunk_tokens={chunk_tokens!r} is invalid: use a positive number of tokens per chunk, or None for "
            f"{CHUNK_ELEMENTS} // vocab_size"
        )


def _check_label_smoothing(label_smoothing: float) -> None:
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing must be a float in [0, 1), got {label_smoothing!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r} is invalid: use a value in [0, 1) (0.1 is typical)")


def _host_readable(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s values are host memory this call may read: a plain CPU tensor, outside compilation
    (a fake tensor of the planner or a traced one has no values; reading a device tensor is a device sync)."""
    return type(tensor) is torch.Tensor and tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def _check_label_ids(targets: torch.Tensor, vocab: Optional[int], ignore_index: int) -> None:
    """Refuse target ids the loss cannot pick: negative ones other than ignore_index, and ids >= vocab.

    Checked where the ids are host memory (CPU labels, also those of a model on an accelerator before they are
    moved to it): reading them waits for nothing. Ids already on an accelerator are not read, as that would be a
    device sync on every step; an out-of-range id there fails in the logits' gather with a device-side assert,
    as it fails in transformers' loss (nll_loss's assert).
    """
    if not _host_readable(targets):
        return
    bad = (targets < 0) & (targets != ignore_index)
    if vocab is not None:
        bad |= targets >= vocab
    any_bad = bad.any()
    # A fake-tensor mode turns even a real tensor's results fake: nothing to read then. tolist, not item: a
    # read of host memory, not dispatched as the read of a device value.
    if type(any_bad) is not torch.Tensor or not any_bad.tolist():
        return
    values = torch.unique(targets[bad]).tolist()
    shown = ", ".join(str(v) for v in values[:8]) + (", ..." if len(values) > 8 else "")
    allowed = f"[0, {vocab})" if vocab is not None else ">= 0"
    raise ValueError(
        f"labels hold ids outside the output head's vocabulary {allowed}: {shown} at {int(bad.sum())} positions; "
        f"a label must be a token id in {allowed} or ignore_index={ignore_index} (nothing to predict). Set "
        f"padding and masked positions to {ignore_index}, and use a tokenizer that matches the model (after "
        "adding tokens: model.resize_token_embeddings(len(tokenizer)))"
    )


class _NothingToPredictWatch:
    """Logs once per process that a loss call had no target to predict, without a device sync.

    Each call hands in a 0-d boolean, "no target kept", on the targets' device. A CPU flag is host memory, read
    at once. A CUDA flag is copied without blocking into pinned host memory with an event recorded behind the
    copy, and read only once the event reports completion (``query()`` does not wait), at this or a later call:
    the warning may come a few steps late, and no call waits for the device. Flags of other devices and calls
    under CUDA-graph capture are not watched. Once it has warned, a call costs nothing; until then, one
    reduction over the targets (and on CUDA a one-byte copy and an event).
    """

    # At most this many CUDA flags wait: a device this far behind the host makes later calls skip the watch,
    # never wait for it.
    MAX_PENDING = 64

    def __init__(self) -> None:
        self.warned = False
        self.pending: deque[tuple[torch.Tensor, Any]] = deque()

    @staticmethod
    def watches(targets: torch.Tensor) -> bool:
        """Whether calls with these targets are watched: real tensors on the CPU or a CUDA device, outside
        compilation (a fake tensor of the planner or a traced one has no value to read)."""
        return (type(targets) is torch.Tensor and targets.device.type in ("cpu", "cuda")
                and not torch.compiler.is_compiling())  # fmt: skip

    def watch(self, nothing: torch.Tensor, ignore_index: int) -> None:
        if type(nothing) is not torch.Tensor:  # made fake by an active fake-tensor mode
            return
        if nothing.device.type == "cpu":
            self.pending.append((nothing, None))
        elif (nothing.device.type == "cuda" and len(self.pending) < self.MAX_PENDING
              and not torch.cuda.is_current_stream_capturing()):  # fmt: skip
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(nothing, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(nothing.device))
            self.pending.append((host, done))
        self.poll(ignore_index)

    def poll(self, ignore_index: int) -> None:
        while self.pending and not self.warned:
            host, done = self.pending[0]
            if done is not None and not done.query():
                return
            self.pending.popleft()
            if host.tolist():
                self.warned = True
                self.pending.clear()
                logger.warning(
                    "chunked loss: a batch has no token to predict, every target is ignore_index=%d (e.g. a "
                    "prompt longer than max_length, its answer cut off, or a sequence of length 1). Its "
                    "gradients are zero, so training goes on; its loss is NaN where nothing else in the step "
                    "has a target (0 / 0, as in transformers' loss; the Trainer logs it as 0.0). Drop such "
                    "examples from the data. This warning is shown once per process.",
                    ignore_index,
                )


_NOTHING_TO_PREDICT = _NothingToPredictWatch()


# ---------------------------------------------------------------------- the per-chunk math
def _cross_entropy_rows_(
    z: torch.Tensor, targets: torch.Tensor, label_smoothing: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of fp32 logits `z` (c x V) and, in place in `z`, its gradient with respect to
    the logits (softmax(z) - (1 - eps) one_hot(target) - eps / V). Returns (row losses, valid rows as a
    boolean mask).

    Row loss = logsumexp(z) - (1 - eps) z[target] - eps mean(z): torch's cross_entropy with label_smoothing
    (and the Trainer's LabelSmoother). One c x V buffer: `z` itself becomes exp(z - max), then the softmax,
    then the gradient. Ignored rows (target == ignore_index) get loss and gradient zeroed by the caller, by
    selecting with the mask (not multiplying by it: 0 * inf is NaN, and the scale is inf where nothing in the
    batch is to be predicted).
    """
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(1)
    picked = z.gather(1, safe).squeeze(1)
    # The smoothing term reads z before it is overwritten (a length-c vector, computed only when used).
    smoothed = (1.0 - label_smoothing) * picked + label_smoothing * z.mean(1) if label_smoothing else picked
    peak = z.amax(1, keepdim=True)
    z.sub_(peak).exp_()
    total = z.sum(1, keepdim=True)
    rows = (peak + total.log()).squeeze(1) - smoothed
    z.div_(total)
    z.scatter_add_(1, safe, torch.full_like(picked, -(1.0 - label_smoothing)).unsqueeze(1))
    if label_smoothing:
        z.sub_(label_smoothing / z.shape[1])
    return rows, valid


@dataclass(frozen=True)
class _Spec:
    """The non-tensor arguments of one chunked loss call."""

    chunk_tokens: int
    label_smoothing: float
    ignore_index: int
    # None: the head is a plain nn.Linear used through its weight and bias; else the head's forward.
    head_forward: Optional[Callable[[torch.Tensor], torch.Tensor]]


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


class LinearCrossEntropyFunction(torch.autograd.Function):
    """sum over rows of cross_entropy(head(hidden), targets) * inv_denominator, chunk by chunk (module docstring).

    Inputs: hidden (N x H), targets (N), inv_denominator (0-d fp32), a :class:`_Spec`, the head's weight and
    bias (plain path; None otherwise) and the head's trainable parameters (module path). Gradients are
    computed in the forward and scaled by the incoming gradient in the backward.
    """

    @staticmethod
    def forward(ctx, hidden, targets, inv_denominator, spec: _Spec, weight, bias, *params):
        needs = ctx.needs_input_grad
        # Any: each of these is set (not None) exactly on the branches that use it, which mypy cannot follow.
        head_forward: Any = spec.head_forward
        plain = head_forward is None
        want_hidden = needs[0]
        grad_hidden: Any = torch.empty_like(hidden) if want_hidden else None
        grad_weight: Any = None
        grad_bias: Any = None
        param_grads: list[Optional[torch.Tensor]] = []
        w: Any = None
        b: Any = None
        if plain:
            dtype = _compute_dtype(weight)
            # One cast for the whole loop where autocast computes in a lower precision (what autocast's own
            # weight-cast cache holds in the plain path); no copy otherwise.
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            if needs[4]:
                # Accumulated in place over chunks in the compute dtype (addmm_: one rounding per chunk, as
                # gradient accumulation over micro-batches rounds once per micro-batch).
                grad_weight = torch.zeros_like(w)
            if bias is not None and needs[5]:
                grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        else:
            # The head's trainable parameters (a GaLore factor: small): their chunk gradients summed in fp32.
            param_grads = [torch.zeros_like(p, dtype=torch.float32) if needs[6 + i] else None
                           for i, p in enumerate(params)]  # fmt: skip
        wanted = [p for p, g in zip(params, param_grads) if g is not None]
        any_grad = want_hidden or grad_weight is not None or grad_bias is not None or bool(wanted)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        n = hidden.shape[0]
        for start in range(0, n, spec.chunk_tokens):
            stop = min(start + spec.chunk_tokens, n)
            h = hidden[start:stop]
            if plain:
                with torch.autocast(hidden.device.type, enabled=False):
                    h = h.to(w.dtype)
                    logits = F.linear(h, w, b)
                # An fp32 head's logits are this chunk's own buffer: the math runs in it, in place.
                z = logits if logits.dtype == torch.float32 else logits.float()
                del logits
            else:
                h_in = h.detach().requires_grad_(want_hidden)
                with torch.enable_grad():
                    logits = head_forward(h_in)
                # The module's output stays the root of its autograd graph: the math runs in a copy.
                z = logits.detach().to(torch.float32, copy=True)
            rows, valid = _cross_entropy_rows_(z, targets[start:stop], spec.label_smoothing, spec.ignore_index)
            total = total + torch.where(valid, rows, 0.0).sum()
            if not any_grad:
                continue
            # d(loss)/d(logits) of this chunk: divided by the loss's denominator, ignored rows exactly zero. A
            # select, not valid * inv_denominator: a batch with nothing to predict has denominator 0 and
            # 0 * inf would make its gradients NaN, where transformers' loss gives zeros.
            z.mul_(torch.where(valid, inv_denominator, 0.0).unsqueeze(1))
            if plain:
                dz = z.to(w.dtype)
                with torch.autocast(hidden.device.type, enabled=False):
                    if want_hidden:
                        grad_hidden[start:stop] = dz @ w
                    if grad_weight is not None:
                        grad_weight.addmm_(dz.mT, h)
                if grad_bias is not None:
                    grad_bias += z.sum(0)
                del dz
            else:
                dz = z.to(logits.dtype)
                inputs = ([h_in] if want_hidden else []) + wanted
                grads = list(torch.autograd.grad(logits, inputs, grad_outputs=dz, allow_unused=True))
                del logits, dz
                if want_hidden:
                    grad_hidden[start:stop] = grads.pop(0)
                accumulate = iter(grads)
                for g in param_grads:
                    if g is not None:
                        step = next(accumulate)
                        if step is not None:
                            g += step
            del z
        ctx.grads = (grad_hidden, grad_weight, grad_bias, param_grads)
        ctx.weight_dtype = weight.dtype if plain else None
        ctx.bias_dtype = bias.dtype if plain and bias is not None else None
        return total * inv_denominator

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias, param_grads = ctx.grads
        # Dropped before returning, so autograd can take the tensors over as .grad without a copy.
        ctx.grads = None
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(grad_loss).to(ctx.bias_dtype)
        params_out = [None if g is None else g.mul_(grad_loss) for g in param_grads]
        return (grad_hidden, None, None, None, grad_weight, grad_bias, *params_out)


def linear_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    num_items_in_batch: Any = None,
    chunk_tokens: Optional[int] = None,
    head_forward: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """``cross_entropy(head(hidden), targets)`` without forming all logits at once.

    hidden: (..., H); targets: (...) already aligned with hidden (no shift here), ``ignore_index`` rows left
    out. Reduction: the sum over the kept rows divided by ``num_items_in_batch`` when given (transformers'
    ``fixed_cross_entropy``), else their mean. `head`: a plain ``nn.Linear`` is used through its weight and
    bias; any other module through ``head_forward`` (default: calling the module), per chunk. The result
    equals the unchunked loss up to fp32 rounding, and so do the gradients of `hidden` and the head's
    trainable parameters. With no target kept the loss is ``0 / denominator`` (NaN for a mean, or for
    ``num_items_in_batch=0``) and every gradient is zero, as in transformers' loss; the first such call of the
    process logs a warning. Target ids outside ``[0, out_features)`` other than ``ignore_index`` raise a
    ValueError where they are host memory (see :func:`_check_label_ids`).
    """
    _check_chunk_tokens(chunk_tokens)
    _check_label_smoothing(label_smoothing)
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not align: targets must "
            "have the shape of hidden without its last dimension (shift causal-LM labels before calling)"
        )
    # nn.Linear and GaLoreLinear both name their output width out_features.
    vocab: Optional[int] = getattr(head, "out_features", None)
    _check_label_ids(targets, vocab, ignore_index)
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    targets1 = targets.reshape(-1).to(hidden.device)
    plain = type(head) is nn.Linear
    if chunk_tokens is None:
        if vocab is None:
            raise ValueError(
                f"chunk_tokens is needed for a head of type {type(head).__name__} (no out_features to size the "
                "chunks from)"
            )
        chunk_tokens = default_chunk_tokens(vocab)
    if num_items_in_batch is None:
        denominator = (targets1 != ignore_index).sum().to(torch.float32)
    elif isinstance(num_items_in_batch, torch.Tensor):
        denominator = num_items_in_batch.to(device=hidden.device, dtype=torch.float32)
    else:
        denominator = torch.tensor(float(num_items_in_batch), device=hidden.device)
    inv_denominator = denominator.reciprocal()
    watch = _NOTHING_TO_PREDICT
    if not watch.warned and watch.watches(targets1):
        watch.watch((targets1 == ignore_index).all(), int(ignore_index))
    if plain:
        spec = _Spec(chunk_tokens, float(label_smoothing), int(ignore_index), None)
        return LinearCrossEntropyFunction.apply(hidden2, targets1, inv_denominator, spec, head.weight, head.bias)
    params: Sequence[torch.Tensor] = [p for p in head.parameters() if p.requires_grad]
    spec = _Spec(chunk_tokens, float(label_smoothing), int(ignore_index), head_forward or head)
    return LinearCrossEntropyFunction.apply(hidden2, targets1, inv_denominator, spec, None, None, *params)


# ---------------------------------------------------------------------- a causal LM's forward
@dataclass
class _Pending:
    """What a training call of the model hands to its head's forward (see ChunkedLossForward)."""

    targets: torch.Tensor
    num_items_in_batch: Any
    ignore_index: int
    loss: Optional[torch.Tensor] = None


class ChunkedLossForward:
    """The forward :func:`enable_chunked_loss` installs on a causal LM (an instance attribute, so the class and
    every other instance stay untouched; ``inspect.signature`` sees the model's own signature).

    A call with labels and autograd enabled runs the model's own forward with ``labels=None`` while the output
    head's ``forward`` is replaced, for that call only, by one that computes the chunked loss from the head's
    input (the final hidden states) and returns empty logits: the loss is computed inside the head's call, so
    hooks an engine put on the head (gathering its parameters) are active. The output carries the loss and no
    logits. Any other call (no labels, ``torch.no_grad()``, ``logits_to_keep``) is the model's own.
    """

    def __init__(self, model: nn.Module, chunk_tokens: Optional[int], label_smoothing: float) -> None:
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.label_smoothing = label_smoothing
        # A forward set on the instance before ours (accelerate's mixed-precision wrapper) is kept and called.
        self.inner = model.__dict__.get("forward")
        signature = inspect.signature(self._inner_forward())
        self.__signature__ = signature
        names = list(signature.parameters)
        self.labels_position = names.index("labels")

    def _inner_forward(self) -> Callable:
        # The class's forward is looked up at every call: a patch applied to the class later is honoured.
        return self.inner if self.inner is not None else type(self.model).forward.__get__(self.model)

    def __call__(self, *args, **kwargs):
        inner = self._inner_forward()
        args = list(args)
        labels = args[self.labels_position] if len(args) > self.labels_position else kwargs.get("labels")
        keep = kwargs.get("logits_to_keep", 0)
        if labels is None or not torch.is_grad_enabled() or not (isinstance(keep, int) and keep == 0):
            return inner(*args, **kwargs)
        if len(args) > self.labels_position:
            args[self.labels_position] = None
        else:
            kwargs["labels"] = None
        ignore_index = kwargs.get("ignore_index", -100)
        # Consumed here: the inner forward sees neither labels nor shift_labels and computes no loss of its own.
        targets = kwargs.pop("shift_labels", None)
        if targets is None:
            # transformers' ForCausalLMLoss: position i predicts label i + 1; the last position predicts nothing.
            targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        head = _required_head(self.model)
        own_forward = head.__dict__.get("forward")
        head_forward = own_forward if own_forward is not None else type(head).forward.__get__(head)
        pending = _Pending(targets, kwargs.get("num_items_in_batch"), ignore_index)

        def head_loss(hidden: torch.Tensor) -> torch.Tensor:
            pending.loss = linear_cross_entropy(
                hidden, head, pending.targets, ignore_index=pending.ignore_index,
                label_smoothing=self.label_smoothing, num_items_in_batch=pending.num_items_in_batch,
                chunk_tokens=self.chunk_tokens, head_forward=None if type(head) is nn.Linear else head_forward,
            )  # fmt: skip
            return hidden.new_empty(*hidden.shape[:-1], 0)

        head.forward = head_loss
        try:
            out = inner(*args, **kwargs)
        finally:
            if own_forward is not None:
                head.forward = own_forward
            elif torch.compiler.is_compiling():
                # Dynamo replays a set followed by a delete of an instance attribute as a delete of one that is
                # not there (AttributeError): compiled, the class's forward is put back as a bound method.
                head.forward = head_forward
            else:
                del head.forward
        if pending.loss is None:
            raise RuntimeError(
                f"chunked loss: {type(self.model).__name__}.forward did not call its output head "
                f"({type(head).__name__}) on the hidden states; disable_chunked_loss(model) for this model"
            )
        if isinstance(out, tuple):
            return (pending.loss, *out[1:])
        fields = {key: value for key, value in out.items() if key not in ("loss", "logits")}
        return type(out)(loss=pending.loss, **fields)


def output_head(model: nn.Module) -> Optional[nn.Module]:
    """The output head of a causal LM, ``get_output_embeddings()`` (of the base model under a peft wrapper);
    None where there is none: no such method, one that raises NotImplementedError or AttributeError (a model
    without a head), or one that returns something other than a module."""
    get_head = getattr(_causal_lm(model), "get_output_embeddings", None)
    if not callable(get_head):
        return None
    try:
        head = get_head()
    except (NotImplementedError, AttributeError):
        return None
    return head if isinstance(head, nn.Module) else None


def _required_head(model: nn.Module) -> nn.Module:
    head = output_head(model)
    if head is None:
        raise ValueError(
            f"chunked loss needs a causal LM with an output head: {type(model).__name__}.get_output_embeddings() "
            "gives no module"
        )
    return head


def _causal_lm(model: nn.Module) -> nn.Module:
    """The module whose forward takes labels: the model, or the base model of a peft wrapper."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def enable_chunked_loss(
    model: nn.Module, *, chunk_tokens: Optional[int] = None, label_smoothing: float = 0.0
) -> nn.Module:
    """Make training calls of a Hugging Face causal LM compute their loss chunk by chunk; returns `model`.

    ``model(input_ids=..., labels=...)`` with autograd enabled then returns the same loss as before (and the
    same gradients, up to fp32 rounding) with ``logits=None``, never forming the N x V logits. `chunk_tokens`:
    tokens per chunk (None: ``CHUNK_ELEMENTS // vocab_size``); `label_smoothing`: as the Trainer's
    ``label_smoothing_factor``. Calling it again changes the settings. :func:`disable_chunked_loss` undoes it.
    """
    _check_chunk_tokens(chunk_tokens)
    _check_label_smoothing(label_smoothing)
    target = _causal_lm(model)
    installed = target.__dict__.get("forward")
    if isinstance(installed, ChunkedLossForward):
        installed.chunk_tokens, installed.label_smoothing = chunk_tokens, float(label_smoothing)
        return model
    head = _required_head(target)
    name = type(target).__name__
    forward = target.__dict__.get("forward") or type(target).forward
    if "labels" not in inspect.signature(forward).parameters:
        raise ValueError(f"chunked loss: {name}.forward takes no `labels`; it applies to causal LMs (…ForCausalLM)")
    loss_function = getattr(target, "loss_function", None)
    loss_name = getattr(loss_function, "__name__", None)
    if loss_function is not None and loss_name != "ForCausalLMLoss":
        raise ValueError(
            f"chunked loss: {name} computes its loss with {loss_name or type(loss_function).__name__}, not "
            "transformers' ForCausalLMLoss, so the chunked loss would change what is trained; leave chunked_loss off"
        )
    config = getattr(target, "config", None)
    for key, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, key, neutral)
        if value is not None and value != neutral:
            raise ValueError(
                f"chunked loss: {name} transforms its logits after the head ({key}={value!r}), which the chunked "
                "loss does not apply; leave chunked_loss off for this model (use_liger_kernel=True has kernels "
                "for some of them)"
            )
    if not isinstance(head, nn.Linear) and getattr(head, "out_features", None) is None and chunk_tokens is None:
        raise ValueError(f"chunked loss: the head {type(head).__name__} has no out_features; pass chunk_tokens")
    target.forward = ChunkedLossForward(target, chunk_tokens, float(label_smoothing))
    return model


def disable_chunked_loss(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_chunked_loss` (a no-op for a model without it); returns `model`."""
    target = _causal_lm(model)
    installed = target.__dict__.get("forward")
    if isinstance(installed, ChunkedLossForward):
        if installed.inner is not None:
            target.forward = installed.inner
        else:
            del target.forward
    return model


def chunked_loss_settings(model: nn.Module) -> Optional[dict[str, Any]]:
    """``{"chunk_tokens": ..., "label_smoothing": ...}`` of a model with the chunked loss, else None."""
    installed = _causal_lm(model).__dict__.get("forward")
    if not isinstance(installed, ChunkedLossForward):
        return None
    return {"chunk_tokens": installed.chunk_tokens, "label_smoothing": installed.label_smoothing}
