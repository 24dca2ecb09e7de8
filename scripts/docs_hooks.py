"""mkdocs hooks (mkdocs.yml `hooks:`): the reference pages' tables, generated from the package itself.

A page asks for a generated part with a marker comment on a line of its own:

- `<!-- galore:public-api -->`: one mkdocstrings block (`::: module.name`) per name of
  `hf_galore_plugin.__all__`, from the module each lazy name resolves to; mkdocstrings renders it.
- `<!-- galore:config-fields -->`: every `GaLoreConfig` dataclass field: its type, default, the
  `optim_args` spelling of that default (parsed back by the Trainer integration's own parser in
  tests/test_docs.py) and its help text (`field.metadata["help"]`).
- `<!-- galore:presets -->`: each preset of `hf_galore_plugin.PRESETS`, with the fields it sets.
- `<!-- galore:plan-cli -->`: `python -m hf_galore_plugin.plan --help`.

Nothing here is written by hand twice: a new field, preset or public name shows up on the next build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import typing

MARKERS = ("public-api", "config-fields", "presets", "plan-cli")


def _cell(text: str) -> str:
    """`text` as one table cell of literal text: Markdown's emphasis, code and link characters escaped."""
    text = " ".join(str(text).split())
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for char in "\\`*_[]|":
        text = text.replace(char, "\\" + char)
    return text


def optim_args_value(value: typing.Any) -> str:
    """`value` as an `optim_args` value (integrations/optim_args.py reads it back)."""
    from hf_galore_plugin.integrations.optim_args import LIST_SEPARATOR

    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return LIST_SEPARATOR.join(value) + ("" if len(value) > 1 else LIST_SEPARATOR)
    return str(value)


def _type_name(annotation: typing.Any) -> str:
    import types

    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def config_fields_table() -> str:
    from hf_galore_plugin import GaLoreConfig

    hints = typing.get_type_hints(GaLoreConfig)
    rows = [
        "| field | type | default | `optim_args` | meaning |",
        "|---|---|---|---|---|",
    ]
    for field in dataclasses.fields(GaLoreConfig):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        rows.append(
            f'| <span id="field-{field.name}"></span>`{field.name}` | {_cell(_type_name(hints[field.name]))} '
            f"| `{default!r}` | `{field.name}={optim_args_value(default)}` | {_cell(field.metadata['help'])} |"
        )
    return "\n".join(rows)


def presets_table() -> str:
    from hf_galore_plugin import PRESETS, GaLoreConfig

    defaults = GaLoreConfig().to_dict()
    rows = ["| preset (optimizer name) | fields it sets (others: the defaults above) |", "|---|---|"]
    for name in PRESETS:
        changed = {k: v for k, v in GaLoreConfig.preset(name).to_dict().items() if defaults[k] != v}
        listed = ", ".join(f"`{k}={v!r}`" for k, v in changed.items()) or "none: the defaults"
        rows.append(f'| <span id="preset-{name}"></span>`{name}` | {listed} |')
    return "\n".join(rows)


def public_api_blocks() -> str:
    import hf_galore_plugin

    lazy = hf_galore_plugin._LAZY
    blocks = []
    for name in hf_galore_plugin.__all__:
        options = "      heading_level: 2\n"
        if name == "__version__":  # a plain string without a docstring of its own
            options += "      show_if_no_docstring: true\n"
        if name in lazy:
            path = f"hf_galore_plugin{lazy[name]}.{name}"
        elif name in ("GaLoreConfig", "PRESETS"):
            path = f"hf_galore_plugin.config.{name}"
        else:
            path = f"hf_galore_plugin.{name}"
        blocks.append(f"::: {path}\n    options:\n{options}")
    return "\n".join(blocks)


def plan_cli_help() -> str:
    from hf_galore_plugin.plan.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(["--help"])
    return "```text\n" + out.getvalue().rstrip() + "\n```"


_GENERATORS = {
    "public-api": public_api_blocks,
    "config-fields": config_fields_table,
    "presets": presets_table,
    "plan-cli": plan_cli_help,
}


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs' hook signature)
    for marker, generate in _GENERATORS.items():
        tag = f"<!-- galore:{marker} -->"
        if tag in markdown:
            markdown = markdown.replace(tag, generate())
    return markdown
