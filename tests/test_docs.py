"""The documentation site: it builds offline under --strict, and its reference is complete.

The reference pages are generated when the site is built (scripts/docs_hooks.py, mkdocstrings); this
test reads the rendered HTML against the package: every name of ``hf_galore_plugin.__all__`` has its
own entry, every ``GaLoreConfig`` field has a row whose default is the dataclass default and whose
``optim_args`` spelling parses back (with the Trainer integration's own parser) to that default, and
every preset is listed. The code blocks of the pages run in tests/test_readme.py.
"""

from __future__ import annotations

import dataclasses
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_galore_plugin
from hf_galore_plugin import PRESETS, GaLoreConfig
from hf_galore_plugin.integrations.optim_args import parse_optim_args

REPO = Path(__file__).resolve().parent.parent
# Phrases that date a number by the history of the work instead of by its date, machine and command.
HISTORY_PHRASES = (
    "the issue's",
    "the issue ",
    "issue 26",
    "reviewed tree",
    "final tree",
    "this change",
    "previous session",
    "this session",
    "review commit",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out


def _text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def rendered_public_names(page: str) -> set[str]:
    """Last component of each mkdocstrings heading's anchor: the names the API page documents."""
    ids = re.findall(r'<h2 id="(hf_galore_plugin(?:\.[\w.]+)?)" class="doc doc-heading"', page)
    return {i.rsplit(".", 1)[-1] for i in ids}


def rendered_config_rows(page: str) -> dict[str, list[str]]:
    """field name -> the text of its row's cells (field, type, default, optim_args, meaning)."""
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", page, flags=re.S):
        anchor = re.search(r'id="field-(\w+)"', row)
        if anchor:
            rows[anchor.group(1)] = [_text(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)]
    return rows


def check_api_page(page: str) -> None:
    missing = set(hf_galore_plugin.__all__) - rendered_public_names(page)
    assert not missing, f"public names without an entry in the API reference: {sorted(missing)}"


def check_config_page(page: str) -> None:
    rows = rendered_config_rows(page)
    fields = {f.name: f for f in dataclasses.fields(GaLoreConfig)}
    assert list(rows) == list(fields), f"fields missing or extra: {set(fields) ^ set(rows)}"
    for name, field in fields.items():
        _, _, default, optim_args, meaning = rows[name]
        assert default == repr(field.default), (name, default)
        assert parse_optim_args(optim_args) == {name: field.default}, (name, optim_args)
        assert meaning == " ".join(field.metadata["help"].split()), name
    for preset in PRESETS:
        assert f'id="preset-{preset}"' in page, preset


def test_the_api_reference_documents_every_public_name(site):
    page = (site / "reference" / "api.html").read_text()
    check_api_page(page)
    # each entry is rendered from the docstring, not only named
    assert "Returns" in page or "return" in page.lower()


def test_the_config_reference_has_every_field_with_its_default_and_optim_args_spelling(site):
    check_config_page((site / "reference" / "config.html").read_text())


def test_the_checks_fail_when_a_field_or_a_name_is_missing(site):
    # The checks above would pass on a page that lists nothing if they compared nothing: drop one row,
    # change one default, drop one public name, and each check must fail.
    config = (site / "reference" / "config.html").read_text()
    row = re.search(r'<tr>(?:(?!</tr>).)*id="field-seed".*?</tr>', config, flags=re.S).group(0)
    with pytest.raises(AssertionError, match="seed"):
        check_config_page(config.replace(row, ""))
    with pytest.raises(AssertionError):
        check_config_page(config.replace("<code>rank=128</code>", "<code>rank=64</code>"))
    api = (site / "reference" / "api.html").read_text()
    with pytest.raises(AssertionError, match="after_step"):
        check_api_page(api.replace('id="hf_galore_plugin.api.after_step"', 'id="gone"'))


def test_the_planner_cli_page_lists_its_options(site):
    page = _text((site / "reference" / "plan-cli.html").read_text())
    for option in ("--model", "--config", "--methods", "--optim-args", "--json", "--world-size"):
        assert option in page, option


def test_no_page_dates_a_number_by_the_history_of_the_work():
    pages = [REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = [
        f"{page.relative_to(REPO)}:{number}: {line.strip()}"
        for page in pages
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for phrase in HISTORY_PHRASES
        if phrase in line.lower()
    ]
    assert not found, "date a number by its date, machine and command instead:\n" + "\n".join(found)


def test_the_readme_stays_short_and_starts_with_the_two_commands():
    readme = (REPO / "README.md").read_text().splitlines()
    assert len(readme) <= 250, len(readme)
    first_screen = "\n".join(readme[:40])
    assert "bash scripts/demo.sh" in first_screen and "bash scripts/test.sh" in first_screen
