"""The Trainer's loss with ``chunked_loss=true``, label smoothing and Liger-Kernel.

Called once by the patched ``Trainer.__init__`` for the plugin's optimizer names, after the model was
prepared (``prepare_model`` installed the chunked loss when the config asks for it):

- label smoothing: the Trainer's ``LabelSmoother`` takes the labels away from the model and smooths the
  full logits; with the chunked loss the smoothing moves into the chunked loss (the same value:
  torch's ``cross_entropy(label_smoothing=...)`` summed over the kept tokens and divided by
  ``num_items_in_batch``, or their mean) and the Trainer's smoother is switched off;
- ``use_liger_kernel=True``: Liger replaces the model's forward by its own, whose fused linear
  cross-entropy reads ``lm_head.weight``. With a plain head that is the chunked loss done by Liger's GPU
  kernels: ours steps aside. With a GaLore head the weight Liger would read is W0 alone (the layer computes
  with W0 + scale * B Q^T; a quantized W0 has no ``weight`` at all): refused before training.
- TRL's trainers: SFT, DPO, KTO, GRPO, RLOO (TRL >= 1.15) compute their loss through TRL's fused LM head,
  the hidden states times ``get_output_embeddings().weight`` tile by tile, without calling the head; SFT of
  TRL 1.6-1.14 does the same under ``loss_type='chunked_nll'``, and the distillation trainer (TRL >= 1.10) always. With a
  GaLore head that weight is W0 alone: no gradient reaches the factor and the head never trains. Refused
  when the Trainer is built (:func:`check_head_weight_readers`), naming the head and the fix.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

from ..config import GaLoreConfig
from ..layers import GaLoreLinear
from ..loss import disable_chunked_loss, enable_chunked_loss, output_head

logger = logging.getLogger(__name__)

__all__ = ["check_head_weight_readers", "configure_trainer_loss", "liger_fused_linear_cross_entropy"]


def liger_fused_linear_cross_entropy(args: Any) -> bool:
    """Whether the Trainer's Liger patch (``use_liger_kernel``) swaps in Liger's fused linear cross-entropy
    (its default; off with ``liger_kernel_config={"fused_linear_cross_entropy": False}``)."""
    if not getattr(args, "use_liger_kernel", False):
        return False
    return bool((getattr(args, "liger_kernel_config", None) or {}).get("fused_linear_cross_entropy", True))


def configure_trainer_loss(trainer: Any, config: GaLoreConfig) -> None:
    """Make a constructed Trainer's loss match `config` (see the module docstring)."""
    model = getattr(trainer, "model", None)
    if model is None:  # model_init: the model is built and prepared at train()
        return
    args = trainer.args
    liger = liger_fused_linear_cross_entropy(args)
    if liger and isinstance(output_head(model), GaLoreLinear):
        raise ValueError(
            "use_liger_kernel=True swaps in Liger's fused linear cross-entropy, which computes the logits from "
            "lm_head.weight; the output head is a GaLore layer (target_modules selects it), whose weight is "
            "W0 + scale * B Q^T, so Liger would train against W0 alone. Either keep Liger and leave the head out "
            "of target_modules, or keep the GaLore head and pass liger_kernel_config="
            "{'fused_linear_cross_entropy': False} with optim_args chunked_loss=true (the plugin's chunked loss "
            "goes through the GaLore head)."
        )
    if not config.chunked_loss:
        return
    if liger:
        disable_chunked_loss(model)
        logger.info("chunked_loss=true: use_liger_kernel=True computes the loss with Liger's fused linear "
                    "cross-entropy instead (it never forms the logits either)")  # fmt: skip
        return
    smoother = getattr(trainer, "label_smoother", None)
    if smoother is not None:
        enable_chunked_loss(model, chunk_tokens=config.chunked_loss_tokens, label_smoothing=smoother.epsilon)
        trainer.label_smoother = None


# Module-level names by which a TRL trainer's module shows that its loss reads the output head's `.weight`
# (it defines or imports them): TRL's fused LM head (TRL >= 1.15: SFT, DPO, KTO, GRPO, RLOO); SFT's
# chunked cross-entropy of TRL 1.6-1.14, under loss_type='chunked_nll' only; the distillation loss (TRL >= 1.10).
_TRL_FUSED_HEAD = "add_fused_lm_head"
_TRL_CHUNKED_NLL = "_patch_chunked_ce_lm_head"
_TRL_DISTILLATION = "_chunked_divergence_loss"


def _trl_head_weight_reader(trainer: Any) -> Optional[str]:
    """How `trainer`'s loss reads the output head's ``.weight`` instead of calling the head, or None.

    The loss is the ``compute_loss`` of the first TRL class in the trainer's MRO that defines one (a user's
    subclass calling ``super().compute_loss`` reaches it; a TRL trainer that derives from another with its own
    loss, e.g. GKD from SFT, is judged by its own); the module of that class tells which loss it is."""
    for cls in type(trainer).__mro__:
        module_name = getattr(cls, "__module__", "") or ""
        if "compute_loss" not in vars(cls) or not (module_name == "trl" or module_name.startswith("trl.")):
            continue
        module = sys.modules.get(module_name)
        args = getattr(trainer, "args", None)
        if hasattr(module, _TRL_FUSED_HEAD):
            # SFTTrainer's deprecated loss paths (compute_loss_func; label smoothing of the 'nll' loss) compute
            # the loss from the model's own logits, through the head's forward; its fused head then feeds only
            # the metrics.
            if cls.__name__ == "SFTTrainer" and (
                getattr(trainer, "compute_loss_func", None) is not None
                or (getattr(trainer, "label_smoother", None) is not None and getattr(args, "loss_type", None) == "nll")
            ):
                return None
            return (
                f"{cls.__name__} computes its loss through TRL's fused LM head (trl add_fused_lm_head), which "
                "multiplies the hidden states by the head's .weight without calling the head"
            )
        if hasattr(module, _TRL_CHUNKED_NLL) and getattr(args, "loss_type", None) == "chunked_nll":
            return (
                f"{cls.__name__} with loss_type='chunked_nll' computes its loss by multiplying the hidden states "
                "by the head's .weight without calling the head; loss_type='nll' goes through the head's forward"
            )
        if hasattr(module, _TRL_DISTILLATION):
            return (
                f"{cls.__name__} computes its divergence loss by multiplying the hidden states by the head's "
                ".weight without calling the head"
            )
        return None
    return None


def check_head_weight_readers(trainer: Any) -> None:
    """Refuse a Trainer whose loss reads the output head's ``.weight`` while the head is a GaLore layer: that
    weight is W0 alone (the layer computes with W0 + scale * B Q^T), so no gradient reaches the factor and the
    head never trains (see the module docstring)."""
    model = getattr(trainer, "model", None)
    if model is None:  # model_init: the model is built and prepared at train()
        return
    head = output_head(model)
    if not isinstance(head, GaLoreLinear):
        return
    reader = _trl_head_weight_reader(trainer)
    if reader is None:
        return
    name = next((n for n, module in model.named_modules() if module is head), "lm_head")
    short = name.rsplit(".", 1)[-1]
    raise ValueError(
        f"TRL: {reader}. The output head {name!r} is a GaLore layer (target_modules selects it, e.g. "
        f"'all-linear'), whose .weight is its frozen W0 without the trained factor: the head would get no "
        f"gradient and stay at its initial weights. Leave the head out of GaLore: optim_args "
        f"'exclude_modules={short}' (with optim_target_modules='all-linear'), or optim_target_modules naming "
        "only the decoder's projections; the head then trains as a plain parameter."
    )
