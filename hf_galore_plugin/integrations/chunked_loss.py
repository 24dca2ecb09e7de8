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
"""

from __future__ import annotations

import logging
from typing import Any

from ..config import GaLoreConfig
from ..layers import GaLoreLinear
from ..loss import disable_chunked_loss, enable_chunked_loss

logger = logging.getLogger(__name__)

__all__ = ["configure_trainer_loss", "liger_fused_linear_cross_entropy"]


def liger_fused_linear_cross_entropy(args: Any) -> bool:
    """Whether the Trainer's Liger patch (``use_liger_kernel``) swaps in Liger's fused linear cross-entropy
    (its default; off with ``liger_kernel_config={"fused_linear_cross_entropy": False}``)."""
    if not getattr(args, "use_liger_kernel", False):
        return False
    return bool((getattr(args, "liger_kernel_config", None) or {}).get("fused_linear_cross_entropy", True))


def _output_head(model: Any) -> Any:
    model = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if callable(get_head) else None


def configure_trainer_loss(trainer: Any, config: GaLoreConfig) -> None:
    """Make a constructed Trainer's loss match `config` (see the module docstring)."""
    model = getattr(trainer, "model", None)
    if model is None:  # model_init: the model is built and prepared at train()
        return
    args = trainer.args
    liger = liger_fused_linear_cross_entropy(args)
    if liger and isinstance(_output_head(model), GaLoreLinear):
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
