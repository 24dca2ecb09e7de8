"""Pre-train a tiny Llama on Shakespeare with AdamW, GaLore, 8-bit GaLore, Q-GaLore and LoRA, side by side.

    bash scripts/demo.sh                          # CPU defaults: ~5 minutes on 2 cores
    bash scripts/demo.sh --steps 50 --methods adamw_torch,qgalore_adamw_8bit
    bash scripts/demo.sh --scale gpu              # a bigger model and more steps, for a GPU

Everything runs offline: the text ships in data/ (see data/README.md), the tokenizer is a byte-level
BPE trained on that text in about a second, and the model is a LlamaConfig initialised from the seed.
Every method trains with ``transformers.Trainer``: the plugin's optimizers are plain
``TrainingArguments(optim="qgalore_adamw_8bit", optim_args="rank=...,update_proj_gap=...")`` after
``import hf_galore_plugin``, which attaches its GaLoreCallback automatically. All runs share the seed,
so they start from the same weights and see the batches in the same order.

Every method trains at one learning rate, the user's: AdamW's best rate on this model (``--lr``), with
every other setting at its default. That is the drop-in promise: change ``optim`` and nothing else. GaLore's
default ``scale='auto'`` gives each projected layer the scale that makes its update as large as AdamW's, so
the rate means for it what it means for AdamW. The table and the reading compare every method with AdamW.

The console shows one progress bar per method (the latest training loss in it), then the results table
and a paragraph reading it: which method reached the lowest held-out loss, by how much, at what memory,
and where every other method ends against the better AdamW baseline.
Written to --out (default outputs/demo): results.md, results.json, loss_curves.png, memory.png.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import logging
import math
import os
import pathlib
import sys
import threading
import time
import warnings
from typing import Any, Optional

import torch

import hf_galore_plugin  # noqa: F401  registers optim="galore_adamw" / "galore_adamw_8bit" / "qgalore_adamw_8bit"


class BnbCpuKernelNotice(logging.Filter):
    """Drops one bitsandbytes record from the demo's console, and nothing else.

    ``transformers.trainer`` imports peft, and peft imports bitsandbytes whenever it is installed
    (``peft.helpers``). On a CPU with AVX512-BF16, bitsandbytes' CPU backend then tries to fetch its 4-bit
    GEMM from the Hugging Face hub (``kernels`` package, ``kernels-community``) at import, and logs a warning
    when that fails (offline, or ``kernels`` not installed). The demo never runs a bitsandbytes 4-bit matmul
    (its Q-GaLore weights are this package's NF4, its LoRA base is unquantized), so the notice is not about
    anything the demo does. The filter sits on that one logger and matches that one message: any other
    bitsandbytes record still shows.
    """

    LOGGER = "bitsandbytes.backends.cpu.ops"
    PREFIX = "Failed to load CPU gemm_4bit_forward from kernels-community"

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PREFIX)


def quiet_bitsandbytes_cpu_kernel_notice() -> None:
    """Install :class:`BnbCpuKernelNotice` (before anything imports bitsandbytes; idempotent)."""
    target = logging.getLogger(BnbCpuKernelNotice.LOGGER)
    if not any(isinstance(f, BnbCpuKernelNotice) for f in target.filters):
        target.addFilter(BnbCpuKernelNotice())


def name_the_cpu_to_deepspeed() -> None:
    """Without a GPU, tell DeepSpeed it runs on the CPU (``DS_ACCELERATOR=cpu``, its documented override).

    transformers imports DeepSpeed whenever it is installed; DeepSpeed then probes for an accelerator and,
    finding none, logs "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
    detect it." Naming the CPU makes the same choice without the notice. With a GPU nothing is set, and a
    DS_ACCELERATOR the user set is kept."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


quiet_bitsandbytes_cpu_kernel_notice()
name_the_cpu_to_deepspeed()

REPO = pathlib.Path(__file__).resolve().parent.parent
TRAIN_TEXT = REPO / "data" / "shakespeare.txt"
HELDOUT_TEXT = REPO / "data" / "shakespeare_heldout.txt"

GALORE_METHODS = ("galore_adamw", "galore_adamw_8bit", "qgalore_adamw_8bit")
ADAMW_BASELINES = ("adamw_torch",)
ALL_METHODS = (*ADAMW_BASELINES, *GALORE_METHODS, "lora")

# The one peak learning rate of every method (linear warmup over 10% of the steps, cosine decay after it):
# adamw_torch's best rate in the quality grid (docs/benchmarks/quality-pretraining.md "Quality (pre-training)", benchmarks/quality.py size tiny: the
# same text, a Llama of the same family; grid 1e-3 -> 4.818, 3e-3 -> 4.675, 1e-2 -> 5.013 held-out loss at
# seed 0). A user switching from AdamW keeps it: the GaLore presets scale each projected layer's update to
# AdamW's norm (scale='auto') and apply their lr_scale (0.85) to the projected groups themselves; LoRA
# (rank 8, alpha 16) trains its adapters and the embeddings, head and norms at it (its own best rate in the
# grid too: 1e-3 -> 5.020, 3e-3 -> 4.426, 1e-2 -> 5.664).
USER_LEARNING_RATE = 3e-3
LEARNING_RATE_SOURCE = "AdamW's best rate in the quality grid (BENCHMARKS.md, Quality), the same for every method"
LORA_RANK, LORA_ALPHA = 8, 16
# The linear layers of every decoder block: where LoRA puts its adapters (GaLore's default targets on this
# model are the same layers: every nn.Linear but the output head).
BLOCK_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclasses.dataclass
class Scale:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    seq_len: int
    batch_size: int
    steps: int
    vocab_size: int


SCALES = {
    # ~1.1M parameters, 120 steps of 8 x 128 tokens (0.12M tokens, a seventh of the training text).
    # 150 steps until the second AdamW baseline came: six runs of 120 steps cost about what five of 150
    # did, which keeps the README's first command (install included) under 6 minutes on 2 cores.
    "cpu": Scale(
        hidden=128, layers=4, heads=4, intermediate=352, seq_len=128, batch_size=8, steps=120, vocab_size=1024
    ),
    # ~13M parameters, 1500 steps of 32 x 256 tokens: a few minutes per method on one GPU.
    "gpu": Scale(
        hidden=384, layers=8, heads=8, intermediate=1024, seq_len=256, batch_size=32, steps=1500, vocab_size=2048
    ),
}


# ---------------------------------------------------------------------- data
def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE trained on `text` (about a second for the 2 MB of plays), as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    lines = text.split("\n")
    tokenizer.train_from_iterator(("\n".join(lines[i : i + 200]) for i in range(0, len(lines), 200)), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def token_blocks(tokenizer, text: str, seq_len: int) -> torch.Tensor:
    """The text as consecutive, non-overlapping blocks of `seq_len` tokens (the tail is dropped)."""
    # Encode in chunks of lines: one 2 MB string is slower, and BPE never merges across a newline here.
    lines = text.split("\n")
    chunks = ["\n".join(lines[i : i + 500]) + ("\n" if i + 500 < len(lines) else "") for i in range(0, len(lines), 500)]
    ids = [i for chunk in tokenizer(chunks)["input_ids"] for i in chunk]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


# ---------------------------------------------------------------------- model
def build_model(scale: Scale, vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)  # same initial weights for every method
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=scale.hidden,
        intermediate_size=scale.intermediate,
        num_hidden_layers=scale.layers,
        num_attention_heads=scale.heads,
        num_key_value_heads=scale.heads,
        max_position_embeddings=scale.seq_len,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def wrap_lora(model):
    """LoRA as the GaLore paper's low-rank baseline: adapters on every attention and MLP linear layer;
    the embeddings, output head and norms are trained fully (a randomly initialised frozen embedding
    would make pre-training impossible)."""
    from hf_galore_plugin.utils import require

    require("peft", feature="the demo's LoRA baseline")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=BLOCK_LINEARS,
        modules_to_save=["embed_tokens", "lm_head"],
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft (0.21) asks the model `is_gradient_checkpointing`, which transformers 5.x deprecates in favour of
        # `is_activation_checkpointing`: a FutureWarning about peft's call, not about anything the demo does
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = get_peft_model(model, config)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.requires_grad_(True)
    return model


# ---------------------------------------------------------------------- measurement
def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def training_state_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Exact bytes of what training holds besides activations: every parameter and buffer of the model
    (frozen and quantized weights included), gradients, optimizer state, and projection bases."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the optimizer
    bases = [b for name, b in model.named_buffers() if "galore_basis_" in name]
    others = [b for name, b in model.named_buffers() if "galore_basis_" not in name]
    return {
        "weights": tensor_bytes(model.parameters()) + tensor_bytes(others),
        "grads": tensor_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer_state": tensor_bytes(v for state in inner.state.values() for v in state.values()),
        "bases": tensor_bytes(bases),
    }


class PeakMemorySampler:
    """Peak memory of a run. CUDA: torch.cuda.max_memory_allocated (exact). CPU: the process's resident
    set size read from /proc/self/statm every millisecond by a thread, minus the value before the run
    (a sampled estimate of the peak; glibc's free memory is trimmed first so runs start alike)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "peak CUDA allocated" if device.type == "cuda" else "peak RSS over baseline (sampled, 1 ms)"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.baseline = self.peak = 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _poll(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> "PeakMemorySampler":
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        elif os.path.exists("/proc/self/statm"):
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            self.baseline = self.peak = self._rss()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated()
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()

    @property
    def bytes(self) -> Optional[int]:
        if self.device.type != "cuda" and self._thread is None:
            return None
        return self.peak - self.baseline if self.device.type != "cuda" else self.peak


def _refresh_total(model: torch.nn.Module) -> int:
    return sum(int(b) for name, b in model.named_buffers() if name.endswith("galore_num_refreshes"))


def make_probe():
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        """Times every optimizer step (on_step_begin -> on_step_end, after the GaLore callback's refresh),
        notes which steps refreshed a basis, and records the training-state bytes at the last optimizer
        step, while gradients still exist."""

        def __init__(self) -> None:
            self.step_seconds: list[float] = []
            self.refresh_steps: list[bool] = []
            self.state_bytes: dict[str, int] = {}
            self._start = 0.0
            self._refreshes = 0

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            self._refreshes = _refresh_total(model)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            if state.global_step + 1 == state.max_steps:
                self.state_bytes = training_state_bytes(model, optimizer)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.step_seconds.append(time.perf_counter() - self._start)
            self.refresh_steps.append(_refresh_total(model) != self._refreshes)

        def seconds_per_step(self) -> float:
            """Median of the ordinary steps plus the refreshes' extra time spread over all steps.

            Step 0 (a GaLore run's calibration step; the first AdamW step) is left out. The median keeps
            the number steady on a shared machine; refresh steps are added back as their excess over the
            median, so the rate is what a long run with this gap would see.
            """
            timed = list(zip(self.step_seconds[1:], self.refresh_steps[1:])) or list(
                zip(self.step_seconds, self.refresh_steps)
            )
            ordinary = sorted(t for t, refreshed in timed if not refreshed) or sorted(t for t, _ in timed)
            median = ordinary[len(ordinary) // 2]
            extra = sum(t - median for t, refreshed in timed if refreshed)
            return median + extra / len(timed)

    return Probe()


def make_progress(method: str):
    from transformers.trainer_callback import ProgressCallback

    class MethodProgress(ProgressCallback):
        """The Trainer's progress bar, named after the method, with the latest training loss in it instead
        of a printed log line per logging step; the held-out evaluation after training gets no bar of its
        own, so each method shows exactly one."""

        def on_train_begin(self, args, state, control, **kwargs):
            super().on_train_begin(args, state, control, **kwargs)
            if self.training_bar is not None:
                self.training_bar.set_description(method)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.training_bar is not None and logs and "loss" in logs:
                self.training_bar.set_postfix(loss=f"{logs['loss']:.3f}", refresh=False)

        def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
            pass

        def on_evaluate(self, args, state, control, **kwargs):
            pass

    return MethodProgress()


# ---------------------------------------------------------------------- one run
def train_one(method: str, scale: Scale, data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import ProgressCallback

    model = build_model(scale, data["vocab_size"], args.seed)
    optim, optim_args, setting = method, None, None
    rank = max(1, scale.hidden // 4)
    gap = max(1, scale.steps // 5)
    if method in GALORE_METHODS:
        optim_args = setting = f"rank={rank},update_proj_gap={gap}"
    elif method == "lora":
        optim = "adamw_torch"
        model = wrap_lora(model)
    elif method != "adamw_torch":
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(ALL_METHODS)}")
    training_args = TrainingArguments(
        output_dir=str(args.out / "runs" / method),
        max_steps=scale.steps,
        per_device_train_batch_size=scale.batch_size,
        per_device_eval_batch_size=scale.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=scale.steps // 10,
        weight_decay=0.0,
        optim=optim,
        optim_args=optim_args,
        logging_steps=max(1, scale.steps // 50),
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        use_cpu=args.device.type == "cpu",
        disable_tqdm=False,
    )
    probe = make_probe()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        callbacks=[probe],
    )
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(make_progress(method))
    print(
        f"{method}: lr {args.lr:.3g}" + (f", {setting}" if setting else ""),
        flush=True,
    )
    with PeakMemorySampler(args.device) as memory:
        trainer.train()
    held_out = trainer.evaluate(eval_dataset=data["heldout"])["eval_loss"]
    history = [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    tail = [loss for step, loss in history if step > 0.9 * scale.steps] or [history[-1][1]]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "method": method,
        "learning_rate": args.lr,
        "optim_args": optim_args,
        "setting": setting,
        "trainable_params": trainable,
        "loss_history": history,
        "first_train_loss": history[0][1],
        "final_train_loss": sum(tail) / len(tail),
        "heldout_loss": held_out,
        "heldout_perplexity": math.exp(held_out),
        "state_bytes": probe.state_bytes,
        "state_bytes_total": sum(probe.state_bytes.values()),
        "peak_memory_bytes": memory.bytes,
        "peak_memory_kind": memory.kind,
        "steps_per_second": 1.0 / probe.seconds_per_step(),
        "refresh_steps": sum(probe.refresh_steps),
        "galore_refreshes": _refresh_count(trainer.state.log_history),
    }


def _refresh_count(log_history: list[dict[str, Any]]) -> Optional[int]:
    counts = [entry["galore/refreshes"] for entry in log_history if "galore/refreshes" in entry]
    return int(counts[-1]) if counts else None


# ---------------------------------------------------------------------- report
def mb(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f}"


def adamw_baseline(results: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The AdamW run the table and the reading compare with (None when it was not run)."""
    return next((r for r in results if r["method"] in ADAMW_BASELINES), None)


def results_table(results: list[dict[str, Any]]) -> str:
    reference = adamw_baseline(results)
    kind = results[0]["peak_memory_kind"]
    header = (
        "| method | final train loss | held-out loss | held-out vs AdamW | perplexity | training-state MB (weights / "
        f"grads / optimizer / bases) | vs AdamW | {kind} MB | steps/s | speed vs AdamW |"
    )
    rows = [header, "|" + "---|" * 10]
    for r in results:
        parts = r["state_bytes"]
        if reference is None:
            ratio_loss = ratio_bytes = ratio_speed = "n/a"
        else:
            ratio_loss = "baseline" if r is reference else f"{r['heldout_loss'] - reference['heldout_loss']:+.3f}"
            ratio_bytes = f"{r['state_bytes_total'] / reference['state_bytes_total']:.0%}"
            ratio_speed = f"{r['steps_per_second'] / reference['steps_per_second']:.2f}x"
        rows.append(
            f"| {r['method']} | {r['final_train_loss']:.3f} | {r['heldout_loss']:.3f} | {ratio_loss} "
            f"| {r['heldout_perplexity']:.1f} | {mb(r['state_bytes_total'])} ({mb(parts['weights'])} / "
            f"{mb(parts['grads'])} / {mb(parts['optimizer_state'])} / {mb(parts['bases'])}) | {ratio_bytes} "
            f"| {mb(r['peak_memory_bytes'])} | {r['steps_per_second']:.2f} | {ratio_speed} |"
        )
    return "\n".join(rows)


def plain_reading(results: list[dict[str, Any]], steps: int) -> str:
    """One paragraph saying in words what the table shows, computed from its numbers."""
    by_loss = sorted(results, key=lambda r: r["heldout_loss"])
    best = by_loss[0]
    reference = adamw_baseline(results)

    def versus_adamw(r: dict[str, Any]) -> str:
        if reference is None or r["method"] in ADAMW_BASELINES:
            return ""
        return f", {r['state_bytes_total'] / reference['state_bytes_total']:.0%} of AdamW's {mb(reference['state_bytes_total'])} MB"

    text = (
        f"Reading the table: {best['method']} reached the lowest held-out loss, {best['heldout_loss']:.3f} "
        f"(perplexity {best['heldout_perplexity']:.1f})"
    )
    if len(by_loss) > 1:
        runner = by_loss[1]
        text += (
            f", {runner['heldout_loss'] - best['heldout_loss']:.3f} below the next best, {runner['method']} "
            f"({runner['heldout_loss']:.3f})"
        )
    text += f", while holding {mb(best['state_bytes_total'])} MB of training state{versus_adamw(best)}."
    others = [r for r in results if r["method"] not in ADAMW_BASELINES]
    if reference is not None and others:

        def against(r: dict[str, Any]) -> str:
            gap = r["heldout_loss"] - reference["heldout_loss"]
            return f"{r['method']} {abs(gap):.3f} {'below' if gap < 0 else 'above'}"

        text += (
            f" Against AdamW, {reference['method']} ({reference['heldout_loss']:.3f}): "
            f"{', '.join(against(r) for r in others)}."
        )
    smallest = min(results, key=lambda r: r["state_bytes_total"])
    if len(results) > 1 and smallest is best:
        text += " It also held the smallest training state of all methods."
    elif len(results) > 1:
        text += (
            f" The smallest training state was {smallest['method']}'s, {mb(smallest['state_bytes_total'])} MB"
            f"{versus_adamw(smallest)}, at a held-out loss {smallest['heldout_loss'] - best['heldout_loss']:.3f} "
            "higher."
        )
    fastest = max(results, key=lambda r: r["steps_per_second"])
    if len(results) > 1:
        text += (
            f" {fastest['method']} ran fastest ({fastest['steps_per_second']:.2f} steps/s"
            + ("" if fastest is best else f"; {best['method']} {best['steps_per_second']:.2f}")
            + ")."
        )
    text += (
        f" These are {steps} steps of one seed on a tiny model: BENCHMARKS.md compares the methods over "
        "several seeds and learning rates."
    )
    return text


def plot(results: list[dict[str, Any]], out: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        steps, losses = zip(*r["loss_history"])
        # the AdamW baselines dashed: the references every other curve is read against
        style = "--" if r["method"] in ADAMW_BASELINES else "-"
        line = ax.plot(steps, losses, style, label=f"{r['method']} (held-out {r['heldout_loss']:.2f})")[0]
        ax.scatter([steps[-1]], [r["heldout_loss"]], marker="x", color=line.get_color())
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (x: held-out loss at the end)")
    ax.set_title("Tiny Llama on Shakespeare")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    curves = out / "loss_curves.png"
    fig.savefig(curves, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["method"] for r in results]
    bottom = [0.0] * len(results)
    for part in ("weights", "grads", "optimizer_state", "bases"):
        values = [r["state_bytes"][part] / 2**20 for r in results]
        ax.bar(names, values, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("training-state MB (exact)")
    ax.set_title("What training holds besides activations")
    ax.tick_params(axis="x", rotation=20)
    ax.legend()
    fig.tight_layout()
    memory = out / "memory.png"
    fig.savefig(memory, dpi=120)
    plt.close(fig)
    return [curves, memory]


# ---------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--scale", choices=sorted(SCALES), default="cpu", help="model and run size (default: cpu)")
    parser.add_argument("--steps", type=int, help="optimizer steps per method (default: the scale's)")
    parser.add_argument(
        "--methods", default=",".join(ALL_METHODS), help=f"comma-separated subset of {','.join(ALL_METHODS)}"
    )
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "outputs" / "demo", help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lr",
        type=float,
        default=USER_LEARNING_RATE,
        help=f"the one peak learning rate of every method (default {USER_LEARNING_RATE:g}: {LEARNING_RATE_SOURCE})",
    )
    parser.add_argument(
        "--eval-blocks", type=int, default=96, help="held-out blocks to evaluate (default 96; 0: all of the play)"
    )
    model = parser.add_argument_group("model overrides (default: the scale's)")
    for name in ("hidden", "layers", "heads", "intermediate", "seq_len", "batch_size", "vocab_size"):
        model.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name)
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in ALL_METHODS]
    if unknown or not args.methods:
        parser.error(f"--methods: unknown {unknown}; choose from {','.join(ALL_METHODS)}")
    overrides = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "intermediate", "seq_len", "batch_size",
                                               "vocab_size", "steps") if getattr(args, k) is not None}  # fmt: skip
    args.config = dataclasses.replace(SCALES[args.scale], **overrides)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    scale: Scale = args.config
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tokenizer = train_tokenizer(TRAIN_TEXT.read_text(encoding="ascii"), scale.vocab_size)
    tokenizer.save_pretrained(args.out / "tokenizer")
    heldout = token_blocks(tokenizer, HELDOUT_TEXT.read_text(encoding="ascii"), scale.seq_len)
    data = {
        "vocab_size": len(tokenizer),
        "train": Blocks(token_blocks(tokenizer, TRAIN_TEXT.read_text(encoding="ascii"), scale.seq_len)),
        "heldout": Blocks(heldout[: args.eval_blocks or len(heldout)]),
    }
    print(
        f"data: {len(data['train'])} training blocks and {len(data['heldout'])} held-out blocks of {scale.seq_len} "
        f"tokens (BPE vocabulary {data['vocab_size']}); model: {dataclasses.asdict(scale)}; device: {args.device}",
        flush=True,
    )
    results = [train_one(method, scale, data, args) for method in args.methods]
    seconds = time.perf_counter() - started

    table = results_table(results)
    notes = (
        f"{scale.steps} steps of {scale.batch_size} x {scale.seq_len} tokens per method, seed {args.seed}, "
        f"device {args.device}, {torch.get_num_threads()} threads; wall time {seconds:.0f} s for all runs.\n\n"
        "- training-state MB: exact bytes at the last optimizer step of every parameter and buffer (frozen "
        "and int8 weights included), gradient, optimizer state tensor and projection basis; activations "
        "are not included.\n"
        f"- {results[0]['peak_memory_kind']}: measured around trainer.train(); includes activations and "
        "allocator overhead.\n"
        "- steps/s: median optimizer step (steps 2..N, all methods in this process) plus the basis refresh "
        "steps' extra time spread over all steps.\n"
        f"- one learning rate for every method, {args.lr:.3g} ({LEARNING_RATE_SOURCE if args.lr == USER_LEARNING_RATE else 'set by --lr'}), "
        "every other setting at its default: GaLore's scale='auto' matches each projected layer's update to "
        "AdamW's and lr_scale 0.85 applies to the projected groups, as for any user who only changes optim.\n"
        "- final train loss: mean logged training loss over the last 10% of steps; held-out loss: the first "
        f"{len(data['heldout'])} blocks of a play never trained on (The Tempest)."
    )
    reading = plain_reading(results, scale.steps)
    (args.out / "results.md").write_text(f"# Demo results\n\n{table}\n\n{notes}\n\n{reading}\n")
    summary = {
        "scale": dataclasses.asdict(scale),
        "seed": args.seed,
        "device": str(args.device),
        "wall_seconds": seconds,
        "results": results,
        "reading": reading,
    }
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    pictures = plot(results, args.out)
    print("\n" + table + "\n\n" + notes + "\n")
    for path in [args.out / "results.md", args.out / "results.json", *pictures]:
        print(f"wrote {path}")
    print("\n" + reading)
    return 0


if __name__ == "__main__":
    sys.exit(main())
