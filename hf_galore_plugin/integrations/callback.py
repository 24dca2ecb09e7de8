"""``GaLoreCallback``: refresh schedule, learning-rate scale, logging and checkpoint state for ``Trainer``.

Order of events in one optimizer step of ``Trainer._inner_training_loop`` (transformers 4.57 and
5.25 alike)::

    on_step_begin -> forward/backward (x gradient_accumulation_steps) -> clip -> on_pre_optimizer_step
    -> optimizer.step() -> on_optimizer_step -> lr_scheduler.step() -> global_step += 1 -> on_step_end
    -> log / evaluate / save (on_log, on_evaluate, on_save)

``after_step`` runs in ``on_step_end``: once per optimizer step (never per micro-batch), after the
update it belongs to, and before a checkpoint of that step is written, so a checkpoint always holds
the state after the refresh. The scheduler has already moved to the next step's learning rate by
then; a refresh does not read the learning rate, so this order does not matter to it. A step the
optimizer skipped (fp16 loss-scale overflow, ``step_was_skipped``) is not counted.

Under DeepSpeed the engine steps inside the last micro-batch's ``accelerator.backward`` (the
Trainer's ``optimizer.step()`` is a no-op there), so ``on_step_end`` still comes after the update;
``after_step`` then talks to the engine through
:class:`~hf_galore_plugin.engines.deepspeed.DeepSpeedGaLoreOptimizer` (the engine keeps an
fp32 master of every factor, and ZeRO-3 partitions the layers), which needs the Trainer's engine:
the integration binds every ``GaLoreCallback`` to its Trainer when the Trainer is constructed.

Logging: ``Trainer.log`` hands one ``logs`` dict to every callback in the handler's order, and the
Trainer appends the console callback (``ProgressCallback`` / ``PrinterCallback``) last. This callback
runs first and adds every ``galore/*`` key, so reporting integrations (TensorBoard, W&B, ...) and
``state.log_history`` get the full set for their plots; the console callbacks of the bound Trainer
receive a copy reduced to :data:`BRIEF_LOG_KEYS` unless ``GaLoreConfig.log_keys == "full"``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from typing import Any, Optional

import torch
from transformers import TrainerCallback

# transformers' tqdm (tqdm is its dependency, not ours), which honours its disable_progress_bar() switch.
from transformers.utils.logging import tqdm

from ..api import LR_SCALED, after_step, galore_layers, galore_stats, refreshes_due, save_rank_report
from ..checkpoint.manifest import MANIFEST_NAME, read_manifest
from ..checkpoint.state import GALORE_STATE_NAME
from ..config import GaLoreConfig
from ..engines.contract import unwrap_optimizer
from ..state import prepared_state, state_of
from .common import checkpoint_folder
from .patching import trainer_is_patched
from .saving import save_galore_state, saved_step

logger = logging.getLogger(__name__)

__all__ = ["GaLoreCallback"]

LOG_PREFIX = "galore/"
# What a user watching the console needs from each log line (at most 4 keys; the rest are constant
# or slow-moving numbers that belong in plots):
# - refreshed_layers: whether bases were refreshed since the last line (a refresh step is slower, and
#   a run with 0 for ever never leaves its first subspace);
# - refresh_similarity: whether the subspace still moves (near 1: the bases agree and a longer gap or
#   lazy_refresh would save time; near 0: every refresh lands in a new subspace, Zhao et al. 2024 Sec. 4);
# - refresh_seconds: what the refreshes cost in wall time (SVDs of every layer on one step).
# The last two appear only on lines whose window had a refresh.
BRIEF_LOG_KEYS = (
    f"{LOG_PREFIX}refreshed_layers",
    f"{LOG_PREFIX}refresh_similarity",
    f"{LOG_PREFIX}refresh_seconds",
)
# A refresh that runs longer than this shows a progress bar over its layers (tqdm's ``delay``: a
# shorter refresh prints nothing).
REFRESH_PROGRESS_DELAY_S = 2.0
# Console callbacks of transformers, by class name: NotebookProgressCallback's module imports IPython.
_CONSOLE_CALLBACKS = ("ProgressCallback", "PrinterCallback", "NotebookProgressCallback")
_clock = time.perf_counter


class GaLoreCallback(TrainerCallback):
    """Drives a GaLore-prepared model inside ``Trainer``.

    Attached automatically when ``TrainingArguments.optim`` is one of the plugin's names. Pass it
    yourself (``Trainer(..., callbacks=[GaLoreCallback(config)], optimizers=(my_optimizer, None))``)
    when you build the optimizer with :func:`hf_galore_plugin.create_optimizer`; without a config
    it uses the model's ``galore_config``.

    - ``on_step_end``: :func:`hf_galore_plugin.after_step` (per-layer step counters, refreshes);
    - learning-rate scale of the GaLore groups (``lr_scale``, recovering linearly to 1.0 over
      ``lr_recovery_fraction`` of ``max_steps``);
    - a progress bar over the layers of a refresh that takes longer than ``REFRESH_PROGRESS_DELAY_S``
      (main process only, off with ``disable_tqdm``), and each refresh's duration in the log;
    - ``on_log``: refresh events, subspace similarity, refresh time, gaps, state bytes, quantization
      error (every key for integrations; :data:`BRIEF_LOG_KEYS` on the console unless
      ``log_keys="full"``);
    - ``on_save``: ``galore_state.pt`` (``galore_state_dict``) in the checkpoint folder; the
      integration restores it after the Trainer loads a checkpoint's weights (DeepSpeed: after the
      engine loaded its own checkpoint).
    """

    def __init__(self, config: Optional[GaLoreConfig] = None) -> None:
        self.config = config
        self.lr_multiplier = config.lr_scale if config is not None else 1.0
        self._trainer: Optional[weakref.ref] = None
        self._engine_optimizer: Any = None  # DeepSpeedGaLoreOptimizer while training under DeepSpeed
        self._refreshes_since_log: list[str] = []
        self._similarities_since_log: list[float] = []
        self._refresh_seconds_since_log: list[float] = []

    # ------------------------------------------------------------------ helpers
    def bind_trainer(self, trainer: Any) -> None:
        """Remember (weakly) the Trainer this callback drives: under DeepSpeed it owns the engine.

        The callback moves to the front of the Trainer's callbacks, where the integration attaches its
        own: ``Trainer(callbacks=[...])`` appends user callbacks after the reporting integrations, which
        would otherwise never see the ``galore/*`` keys this callback adds in ``on_log``."""
        self._trainer = weakref.ref(trainer)
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks and callbacks[0] is not self:
            callbacks.remove(self)
            callbacks.insert(0, self)

    def _deepspeed_engine(self, optimizer: Any) -> Any:
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None:
            if type(getattr(optimizer, "optimizer", None)).__module__.startswith("deepspeed."):
                raise RuntimeError(
                    "GaLoreCallback under DeepSpeed needs its Trainer (the engine keeps an fp32 master of every "
                    "factor): pass it in Trainer(callbacks=[...]), or call callback.bind_trainer(trainer)"
                )
            return None
        if not getattr(trainer, "is_deepspeed_enabled", False):
            return None
        engine = trainer.model_wrapped
        if not hasattr(engine, "zero_optimization_stage"):
            raise RuntimeError(
                f"GaLoreCallback: DeepSpeed is enabled but the Trainer's model is a {type(engine).__name__}"
            )
        return engine

    def _config(self, model: Any) -> GaLoreConfig:
        if self.config is None:
            state = state_of(model)
            if state is None:
                raise ValueError(
                    "GaLoreCallback needs a GaLore-prepared model (hf_galore_plugin.prepare_model) or a "
                    "GaLoreConfig: GaLoreCallback(config)"
                )
            self.config = state.config
        return self.config

    def multiplier_at(self, global_step: int, max_steps: int) -> float:
        """lr multiplier of the GaLore groups for the optimizer step that follows `global_step` steps."""
        config = self.config
        if config is None:
            raise RuntimeError("GaLoreCallback.multiplier_at: no GaLoreConfig yet (on_train_begin reads the model's)")
        if config.lr_recovery_fraction <= 0 or max_steps <= 0:
            return config.lr_scale
        progress = min(1.0, global_step / (config.lr_recovery_fraction * max_steps))
        return config.lr_scale + (1.0 - config.lr_scale) * progress

    def _install_lr_hooks(self, optimizer: Any) -> None:
        # Why hooks rather than rescaling the groups' lr / the scheduler's base lrs once: every
        # scheduler (LambdaLR, cosine with restarts, ReduceLROnPlateau, a user's own) rewrites
        # group["lr"] from its own state, and the recovery to 1.0 changes the factor every step.
        # Scaling inside optimizer.step() and restoring the exact previous float afterwards keeps
        # the scheduler, the logged learning rate and the checkpointed optimizer state equal to
        # the user's, so resume stays bit-exact.
        inner = unwrap_optimizer(optimizer)
        if LR_SCALED.get(inner) is self:
            return
        saved: list[tuple[dict, Any]] = []

        def scale_lr(opt, args, kwargs):
            saved.clear()
            for group in opt.param_groups:
                if group.get("galore", False):
                    saved.append((group, group["lr"]))
                    group["lr"] = group["lr"] * self.lr_multiplier

        def restore_lr(opt, args, kwargs):
            for group, lr in saved:
                group["lr"] = lr
            saved.clear()

        if not any(group.get("galore", False) for group in inner.param_groups):
            logger.warning(
                "GaLoreCallback: the optimizer has no GaLore param groups (group['galore'] is True); "
                "lr_scale is not applied. Build it with hf_galore_plugin.create_optimizer."
            )
        inner.register_step_pre_hook(scale_lr)
        inner.register_step_post_hook(restore_lr)
        LR_SCALED[inner] = self

    # ------------------------------------------------------------------ events
    def _brief_console(self) -> None:
        """Give the bound Trainer's console callbacks a copy of each ``logs`` dict without the plugin keys
        outside :data:`BRIEF_LOG_KEYS` (the config is read per call: ``log_keys="full"`` passes it whole).

        The override is an instance attribute (the handler calls ``getattr(callback, "on_log")``), so the
        callbacks keep their class for ``trainer.remove_callback(ProgressCallback)``."""
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None:
            return
        for callback in trainer.callback_handler.callbacks:
            names = {cls.__name__ for cls in type(callback).__mro__}
            on_log = callback.on_log
            if names.isdisjoint(_CONSOLE_CALLBACKS) or getattr(on_log, "func", None) is _brief_on_log:
                continue
            callback.on_log = functools.partial(_brief_on_log, on_log, self)

    def console_logs(self, logs: dict[str, Any]) -> dict[str, Any]:
        """What the console shows of `logs`: every key with ``log_keys="full"``, else the non-plugin keys
        and :data:`BRIEF_LOG_KEYS`."""
        if self.config is not None and self.config.log_keys == "full":
            return logs
        return {key: value for key, value in logs.items() if not key.startswith(LOG_PREFIX) or key in BRIEF_LOG_KEYS}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._config(model)
        self._brief_console()
        self.lr_multiplier = self.multiplier_at(state.global_step, state.max_steps)
        if optimizer is not None:
            self._install_lr_hooks(optimizer)
        engine = self._deepspeed_engine(optimizer)
        if engine is not None:
            from ..engines.deepspeed import DeepSpeedGaLoreOptimizer

            self._engine_optimizer = DeepSpeedGaLoreOptimizer(engine)

    def on_train_end(self, args, state, control, **kwargs):
        self._engine_optimizer = None  # the engine belongs to this train() call

    def on_step_begin(self, args, state, control, **kwargs):
        # from state.global_step: resume, evaluation pauses and max_steps keep the schedule
        self.lr_multiplier = self.multiplier_at(state.global_step, state.max_steps)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        prepared = prepared_state(model, what="GaLoreCallback").model
        if getattr(optimizer, "step_was_skipped", False):
            # The gradients of a skipped step (fp16 overflow: inf/NaN) must not feed the next basis.
            for _, layer in galore_layers(prepared):
                layer.discard_recorded_gradient()
            return
        step_optimizer = self._engine_optimizer if self._engine_optimizer is not None else unwrap_optimizer(optimizer)
        due = refreshes_due(prepared)
        if not due:
            after_step(prepared, step_optimizer, root=model)
            return
        bar = tqdm(
            total=due,
            desc=f"GaLore refresh at step {state.global_step}",
            unit="layer",
            delay=REFRESH_PROGRESS_DELAY_S,
            leave=False,
            dynamic_ncols=True,
            disable=args.disable_tqdm or not state.is_world_process_zero,
        )
        _wait_for_device(prepared)
        started = _clock()
        try:
            event = after_step(prepared, step_optimizer, root=model, progress=lambda name: bar.update(1))
            _wait_for_device(prepared)
        finally:
            bar.close()
        seconds = _clock() - started
        if event.get("ranks_allocated") and state.is_world_process_zero:
            # rank_allocation='auto': the per-layer ranks, next to the run's checkpoints
            save_rank_report(prepared, args.output_dir)
        if event["refreshed"]:
            self._refreshes_since_log.extend(event["refreshed"])
            self._refresh_seconds_since_log.append(seconds)
            if event.get("similarity") is not None:
                self._similarities_since_log.append(float(event["similarity"]))
            logger.info(
                "GaLore step %d: refreshed %d layer(s) in %.2f s %s; subspace similarity %s",
                state.global_step,
                len(event["refreshed"]),
                seconds,
                event["refreshed"],
                event.get("similarity"),
            )

    def on_log(self, args, state, control, logs=None, model=None, optimizer=None, **kwargs):
        if logs is None or "loss" not in logs or model is None:
            return
        extra: dict[str, float] = {
            f"{LOG_PREFIX}lr_multiplier": float(self.lr_multiplier),
            f"{LOG_PREFIX}refreshed_layers": float(len(self._refreshes_since_log)),
        }
        if self._similarities_since_log:
            extra[f"{LOG_PREFIX}refresh_similarity"] = sum(self._similarities_since_log) / len(
                self._similarities_since_log
            )
        if self._refresh_seconds_since_log:
            extra[f"{LOG_PREFIX}refresh_seconds"] = sum(self._refresh_seconds_since_log)
            extra[f"{LOG_PREFIX}refresh_seconds_max"] = max(self._refresh_seconds_since_log)
        stats = galore_stats(prepared_state(model, what="GaLoreCallback").model, unwrap_optimizer(optimizer))
        extra.update({key: float(value) for key, value in stats.items() if value is not None})  # keys "galore/..."
        self._refreshes_since_log.clear()
        self._similarities_since_log.clear()
        self._refresh_seconds_since_log.clear()
        # The Trainer hands the same dict to every callback after us (the integration inserts
        # this callback first, so TensorBoard/W&B see these keys; the console callbacks get the
        # brief copy, _brief_console) and has already copied it into state.log_history: update
        # that entry too.
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def on_save(self, args, state, control, model=None, **kwargs):
        # The integration writes galore_state.pt inside Trainer._save_checkpoint, before rotation
        # (integrations.saving.save_galore_state). This covers a Trainer subclass whose own
        # _save_checkpoint does not reach the integration's.
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None and saved_step(trainer) == state.global_step:
            return
        if not trainer_is_patched():
            # Without the patches (HF_GALORE_PLUGIN_NO_PATCH=1) the checkpoint's model file holds every
            # GaLore layer's own tensors, which the Trainer's resume loads back exactly: nothing to add.
            return

        folder = checkpoint_folder(args.output_dir, state.global_step)
        if trainer is None:
            # not bound (added with trainer.add_callback): the integration's save has run if the file is there
            if _saved_for_step(folder, state.global_step):
                return
            raise RuntimeError(
                f"GaLoreCallback.on_save: {folder} has no {GALORE_STATE_NAME} and manifest of step "
                f"{state.global_step} and the "
                "callback is not bound to its Trainer to write one: pass the callback in Trainer(callbacks=[...]) "
                "or call callback.bind_trainer(trainer)"
            )
        save_galore_state(trainer, prepared_state(model, what="GaLoreCallback.on_save"), folder)


def _saved_for_step(folder: str, step: int) -> bool:
    """Whether the integration completed checkpoint `folder` at `step` (its manifest, written last, says so)."""
    if not os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
        return False
    return read_manifest(folder).get("global_step") == step


def _brief_on_log(original: Any, owner: GaLoreCallback, args, state, control, logs=None, **kwargs):
    """A console callback's ``on_log`` that receives ``owner.console_logs(logs)``, a copy: the callbacks
    after it (a reporting integration added later, the user's own) still get the full dict."""
    return original(args, state, control, logs=owner.console_logs(logs) if logs is not None else logs, **kwargs)


def _wait_for_device(model: Any) -> None:
    """On a GPU the step's and the refresh's kernels run asynchronously: wait for them, so that a refresh's
    duration is its own (one synchronization before and one after, on refresh steps only)."""
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        torch.cuda.synchronize(param.device)
