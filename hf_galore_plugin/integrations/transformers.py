"""The patch table of the transformers integration: what is patched in each module, through one helper.

Installed by :mod:`hf_galore_plugin.integrations` when each module is imported (docs/architecture.md,
"What the transformers integration patches", lists every target and why). Each ``patch_*`` function
builds the targets of one module and applies them with :func:`~.patching.apply_patches`, all or nothing;
the replacements themselves live with their concern: :mod:`.names` (optimizer names), :mod:`.construction`
(``Trainer.__init__``, weight initialisation), :mod:`.saving`, :mod:`.loading` and :mod:`.engine_resume`.
"""

from __future__ import annotations

from typing import Any

from .construction import wrap_init, wrap_initialize_weights
from .engine_resume import wrap_deepspeed_load_checkpoint, wrap_load_optimizer_and_scheduler
from .loading import wrap_load_best_model, wrap_load_from_checkpoint, wrap_train
from .names import (
    optimizer_handler,
    optimizer_handler_table,
    register_optimizer_names,
    served_optimizer_names,
    wrap_optimizer_dispatch,
)
from .patching import PatchTarget, Required, apply_patches, internals_missing, patch_lock
from .saving import wrap_peft_save_pretrained, wrap_save_checkpoint, wrap_save_pretrained

__all__ = [
    "trainer_patch_targets",
    "trainer_requires",
    "patch_training_args",
    "patch_trainer",
    "patch_modeling_utils",
    "patch_peft",
]


def trainer_patch_targets(trainer_module: Any) -> list[PatchTarget]:
    """Everything :func:`patch_trainer` replaces in `trainer_module` (``transformers.trainer``)."""
    trainer_cls = getattr(trainer_module, "Trainer", None)
    if not isinstance(trainer_cls, type):
        raise internals_missing("transformers.trainer.Trainer")
    targets = []
    table = optimizer_handler_table(trainer_module)
    if table is not None:
        # the plugin's names get their own entries; get_optimizer_cls_and_kwargs stays transformers'
        from transformers.training_args import OptimizerNames

        for name in sorted(served_optimizer_names()):
            targets.append(
                PatchTarget(
                    table,
                    OptimizerNames(name),
                    optimizer_handler(name),
                    f"transformers.trainer._OPTIMIZER_HANDLERS[{name!r}]",
                )
            )
    else:
        targets.append(
            PatchTarget(
                trainer_cls,
                "get_optimizer_cls_and_kwargs",
                wrap_optimizer_dispatch,
                "transformers.Trainer.get_optimizer_cls_and_kwargs",
            )
        )
    for attribute, wrap in (
        ("__init__", wrap_init),
        ("_load_from_checkpoint", wrap_load_from_checkpoint),
        ("_load_best_model", wrap_load_best_model),
        ("_load_optimizer_and_scheduler", wrap_load_optimizer_and_scheduler),
        ("_save_checkpoint", wrap_save_checkpoint),
        ("train", wrap_train),
    ):
        targets.append(PatchTarget(trainer_cls, attribute, wrap, f"transformers.Trainer.{attribute}"))
    targets.append(
        PatchTarget(
            trainer_module,
            "deepspeed_load_checkpoint",
            wrap_deepspeed_load_checkpoint,
            "transformers.trainer.deepspeed_load_checkpoint",
        )
    )
    return targets


def trainer_requires(trainer_module: Any) -> tuple[Required, ...]:
    """Trainer methods the patches call without replacing them."""
    return (Required(trainer_module.Trainer, "_get_output_dir", "transformers.Trainer._get_output_dir"),)


def patch_trainer() -> None:
    """Patch ``transformers.trainer`` (:func:`trainer_patch_targets`), all or nothing (idempotent)."""
    from transformers import trainer as trainer_module

    register_optimizer_names()
    with patch_lock:
        apply_patches(trainer_patch_targets(trainer_module), trainer_requires(trainer_module))


def patch_training_args() -> None:
    """Patch ``transformers.training_args``: the optimizer names become ``OptimizerNames`` members
    (:func:`~.names.register_optimizer_names`, idempotent)."""
    register_optimizer_names()


def patch_peft() -> None:
    """Patch ``peft.peft_model``: ``PeftModel.save_pretrained`` of a prepared peft model saves merged
    ``modules_to_save`` (idempotent)."""
    from peft import peft_model

    model_cls = getattr(peft_model, "PeftModel", None)
    if not isinstance(model_cls, type):
        raise internals_missing("peft.PeftModel")
    apply_patches(
        [PatchTarget(model_cls, "save_pretrained", wrap_peft_save_pretrained, "peft.PeftModel.save_pretrained")]
    )


def patch_modeling_utils() -> None:
    """Patch ``transformers.modeling_utils``: ``save_pretrained`` of a GaLore-prepared model writes the merged
    plain weights; ``init_weights()`` initialises GaLore layers through the model's own init (idempotent)."""
    from transformers import modeling_utils

    model_cls = getattr(modeling_utils, "PreTrainedModel", None)
    if not isinstance(model_cls, type):
        raise internals_missing("transformers.PreTrainedModel")
    apply_patches(
        [
            PatchTarget(
                model_cls, "save_pretrained", wrap_save_pretrained, "transformers.PreTrainedModel.save_pretrained"
            ),
            PatchTarget(
                model_cls,
                "_initialize_weights",
                wrap_initialize_weights,
                "transformers.PreTrainedModel._initialize_weights",
            ),
        ]
    )
