"""How the plugin patches transformers: all or nothing, through transformers' own optimizer table where
there is one, a stated version range, and a path that patches nothing (``HF_GALORE_PLUGIN_NO_PATCH=1``).

Patching happens at import, so most tests run a fresh interpreter (``python_subprocess``).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import transformers
import transformers.trainer as trainer_module

from hf_galore_plugin.integrations import names, patching
from hf_galore_plugin.integrations import transformers as integration

# Every patch target, read from the helper's own list (so the tests follow it), except the entries the
# plugin adds to transformers' optimizer table (keys of a dict, not attributes that can be missing).
DELETABLE = [
    target.name
    for target in integration.trainer_patch_targets(trainer_module) + list(integration.trainer_requires(trainer_module))
    if not isinstance(target.owner, dict)
]

# In a fresh interpreter: patched() lists the marked callables of the Trainer, TrainingArguments,
# PreTrainedModel, the trainer module and its optimizer table, and the plugin's import hook;
# added_names() the plugin's optimizer names in OptimizerNames (registered when transformers.training_args
# is patched, which is separate from the Trainer).
MARKED = """
import sys
import transformers.modeling_utils as modeling_utils
import transformers.trainer as tm
import transformers.training_args as ta

def marked(value):
    return getattr(getattr(value, "__func__", value), "_hf_galore_plugin_patch", False)

def patched():
    found = [f"{cls.__name__}.{name}" for cls in (tm.Trainer, ta.TrainingArguments, modeling_utils.PreTrainedModel)
             for name, value in vars(cls).items() if marked(value)]
    found += [f"trainer.{name}" for name, value in vars(tm).items() if marked(value)]
    found += [f"_OPTIMIZER_HANDLERS[{key!r}]" for key, value in getattr(tm, "_OPTIMIZER_HANDLERS", {}).items()
              if marked(value)]
    found += [type(finder).__name__ for finder in sys.meta_path if type(finder).__module__.startswith("hf_galore")]
    return found

def added_names():
    return [name for name in ("qgalore_adamw_8bit",) if name in ta.OptimizerNames._value2member_map_]
"""


def test_the_target_list_covers_every_patched_trainer_attribute():
    # the Trainer of this process is patched (the plugin was imported): every marked attribute of it
    # and of the trainer module must be a target, or the all-or-nothing check misses it
    names = {target.name for target in integration.trainer_patch_targets(trainer_module)}
    marked = {
        f"transformers.Trainer.{name}"
        for name, value in vars(trainer_module.Trainer).items()
        if patching.is_marked(value)
    }
    marked |= {
        f"transformers.trainer.{name}" for name, value in vars(trainer_module).items() if patching.is_marked(value)
    }
    assert marked and marked <= names, marked - names
    assert "transformers.Trainer._load_optimizer_and_scheduler" in names


def test_the_documented_patch_table_lists_exactly_the_targets():
    # docs/architecture.md, "What the transformers integration patches": every attribute of the Trainer and
    # of transformers.trainer that is patched or required must be listed, and nothing else. The table also
    # lists get_optimizer_cls_and_kwargs, a target only where transformers has no handler table (4.57).
    doc = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    table = doc.split("## What the transformers integration patches", 1)[1]
    documented = set(re.findall(r"`Trainer\.(\w+)`", table)) | set(re.findall(r"module global `(\w+)`", table))
    targets = {
        target.name.rpartition(".")[2]
        for target in integration.trainer_patch_targets(trainer_module)
        + list(integration.trainer_requires(trainer_module))
        if not isinstance(target.owner, dict)
    }
    assert targets <= documented, f"patched but not in docs/architecture.md: {sorted(targets - documented)}"
    assert documented - targets <= {"get_optimizer_cls_and_kwargs"}, sorted(documented - targets)


@pytest.mark.parametrize("name", DELETABLE)
def test_a_missing_target_gives_one_error_and_patches_nothing(python_subprocess, name):
    owner, attribute = name.removeprefix("transformers.").rsplit(".", 1)
    result = python_subprocess(
        MARKED
        + f"""
owner = tm.Trainer if {owner!r} == "Trainer" else tm
delattr(owner, {attribute!r})
errors = []
for attempt in range(2):  # the second import must fail the same way, not half-patch
    try:
        import hf_galore_plugin
    except RuntimeError as exc:
        errors.append(str(exc))
    else:
        errors.append(None)
print("ERRORS", errors)
print("PATCHED", patched())
assert errors[0] is not None and errors[0] == errors[1], errors
assert patched() == [], patched()
"""
    )
    error = result.stdout.split("ERRORS ", 1)[1]
    assert name in error and transformers.__version__ in error and patching.SUPPORTED_TRANSFORMERS in error


def test_without_a_handler_table_get_optimizer_cls_and_kwargs_is_wrapped(python_subprocess):
    # transformers 4.57 has no _OPTIMIZER_HANDLERS: the plugin then wraps get_optimizer_cls_and_kwargs
    result = python_subprocess(
        MARKED
        + """
has_table = hasattr(tm, "_OPTIMIZER_HANDLERS")
if has_table:
    del tm._OPTIMIZER_HANDLERS
