"""The patch helper: every patch of a third-party module goes through :func:`apply_patches`.

A patch is all or nothing: each target (:class:`PatchTarget`) is checked before the first is replaced,
and one error names every missing one with the installed transformers version and the supported range
(:data:`SUPPORTED_TRANSFORMERS`); each replacement carries a mark (:func:`mark`), so a second call
changes nothing and :func:`trainer_is_patched` can tell whether the Trainer carries the patches.
"""

from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import transformers

from . import NO_PATCH_ENV

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "PatchTarget",
    "Required",
    "apply_patches",
    "check_transformers_version",
    "internals_missing",
    "is_marked",
    "is_patched",
    "mark",
    "patch_lock",
    "trainer_is_patched",
]

# Held while a patch is applied and while the optimizer names are registered.
patch_lock = threading.RLock()

# The transformers versions the patches are tested on (tests/test_integration_*.py on 5.25,
# scripts/test_transformers_457.sh on 4.57.6). Outside it the plugin still patches, with one warning.
SUPPORTED_TRANSFORMERS = ">=4.57,<5.26"
_version_checked = False


def _installed_transformers() -> str:
    return str(getattr(transformers, "__version__", "unknown"))


def internals_missing(what: str) -> RuntimeError:
    """The error for transformers internals a patch needs and the installed version lacks (`what` names them)."""
    return RuntimeError(
        f"hf_galore_plugin cannot patch transformers {_installed_transformers()}: missing {what}. "
        f"Supported: transformers{SUPPORTED_TRANSFORMERS}; install a version in that range, or set "
        f"{NO_PATCH_ENV}=1 and use the plugin without patching (docs/guides/trainer.md, 'Without patching transformers')."
    )


def check_transformers_version() -> bool:
    """True when the installed transformers is in :data:`SUPPORTED_TRANSFORMERS`; otherwise warns once
    (a ``UserWarning`` naming both) and returns False. The patches are applied either way: each target
    is checked before anything is changed (:func:`apply_patches`)."""
    global _version_checked
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    installed = _installed_transformers()
    try:
        supported = Version(installed) in SpecifierSet(SUPPORTED_TRANSFORMERS, prereleases=True)
    except InvalidVersion:
        supported = False
    if not supported and not _version_checked:
        warnings.warn(
            f"hf_galore_plugin is tested with transformers{SUPPORTED_TRANSFORMERS}; the installed "
            f"transformers {installed} is outside that range, so its patches of transformers may not fit "
            f"(set {NO_PATCH_ENV}=1 to patch nothing).",
            UserWarning,
            stacklevel=2,
        )
    _version_checked = True
    return supported


@dataclass(frozen=True)
class PatchTarget:
    """One thing a patch replaces: ``owner.attribute`` (a class or a module), or ``owner[attribute]``
    when `owner` is a dict (a handler table; such a key may be absent and is then added)."""

    owner: Any
    attribute: Any
    wrap: Callable[[Any], Any]  # the original (None for an absent table key) -> the replacement
    name: str  # for errors, e.g. "transformers.Trainer._load_best_model"

    def exists(self) -> bool:
        if isinstance(self.owner, dict):
            return True
        if isinstance(self.owner, type):
            return self.attribute in self.owner.__dict__  # defined on the class itself, not inherited
        return callable(getattr(self.owner, self.attribute, None))

    def current(self) -> Any:
        if isinstance(self.owner, dict):
            return self.owner.get(self.attribute)
        if isinstance(self.owner, type):
            return self.owner.__dict__.get(self.attribute)
        return getattr(self.owner, self.attribute, None)

    def set(self, value: Any) -> None:
        if isinstance(self.owner, dict):
            if value is None:
                self.owner.pop(self.attribute, None)
            else:
                self.owner[self.attribute] = value
        else:
            setattr(self.owner, self.attribute, value)


@dataclass(frozen=True)
class Required:
    """A method of `owner` (a class) that the patches call without replacing it: checked with the
    targets by :func:`apply_patches`, never set."""

    owner: type
    attribute: str
    name: str  # for errors, e.g. "transformers.Trainer._get_output_dir"

    def exists(self) -> bool:
        return self.attribute in self.owner.__dict__


def is_marked(value: Any) -> bool:
    """Whether `value` (a function, or a static/class method wrapping one) is a replacement of this package."""
    return getattr(getattr(value, "__func__", value), "_hf_galore_plugin_patch", False)


def is_patched(cls: type, attribute: str) -> bool:
    """Whether `cls` itself (not a base class) holds this package's replacement of `attribute`."""
    return is_marked(cls.__dict__.get(attribute))


def mark(function: Callable) -> Callable:
    """Mark `function` as a replacement of this package (what :func:`apply_patches` requires of each)."""
    marked: Any = function  # a function object takes attributes; Callable does not say so
    marked._hf_galore_plugin_patch = True
    return function


def apply_patches(targets: list[PatchTarget], requires: tuple[Required, ...] = ()) -> bool:
    """Apply every patch of `targets`, or none: each target (and each of `requires`) is checked first,
    and one error names every missing one with the installed transformers version and the supported
    range; every replacement is built before the first is set, and a failure while setting puts the
    originals back. Targets already patched are skipped
    (idempotent). Returns True when something was patched."""
    with patch_lock:
        check_transformers_version()
        checked: list[PatchTarget | Required] = [*requires, *targets]
        missing = [target.name for target in checked if not target.exists()]
        if missing:
            raise internals_missing(", ".join(missing))
        todo = [target for target in targets if not is_marked(target.current())]
        replacements = []
        for target in todo:
            replacement = target.wrap(target.current())
            if not is_marked(replacement):
                raise TypeError(f"hf_galore_plugin: the patch of {target.name} is not marked (mark)")
            replacements.append((target, replacement))
        applied: list[tuple[PatchTarget, Any]] = []
        try:
            for target, replacement in replacements:
                applied.append((target, target.current()))
                target.set(replacement)
        except BaseException:
            for target, original in reversed(applied):
                target.set(original)
            raise
        return bool(replacements)


def trainer_is_patched() -> bool:
    """True when ``transformers.Trainer`` carries the plugin's patches (False without them, e.g. under
    ``HF_GALORE_PLUGIN_NO_PATCH=1``, or when transformers is not imported yet)."""
    trainer_module = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(trainer_module, "Trainer", None)
    return isinstance(trainer_cls, type) and is_patched(trainer_cls, "_save_checkpoint")
