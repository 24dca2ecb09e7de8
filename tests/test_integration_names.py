"""Optimizer names in transformers: registration, CLI parsing, serialization, dispatch, optim_args.

Runs on transformers 4.57.x and 5.x (scripts/test_transformers_457.sh runs it on 4.57.6). Needs no
model training: the core is only touched through ``get_optimizer_cls_and_kwargs`` on a tiny model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import hf_galore_plugin
from hf_galore_plugin import GaLoreConfig
from hf_galore_plugin.integrations.optim_args import (
    _split_pairs,
    config_from_training_args,
    parse_optim_args,
    target_modules_from_optim_target_modules,
)

from transformers import HfArgumentParser, Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_utils import check_target_module_exists  # noqa: E402
from transformers.training_args import OptimizerNames  # noqa: E402

from hf_galore_plugin.integrations.construction import check_training_args  # noqa: E402
from hf_galore_plugin.integrations.names import GaLoreOptimizerFactory, served_optimizer_names  # noqa: E402

PLUGIN_NAMES = ("galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env or ENV, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kwargs)


# ---------------------------------------------------------------------- OptimizerNames members
def test_names_are_real_enum_members():
    assert served_optimizer_names() == {
        "galore_adamw": "takeover",
        "galore_adamw_8bit": "takeover",
        "galore_adafactor": "takeover",
        "galore_muon": "added",
        "qgalore_adamw_8bit": "added",
        "galore_adamw_layerwise": "layerwise",
        "galore_adamw_8bit_layerwise": "layerwise",
        "galore_adafactor_layerwise": "layerwise",
    }
    member = OptimizerNames("qgalore_adamw_8bit")
    assert member is OptimizerNames.QGALORE_ADAMW_8BIT is OptimizerNames["QGALORE_ADAMW_8BIT"]
    assert isinstance(member, OptimizerNames) and member == "qgalore_adamw_8bit"
    assert [m.value for m in OptimizerNames].count("qgalore_adamw_8bit") == 1
    assert OptimizerNames.__members__["QGALORE_ADAMW_8BIT"] is member
    # the built-in members are untouched
    assert OptimizerNames("adamw_torch") is OptimizerNames.ADAMW_TORCH


def test_registration_is_idempotent():
    from hf_galore_plugin.integrations import install_transformers_hook
    from hf_galore_plugin.integrations.transformers import patch_trainer, patch_training_args

    before = list(OptimizerNames.__members__)
    init = Trainer.__init__
    for _ in range(3):
        install_transformers_hook()
        patch_training_args()
        patch_trainer()
    assert list(OptimizerNames.__members__) == before
    assert Trainer.__init__ is init


@pytest.mark.parametrize("name", PLUGIN_NAMES)
def test_training_args_accept_serialize_and_pickle(tmp_path, name):
    args = _args(tmp_path, optim=name, optim_args="rank=16")
    assert args.optim is OptimizerNames(name)
    assert args.to_dict()["optim"] == name
    assert json.loads(args.to_json_string())["optim"] == name
    assert pickle.loads(pickle.dumps(args)).optim is args.optim


def test_pickled_member_loads_in_a_fresh_process_that_never_imported_the_plugin(tmp_path):
    path = tmp_path / "args.pkl"
    path.write_bytes(pickle.dumps(_args(tmp_path, optim="qgalore_adamw_8bit")))
    out = _run(
        f"""
        import pickle, sys
        args = pickle.loads(open({str(path)!r}, "rb").read())
        print(args.optim.value, type(args.optim).__name__)
        """
    )
    assert out.stdout.split() == ["qgalore_adamw_8bit", "OptimizerNames"]


def test_hf_argument_parser_choices_help_and_parse(capsys):
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            "x",
            "--optim",
            "qgalore_adamw_8bit",
            "--optim_args",
            "rank=16,update_proj_gap=50",
            "--report_to",
            "none",
            "--use_cpu",
            "true",
        ]
    )
    assert args.optim is OptimizerNames.QGALORE_ADAMW_8BIT and args.optim_args == "rank=16,update_proj_gap=50"
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "qgalore_adamw_8bit" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["--output_dir", "x", "--optim", "qgalore_adamw_9bit"])
    assert "invalid choice" in capsys.readouterr().err


def test_training_arguments_subclass_accepts_the_names(tmp_path):
    # TRL's SFTConfig / DPOConfig are dataclass subclasses of TrainingArguments
    @dataclasses.dataclass
    class SFTLikeConfig(TrainingArguments):
        max_length: int = dataclasses.field(default=128, metadata={"help": "sequence length"})

    (config,) = HfArgumentParser(SFTLikeConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--optim", "galore_adamw_8bit", "--max_length", "64", "--report_to", "none"]
    )
    assert config.optim is OptimizerNames.GALORE_ADAMW_8BIT and config.max_length == 64
    assert (
        SFTLikeConfig(output_dir=str(tmp_path), optim="qgalore_adamw_8bit").to_dict()["optim"] == "qgalore_adamw_8bit"
    )


# ---------------------------------------------------------------------- import behaviour (fresh processes)
def test_import_does_not_import_transformers_and_hook_registers_later():
    out = _run(
        """
        import sys
        import hf_galore_plugin
        assert "transformers" not in sys.modules, "import hf_galore_plugin imported transformers"
        from transformers import Trainer
        from transformers.training_args import OptimizerNames
        print(OptimizerNames("qgalore_adamw_8bit").name, Trainer.__init__._hf_galore_plugin_patch)
        """
    )
    assert out.stdout.split() == ["QGALORE_ADAMW_8BIT", "True"]


def test_import_after_transformers_registers_right_away():
    out = _run(
        """
        import transformers
        from transformers import Trainer
        import hf_galore_plugin
        from transformers.training_args import OptimizerNames
        print(OptimizerNames("qgalore_adamw_8bit").name, Trainer.__init__._hf_galore_plugin_patch)
        """
    )
    assert out.stdout.split() == ["QGALORE_ADAMW_8BIT", "True"]


def test_no_takeover_env_leaves_transformers_names_alone():
    out = _run(
        """
        import hf_galore_plugin
        from transformers import TrainingArguments
        from hf_galore_plugin.integrations.names import served_optimizer_names
        print(sorted(served_optimizer_names()))
        """,
        env={**ENV, "HF_GALORE_PLUGIN_NO_TAKEOVER": "1"},
    )
    assert out.stdout.strip() == "['galore_muon', 'qgalore_adamw_8bit']"


# ---------------------------------------------------------------------- dispatch
class _TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def test_get_optimizer_cls_and_kwargs_serves_plugin_names_and_passes_others_through(tmp_path):
    args = _args(
        tmp_path,
        optim="galore_adamw_8bit",
        optim_args="rank=8",
        learning_rate=3e-4,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-6,
        weight_decay=0.1,
    )
    model = _TinyMLP()
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    assert cls is GaLoreOptimizerFactory and issubclass(cls, torch.optim.Optimizer)
    assert kwargs["lr"] == 3e-4 and kwargs["betas"] == (0.8, 0.95) and kwargs["eps"] == 1e-6
    assert kwargs["galore_config"] == GaLoreConfig.preset("galore_adamw_8bit", rank=8)
    optimizer = cls([{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": 0.1}], **kwargs)
    assert isinstance(optimizer, hf_galore_plugin.AdamW)
    assert any(group.get("galore") for group in optimizer.param_groups)
    plain_cls, plain_kwargs = Trainer.get_optimizer_cls_and_kwargs(_args(tmp_path, optim="adamw_torch"), _TinyMLP())
    assert plain_cls is torch.optim.AdamW


@pytest.mark.parametrize(
    "name, base", [("galore_adamw_layerwise", "galore_adamw"), ("galore_adamw_8bit_layerwise", "galore_adamw_8bit")]
)
def test_layerwise_names_get_the_plugins_optimizer(tmp_path, caplog, name, base):
    # oracle: the kwargs the base name gets for the same arguments
    model = _TinyMLP()
    with caplog.at_level("WARNING", logger="hf_galore_plugin.integrations.layerwise"):
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(
            _args(tmp_path, optim=name, optim_target_modules=["up"], optim_args="rank=8"), model
        )
    assert cls is GaLoreOptimizerFactory
    assert kwargs["galore_config"] == GaLoreConfig.preset(
        base, rank=8, target_modules=kwargs["galore_config"].target_modules
    )
    _, base_kwargs = Trainer.get_optimizer_cls_and_kwargs(
        _args(tmp_path, optim=base, optim_target_modules=["up"], optim_args="rank=8"), _TinyMLP()
    )
    assert kwargs["galore_config"] == base_kwargs["galore_config"]
    lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(lines) <= 1  # logged once per process: absent when an earlier test logged it
    if lines:
        assert "never holds a dense gradient" in lines[0] and "HF_GALORE_PLUGIN_NO_TAKEOVER" in lines[0]


def test_layerwise_note_is_one_line_and_replaces_the_takeover_line():
    out = _run(
        """
        import logging, torch
        import hf_galore_plugin
        from transformers import Trainer, TrainingArguments
        logging.basicConfig(level=logging.WARNING, format="%(name)s|%(message)s")
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
        for _ in range(2):
            args = TrainingArguments("out", optim="galore_adamw_layerwise", optim_target_modules=["0"],
                                     optim_args="rank=8", report_to=[], use_cpu=True)
            Trainer.get_optimizer_cls_and_kwargs(args, model)
        """
    )
    lines = [line for line in out.stderr.splitlines() if "galore_adamw" in line]
    assert len(lines) == 1, out.stderr
    assert "never holds a dense gradient" in lines[0] and "gradient accumulation, DDP and gradient clipping" in lines[0]


def test_no_takeover_leaves_the_layerwise_names_to_transformers():
    out = _run(
        """
        import torch
        import hf_galore_plugin
        from transformers import Trainer, TrainingArguments
        from transformers.trainer_pt_utils import LayerWiseDummyOptimizer
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
        args = TrainingArguments("out", optim="galore_adamw_layerwise", optim_target_modules=["0"],
                                 report_to=[], use_cpu=True)
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        print(cls is LayerWiseDummyOptimizer)
        """,
        env={**ENV, "HF_GALORE_PLUGIN_NO_TAKEOVER": "1"},
    )
    assert out.stdout.split()[-1] == "True"


def test_deepspeed_optimizer_block_is_refused():
    class Args:  # what TrainingArguments(deepspeed=...) holds after __post_init__
        hf_deepspeed_config = type("DS", (), {"config": {"optimizer": {"type": "AdamW"}, "zero_optimization": {}}})()

    with pytest.raises(ValueError, match="Remove the 'optimizer' block"):
        check_training_args(Args(), "qgalore_adamw_8bit")

    class Plain:
        hf_deepspeed_config = type("DS", (), {"config": {"zero_optimization": {"stage": 2}}})()

    check_training_args(Plain(), "qgalore_adamw_8bit")  # no optimizer block: accepted


# ---------------------------------------------------------------------- optim_args
def test_optim_args_transformers_keys_and_ours_are_typed():
    overrides = parse_optim_args(
        "rank=64, update_proj_gap=100,scale=0.5,proj_type=reverse_std,lazy_refresh=true,max_proj_gap=none,"
        "state_bits=8,exclude_modules=lm_head+gate_proj,lr_scale=0.9"
    )
    assert overrides == {
        "rank": 64,
        "update_proj_gap": 100,
        "scale": 0.5,
        "proj_type": "reverse_std",
        "lazy_refresh": True,
        "max_proj_gap": None,
        "state_bits": 8,
        "exclude_modules": ["lm_head", "gate_proj"],
        "lr_scale": 0.9,
    }
    assert parse_optim_args(None) == {} and parse_optim_args("") == {}
    # every config field is a key
    for name in GaLoreConfig.field_names():
        assert name in str(pytest.raises(ValueError, parse_optim_args, "bogus=1").value)


@pytest.mark.parametrize(
    "optim_args, pattern",
    [
        ("rnak=8", r"unknown optim_args key 'rnak' \(value '8'\).*accepted keys: .*rank"),
        ("rank=8.5", r"key 'rank' has a bad value '8.5'.*expected int or 'auto'"),
        ("lazy_refresh=maybe", r"key 'lazy_refresh' has a bad value 'maybe'.*true/false"),
        ("proj_type=diagonal", r"proj_type='diagonal'.*choose one of"),
        ("rank=0", r"rank=0.*positive rank"),
        ("rank", r"not of the form key=value"),
        ("rank=8,rank=9", r"given twice"),
    ],
)
def test_bad_optim_args_fail_with_key_value_and_accepted(optim_args, pattern):
    with pytest.raises(ValueError, match=pattern):
        config_from_training_args(
            GaLoreConfig.preset("galore_adamw"),
            optim_args=optim_args,
            optim_target_modules=None,
            optimizer_name="galore_adamw",
        )


# Strings transformers' own parser reads differently or not at all, and ones it reads as we do.
PARSER_CASES = [
    "rank=8,update_proj_gap=3",
    " rank = 8 , update_proj_gap=3 ",
    "exclude_modules=o_proj+down_proj",
    "rank=8,,update_proj_gap=3",
    "rank=8,",
    ",rank=8",
    "rank=8=9",
    "rank",
    "exclude_modules=o proj",
    "target_modules=.*self attn.*",
]


def _as_written(optim_args: str):
    """What the user wrote: ','-separated key=value items, spaces around them ignored (None: no such reading)."""
    try:
        return {key.strip(): value.strip() for key, value in (item.split("=") for item in optim_args.split(","))}
    except ValueError:
        return None


@pytest.mark.parametrize("optim_args", PARSER_CASES)
def test_optim_args_are_accepted_exactly_when_transformers_parses_them_as_written(optim_args):
    # The oracle: transformers' own parser, which runs on the same string when training starts. Ours must
    # refuse what it fails on or reads differently (spaces inside a value), and read the rest as it does.
    import importlib.util

    if importlib.util.find_spec("transformers.trainer_optimizer") is None:
        pytest.skip("platform: this transformers parses optim_args inside get_optimizer_cls_and_kwargs (4.57)")
    import transformers.trainer_optimizer as trainer_optimizer

    if not hasattr(trainer_optimizer, "_parse_optim_args"):
        pytest.skip("platform: this transformers parses optim_args inside get_optimizer_cls_and_kwargs (4.57)")
    try:
        theirs = trainer_optimizer._parse_optim_args(optim_args)
    except ValueError:
        theirs = None
    try:
        ours = dict(_split_pairs(optim_args))
    except ValueError:
        ours = None
    assert (ours is not None) == (theirs is not None and theirs == _as_written(optim_args))
    if ours is not None:
        assert ours == theirs


@pytest.mark.parametrize(
    "optim_args, pattern",
    [
        ("rank=8,,update_proj_gap=3", r"optim_args item 2 is empty .*Remove the extra comma"),
        ("rank=8,update_proj_gap=3,", r"optim_args item 3 is empty"),
        ("rank=8,exclude_modules=o proj", r"space inside 'o proj'.*silently become 'oproj'"),
    ],
)
def test_optim_args_transformers_cannot_parse_fail_at_trainer_construction(tmp_path, optim_args, pattern):
    args = _args(tmp_path, optim="galore_adamw", optim_args=optim_args)
    model = _TinyMLP()
    with pytest.raises(ValueError, match=pattern):
        Trainer(model=model, args=args)
    assert isinstance(model.up, nn.Linear) and hf_galore_plugin.state_of(model) is None


def test_both_pattern_keys_read_one_item_as_a_regex_and_plus_as_a_list():
    # One rule for target_modules and exclude_modules: a string is a regex, a list (items joined by '+',
    # a trailing '+' for one item) holds substrings.
    for key in ("target_modules", "exclude_modules"):
        assert parse_optim_args(f"{key}=.*o_proj") == {key: ".*o_proj"}
        assert parse_optim_args(f"{key}=o_proj+") == {key: ["o_proj"]}
        assert getattr(GaLoreConfig(**{key: ".*o_proj"}), key) == ".*o_proj"


def test_bad_optim_args_fail_at_trainer_construction(tmp_path):
    args = _args(tmp_path, optim="qgalore_adamw_8bit", optim_args="rank=8,update_gap=3")
    model = _TinyMLP()
    with pytest.raises(ValueError, match="unknown optim_args key 'update_gap'"):
        Trainer(model=model, args=args)
    assert isinstance(model.up, nn.Linear) and hf_galore_plugin.state_of(model) is None


@pytest.mark.parametrize(
    "targets", [["q_proj", "v_proj"], ["attn"], [r".*layers\.1\..*proj"], r".*mlp\..*", "all-linear", "all_linear"]
)
def test_optim_target_modules_select_what_transformers_selects(targets):
    names = [
        f"model.layers.{i}.{block}.{proj}"
        for i in range(2)
        for block, projs in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("up_proj", "down_proj")))
        for proj in projs
    ] + ["lm_head"]
    regex = target_modules_from_optim_target_modules(targets)
    if regex == "all-linear":
        assert targets in ("all-linear", "all_linear")
        return
    ours = [name for name in names if re.fullmatch(regex, name)]
    theirs = [name for name in names if check_target_module_exists(targets, name)]
    assert ours == theirs and ours
