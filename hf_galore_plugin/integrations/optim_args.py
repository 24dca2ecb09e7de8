"""``optim_args`` / ``optim_target_modules`` of ``TrainingArguments`` -> :class:`GaLoreConfig`.

Pure Python (no transformers import), so it is testable and reusable by any CLI.

``optim_args`` is the comma-separated ``key=value`` string transformers documents
("rank=128,update_proj_gap=200,scale=0.25,proj_type=std"). Every :class:`GaLoreConfig`
field is a key; each value is converted with the field's annotated type. An unknown key, a
value of the wrong type or a value the config rejects raises ``ValueError`` naming the key,
the value and what is accepted, before any model is touched.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal, Optional, Union

from ..config import GaLoreConfig

__all__ = ["parse_optim_args", "config_from_training_args", "target_modules_from_optim_target_modules"]

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")
# Lists cannot use ',' inside optim_args (it separates keys): list-valued keys take '+'-separated items.
LIST_SEPARATOR = "+"


def _split_pairs(optim_args: str) -> list[tuple[str, str]]:
    """The (key, value) pairs of `optim_args`, refused where transformers' own parser would fail later.

    transformers parses the same string itself before it asks for the optimizer (``_parse_optim_args``:
    every space removed, then ``key, value = item.split("=")`` for each ``,``-separated item), so an empty
    item (``,,``, a trailing ``,``) or one without exactly one ``=`` would pass ``Trainer()`` and fail in
    ``train()`` with a bare "not enough values to unpack". A space inside a key or value would be removed
    silently: refused too. Spaces around ``,`` and ``=`` are harmless."""
    pairs = []
    for index, raw in enumerate(optim_args.split(",")):
        item = raw.strip()
        if not item:
            raise ValueError(
                f"optim_args item {index + 1} is empty (optim_args={optim_args!r}: two commas in a row, or a "
                "leading or trailing comma); transformers' own parser of optim_args fails on it when training "
                "starts. Remove the extra comma."
            )
        if item.count("=") != 1:
            raise ValueError(
                f"optim_args item {item!r} is not of the form key=value "
                f"(optim_args={optim_args!r}; separate items with ',', and use '=' once per item)"
            )
        key, value = (part.strip() for part in item.split("="))
        for part in (key, value):
            if " " in part:
                raise ValueError(
                    f"optim_args item {item!r} has a space inside {part!r}: transformers removes every space from "
                    f"optim_args, so it would silently become {part.replace(' ', '')!r}. Write it without spaces "
                    f"(list items are joined with {LIST_SEPARATOR!r})."
                )
        pairs.append((key, value))
    return pairs


def _field_types() -> dict[str, Any]:
    types_ = typing.get_type_hints(GaLoreConfig)
    types_["rank"] = Union[int, Literal["auto"]]  # GaLoreConfig.rank also takes 'auto' (rank_allocation='auto')
    return types_


def _accepted(field_type: Any) -> str:
    origin = typing.get_origin(field_type)
    if origin in (Union, types.UnionType):
        return " or ".join(_accepted(arg) for arg in typing.get_args(field_type))
    if field_type is type(None):
        return "none"
    if origin is Literal:
        return " or ".join(repr(arg) for arg in typing.get_args(field_type))
    if field_type is bool:
        return "true/false"
    if field_type is list:
        return f"a {LIST_SEPARATOR!r}-separated list"
    return getattr(field_type, "__name__", str(field_type))


def _convert(value: str, field_type: Any) -> Any:
    """Convert `value` to `field_type`; raises ValueError/TypeError when it does not fit."""
    origin = typing.get_origin(field_type)
    if origin in (Union, types.UnionType):
        args = typing.get_args(field_type)
        if type(None) in args and value.lower() in _NONE:
            return None
        # the most specific reading first: a bool or int before a float, a list before a string; one name
        # without the separator is a string where a string is accepted (a regex), else a list of one
        order = [bool, int, float, list, str]
        for arg in sorted((a for a in args if a is not type(None)), key=lambda a: order.index(a) if a in order else 5):
            if arg is list and LIST_SEPARATOR not in value and str in args:
                continue
            try:
                return _convert(value, arg)
            except (TypeError, ValueError):
                continue
        raise ValueError(value)
    if origin is Literal:
        if value in typing.get_args(field_type):
            return value
        raise ValueError(value)
    if field_type is bool:
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ValueError(value)
    if field_type is int:
        return int(value)
    if field_type is float:
        return float(value)
    if field_type is list:
        return [item for item in value.split(LIST_SEPARATOR) if item]
    if field_type is str:
        return value
    raise TypeError(f"unsupported field type {field_type}")


def parse_optim_args(optim_args: Optional[str], *, optimizer_name: str = "galore") -> dict[str, Any]:
    """Typed GaLoreConfig overrides from an ``optim_args`` string (empty dict for None/'')."""
    if not optim_args:
        return {}
    types_by_field = _field_types()
    overrides: dict[str, Any] = {}
    for key, value in _split_pairs(optim_args):
        if key not in types_by_field:
            raise ValueError(
                f"unknown optim_args key {key!r} (value {value!r}) for optimizer {optimizer_name!r}; "
                f"accepted keys: {', '.join(sorted(types_by_field))}"
            )
        if key in overrides:
            raise ValueError(f"optim_args key {key!r} is given twice (optim_args={optim_args!r})")
        try:
            overrides[key] = _convert(value, types_by_field[key])
        except (TypeError, ValueError):
            raise ValueError(
                f"optim_args key {key!r} has a bad value {value!r} for optimizer {optimizer_name!r}: "
                f"expected {_accepted(types_by_field[key])}"
            ) from None
    return overrides


def target_modules_from_optim_target_modules(optim_target_modules: Union[None, str, list]) -> Union[None, str]:
    """transformers' ``optim_target_modules`` semantics as a GaLoreConfig ``target_modules`` value.

    transformers (``check_target_module_exists``): a string is a regex matched with ``re.fullmatch``
    against the module name ("all-linear"/"all_linear" selects every linear layer); a list entry
    selects a module whose name contains it or fully matches it as a regex. The list becomes one
    regex with exactly that meaning.
    """
    if optim_target_modules is None:
        return None
    if isinstance(optim_target_modules, str):
        if optim_target_modules.replace("_", "-") == "all-linear":
            return "all-linear"
        return optim_target_modules
    if not isinstance(optim_target_modules, (list, tuple)) or not all(
        isinstance(entry, str) for entry in optim_target_modules
    ):
        raise TypeError(
            "optim_target_modules must be a list of strings, a regex string or 'all-linear'; "
            f"got {optim_target_modules!r}"
        )
    if not optim_target_modules:
        raise ValueError("optim_target_modules=[] selects nothing; leave it unset for the default targets")
    alternatives = [f".*{re.escape(entry)}.*" for entry in optim_target_modules]
    for entry in optim_target_modules:
        try:
            re.compile(entry)
        except re.error:
            continue  # transformers would only match it as a substring
        alternatives.append(entry)
    return "|".join(f"(?:{alternative})" for alternative in alternatives)


def config_from_training_args(
    preset: GaLoreConfig,
    *,
    optim_args: Optional[str],
    optim_target_modules: Union[None, str, list],
    optimizer_name: str,
) -> GaLoreConfig:
    """The preset with ``optim_args`` and ``optim_target_modules`` applied (validated)."""
    overrides = parse_optim_args(optim_args, optimizer_name=optimizer_name)
    if optim_target_modules is not None:
        if "target_modules" in overrides:
            raise ValueError(
                f"target modules are given twice: optim_target_modules={optim_target_modules!r} and "
                f"optim_args target_modules={overrides['target_modules']!r}; keep one"
            )
        overrides["target_modules"] = target_modules_from_optim_target_modules(optim_target_modules)
    try:
        return preset.replace(**overrides)
    except (TypeError, ValueError) as exc:
        given = ", ".join(f"{key}={value!r}" for key, value in overrides.items())
        raise ValueError(f"optimizer {optimizer_name!r} with {given}: {exc}") from exc
