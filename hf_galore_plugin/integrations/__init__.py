"""Integrations with transformers, peft, accelerate and DeepSpeed: the only code that imports them.

Importing this package does not import transformers (``import transformers.training_args``
alone takes ~8 s cold on the CI machines). It registers the optimizer names "at import" in
the only way that keeps that promise:

- the transformers modules that are already imported are patched right away;
- for the others a ``sys.meta_path`` finder waits for them and patches each one as soon as
  it has finished executing (``transformers.training_args``: optimizer names;
  ``transformers.trainer``: ``Trainer``; ``transformers.modeling_utils``: ``save_pretrained`` and
  ``_initialize_weights``; ``peft.peft_model``: ``save_pretrained``).

Each patch runs once per module (idempotent, under a lock) and is all or nothing: every target is
checked before the first is replaced, and a missing one raises one error naming it, the installed
version and the supported range (``SUPPORTED_TRANSFORMERS``). The patch table is
:mod:`hf_galore_plugin.integrations.transformers` (one ``patch_*`` function per watched module, imported by
name when that module has executed); docs/architecture.md lists every target and the module of its
replacement.

``HF_GALORE_PLUGIN_NO_PATCH=1`` (read at ``import hf_galore_plugin``) installs no hook and patches
nothing; docs/guides/trainer.md "Without patching transformers" says what then works.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
import threading

__all__ = ["install_transformers_hook", "patching_disabled", "NO_PATCH_ENV", "WATCHED_MODULES"]

NO_PATCH_ENV = "HF_GALORE_PLUGIN_NO_PATCH"

# module -> name of the function in .transformers that patches it (run after the module executed)
WATCHED_MODULES = {
    "transformers.training_args": "patch_training_args",
    "transformers.trainer": "patch_trainer",
    "transformers.modeling_utils": "patch_modeling_utils",
    "peft.peft_model": "patch_peft",
}

_lock = threading.RLock()
_patched: set[str] = set()


def _apply_patch(module_name: str) -> None:
    with _lock:
        if module_name in _patched:
            return
        _patched.add(module_name)
        try:
            patches = importlib.import_module(".transformers", __name__)
            getattr(patches, WATCHED_MODULES[module_name])()
        except BaseException:
            _patched.discard(module_name)  # so that the next import reports the error again
            raise


class _PostImportLoader(importlib.abc.Loader):
    """Runs the real loader, then our patch for the module."""

    def __init__(self, loader: importlib.abc.Loader, module_name: str) -> None:
        self._loader = loader
        self._module_name = module_name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _apply_patch(self._module_name)

    def __getattr__(self, name):  # get_source, get_filename, is_package, ... of the real loader
        return getattr(self._loader, name)


class _TransformersImportHook(importlib.abc.MetaPathFinder):
    """Finds the watched modules through the other finders and wraps their loader."""

    _searching = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in WATCHED_MODULES or getattr(self._searching, "active", False):
            return None
        self._searching.active = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._searching.active = False
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PostImportLoader(spec.loader, fullname)
        return spec


_hook = _TransformersImportHook()


def patching_disabled() -> bool:
    """True when ``HF_GALORE_PLUGIN_NO_PATCH`` is set (``1``/``true``/``yes``)."""
    return os.environ.get(NO_PATCH_ENV, "0").strip().lower() in ("1", "true", "yes")


def install_transformers_hook() -> None:
    """Patch the transformers modules already imported; watch for the others. Idempotent.

    Called at ``import hf_galore_plugin`` unless :func:`patching_disabled`; an explicit call installs
    the hook regardless. If patching an already imported module fails, the hook is removed again.
    """
    with _lock:
        installed = _hook in sys.meta_path
        if not installed:
            sys.meta_path.insert(0, _hook)
        try:
            if "transformers" in sys.modules:
                # transformers is loaded (its modules load lazily): make the names real members now,
                # as a user who imported transformers first expects.
                importlib.import_module("transformers.training_args")
            for module_name in WATCHED_MODULES:
                module = sys.modules.get(module_name)
                # a module still executing (its spec says `_initializing`) is patched by the hook when done
                if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
                    _apply_patch(module_name)
        except BaseException:
            if not installed:
                sys.meta_path.remove(_hook)
            raise


if not patching_disabled():
    install_transformers_hook()