import hf_galore_plugin
from transformers import TrainingArguments
args = TrainingArguments(output_dir="unused", optim="qgalore_adamw_8bit", use_cpu=True, report_to=[])
assert marked(vars(tm.Trainer)["get_optimizer_cls_and_kwargs"])
cls, kwargs = tm.Trainer.get_optimizer_cls_and_kwargs(args, hf_galore_plugin.prepare_model(
    __import__("torch").nn.Sequential(__import__("torch").nn.Linear(32, 32)),
    hf_galore_plugin.GaLoreConfig(rank=4, target_modules=("0",))))
print("OK", has_table, cls.__name__)
"""
    )
    assert "OK" in result.stdout and "GaLoreOptimizerFactory" in result.stdout


def test_with_a_handler_table_only_its_entries_are_added():
    table = getattr(trainer_module, "_OPTIMIZER_HANDLERS", None)
    if table is None:
        pytest.skip("platform: this transformers has no optimizer handler table (4.57); the wrapper is tested above")
    assert not patching.is_marked(vars(trainer_module.Trainer)["get_optimizer_cls_and_kwargs"])
    served = names.served_optimizer_names()
    assert {key for key, value in table.items() if patching.is_marked(value)} == set(served)


@pytest.mark.parametrize(
    "version, supported", [("5.25.0", True), ("4.57.6", True), ("4.56.2", False), ("5.26.0", False)]
)
def test_version_outside_the_supported_range_warns_once(monkeypatch, version, supported):
    monkeypatch.setattr(patching, "_installed_transformers", lambda: version)
    monkeypatch.setattr(patching, "_version_checked", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert patching.check_transformers_version() is supported
        assert patching.check_transformers_version() is supported
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if supported:
        assert messages == []
    else:
        assert len(messages) == 1 and version in messages[0] and patching.SUPPORTED_TRANSFORMERS in messages[0]


def test_version_outside_the_range_still_patches(python_subprocess):
    result = python_subprocess(
        MARKED
        + """
import warnings
import transformers
transformers.__version__ = "5.99.0"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import hf_galore_plugin
print("WARNINGS", [str(w.message) for w in caught if "5.99.0" in str(w.message)])
print("PATCHED", patched())
"""
    )
    assert result.stdout.count("5.99.0") == 1
    assert "Trainer.__init__" in result.stdout.split("PATCHED", 1)[1]


NO_PATCH_RUN = """
import os, sys, tempfile
import torch
import hf_galore_plugin as hgp
from transformers import LlamaForCausalLM, Trainer, TrainingArguments
from hf_galore_plugin.integrations.callback import GaLoreCallback
sys.path.insert(0, {tests!r})
from conftest import build_tiny_llama

untouched = patched()
config = hgp.GaLoreConfig(rank=8, update_proj_gap=3)
ids = torch.randint(0, 256, (64, 16), generator=torch.Generator().manual_seed(1))
data = [{{"input_ids": row, "labels": row}} for row in ids]

def run(output_dir, resume=None):
    model = hgp.prepare_model(build_tiny_llama(seed=0), config)
    args = TrainingArguments(
        output_dir=output_dir, optim="adamw_torch", max_steps=8, save_strategy="steps", save_steps=4,
        per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=data, optimizers=(hgp.create_optimizer(model, lr=1e-3), None),
        callbacks=[GaLoreCallback(config)],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer

root = tempfile.mkdtemp()
full = run(os.path.join(root, "full"))
checkpoint = os.path.join(root, "full", "checkpoint-4")
resumed = run(os.path.join(root, "resumed"), resume=checkpoint)
losses = lambda trainer: {{e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}}
assert sorted(losses(resumed)) == list(range(1, 9)) and losses(resumed) == losses(full)
a, b = full.model.state_dict(), resumed.model.state_dict()
assert a.keys() == b.keys()
for key in a:
    assert torch.equal(a[key], b[key]), key
refreshes = [int(layer.galore_num_refreshes) for _, layer in hgp.galore_layers(resumed.model)]
assert min(refreshes) >= 2, refreshes  # the resumed half crossed a refresh (gap 3)
from safetensors.torch import load_file
saved = load_file(os.path.join(checkpoint, "model.safetensors"))
assert not os.path.exists(os.path.join(checkpoint, "galore_state.pt"))
assert any(key.endswith(".galore_factor") for key in saved)  # the layers' own tensors, unmerged

# the final model: merge_and_unload, then a plain save that loads without the plugin
with torch.no_grad():
    probe = ids[:2]
    expected = full.model(input_ids=probe).logits
    merged = hgp.merge_and_unload(full.model)
    merged.save_pretrained(os.path.join(root, "final"))
    plain = LlamaForCausalLM.from_pretrained(os.path.join(root, "final"))
    torch.testing.assert_close(plain(input_ids=probe).logits, expected, rtol=1e-5, atol=1e-5)
print("UNTOUCHED", untouched, "AFTER", patched(), added_names())
"""


def test_no_patch_trains_checkpoints_and_resumes_bit_exact(python_subprocess):
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    result = python_subprocess(
        "import hf_galore_plugin\n" + MARKED + NO_PATCH_RUN.format(tests=tests),
        env={"HF_GALORE_PLUGIN_NO_PATCH": "1", "HF_GALORE_DISABLE_TRITON": "1"},
        timeout=600,
    )
    assert "UNTOUCHED [] AFTER [] []" in result.stdout, result.stdout[-2000:]
