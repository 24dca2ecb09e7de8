"""Every Python snippet in README.md and in the documentation pages under docs/ runs, so they cannot go stale.

The snippets use `model`, `train_dataset` and `loader` as a reader's own objects; the test
provides them: a Llama built from a config just large enough for the snippets' rank=128. A block meant
as illustration only is written as ```text, not ```python (docs/contributing.md).
"""

import re
from pathlib import Path

import pytest
import torch

from conftest import use_torch_twins


REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# README first, then the site's pages in a fixed order.
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]


def _blocks() -> list[tuple[str, str]]:
    """(where, source) of every ```python block of README.md and docs/."""
    return [
        (f"{page.relative_to(REPO)}[python block {i}]", block)
        for page in PAGES
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
    ]


def _namespace(tiny_llama):
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    return {
        "model": tiny_llama(
            vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1, max_position_embeddings=32
        ),
        "train_dataset": rows,
        "loader": [{"input_ids": ids[:4], "labels": ids[:4]}, {"input_ids": ids[4:], "labels": ids[4:]}],
    }


def test_readme_has_the_snippets_we_run():
    blocks = [b for where, b in _blocks() if where.startswith("README.md")]
    assert any("TrainingArguments(" in b for b in blocks) and any("after_step(model, optimizer)" in b for b in blocks)


def test_the_guides_have_snippets_we_run():
    pages = {where.split("[")[0] for where, _ in _blocks()}
    assert {"docs/guides/trainer.md", "docs/guides/plain-pytorch.md", "docs/guides/lora-qlora.md"} <= pages, pages


@pytest.mark.parametrize("index", range(len(_blocks())), ids=[where for where, _ in _blocks()])
def test_readme_python_snippet_runs(index, tmp_path, monkeypatch, tiny_llama):
    monkeypatch.chdir(tmp_path)
    use_torch_twins(monkeypatch)  # the kernels are tested elsewhere
    # A snippet may set HF_GALORE_PLUGIN_NO_PATCH (read at import, already done here): undone after the test.
    monkeypatch.setenv("HF_GALORE_PLUGIN_NO_PATCH", "0")
    monkeypatch.delenv("HF_GALORE_PLUGIN_NO_PATCH")
    namespace = _namespace(tiny_llama)
    before = {n: p.detach().clone() for n, p in namespace["model"].named_parameters()}
    where, source = _blocks()[index]
    exec(compile(source, where, "exec"), namespace)
    after = dict(namespace["model"].named_parameters())
    # the snippet trained the model: the parameters both versions share (embeddings, norms) moved
    shared = [n for n in before if n in after]
    assert shared and any(not torch.equal(before[n], after[n]) for n in shared)
    if "save_model" in source:
        assert any(f.suffix == ".safetensors" for f in (tmp_path / "out").iterdir())
