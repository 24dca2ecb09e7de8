"""What the quality and fine-tuning benchmarks share: one optimizer setup per method, the learning-rate
schedule, seed statistics and the loss-curve plot (models and byte counts: `_models`).

Every method trains the same model object in the same plain PyTorch loop, so the only thing that
differs between two runs of one seed is the method. Imports of the compared packages (peft,
bitsandbytes, galore-torch, transformers' optimizer dispatch) happen inside the setup of the
method that needs them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import pathlib
import re
import statistics
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

# Names transformers owns ("galore_adamw") must reach transformers' own implementation in these
# benchmarks: the plugin reads this variable when it is first imported, so set it before that.
os.environ.setdefault("HF_GALORE_PLUGIN_NO_TAKEOVER", "1")

from _models import preset_names  # noqa: E402

OURS = preset_names()
# Every preset, for what needs no Adam-state accounting (a step's time and measured peak: gpu_step.py).
EVERY_PRESET = preset_names(every=True)


@dataclasses.dataclass(frozen=True)
class MethodSetup:
    """How one run trains: the targets and ranks shared by the low-rank methods."""

    targets_regex: str  # nn.Linear layers the low-rank methods act on (re.fullmatch on the module name)
    extra_trainable: str  # other parameters the adapter methods train fully (re.search on the name)
    galore_rank: int
    galore_gap: int
    galore_scale: float | str  # a float, or "auto" (each layer's norm-matched scale)
    lora_rank: int
    lora_matched_rank: int
    head_regex: Optional[str] = None  # parameters (re.search on the name) trained at head_lr by every method
    head_lr: Optional[float] = None
    # GaLoreConfig fields that differ from the preset (ablations), as (name, value) pairs.
    galore_overrides: tuple = ()


def param_groups(model: nn.Module, setup: MethodSetup, lr: float) -> list[dict[str, Any]]:
    """Trainable parameters in one group at `lr`, or two when a task head has its own rate."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    is_head = lambda name: setup.head_regex is not None and re.search(setup.head_regex, name)  # noqa: E731
    groups = [{"params": [p for n, p in named if not is_head(n)], "lr": lr, "weight_decay": 0.0}]
    head = [p for n, p in named if is_head(n)]
    if head:
        groups.append({"params": head, "lr": setup.head_lr, "weight_decay": 0.0})
    return groups


def target_names(model: nn.Module, targets_regex: str) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and re.fullmatch(targets_regex, n)]


def matched_lora_rank(model: nn.Module, targets_regex: str, galore_rank: int) -> int:
    """The LoRA rank whose adapters hold as many trainable values as our GaLore factors at `galore_rank`.

    A GaLore factor of an m x n layer has max(m, n) * r values (one-sided projection); LoRA's A and B
    hold r' * (m + n). Equal counts mean equal gradient and fp32 Adam-state bytes for the targets.
    """
    shapes = [m.weight.shape for n, m in model.named_modules() if n in set(target_names(model, targets_regex))]
    galore_values = sum(max(s) * min(galore_rank, min(s)) for s in shapes)
    per_lora_rank = sum(s[0] + s[1] for s in shapes)
    return max(1, round(galore_values / per_lora_rank))


# ---------------------------------------------------------------------- QLoRA-style frozen NF4 base
class NF4FrozenLinear(nn.Module):
    """A frozen nn.Linear stored as NF4 (block 64, double-quantized scales: QLoRA's format) through
    hf_galore_plugin.quant; the forward dequantizes the weight. Its buffers are all it stores."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from hf_galore_plugin.quant import quantize

        self.in_features, self.out_features = linear.in_features, linear.out_features
        tensors, self._meta = quantize(
            linear.weight.detach(), scheme="nf4", bits=4, block_size=64, double_quant=True
        ).to_state()
        self._names = list(tensors)
        for name, tensor in tensors.items():
            self.register_buffer(f"nf4_{name}", tensor)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from hf_galore_plugin.quant import rebuild_quantized_tensor

        state = {name: getattr(self, f"nf4_{name}") for name in self._names}
        return F.linear(x, rebuild_quantized_tensor(state, self._meta).dequantize(x.dtype), self.bias)


# ---------------------------------------------------------------------- methods
def _lora(model: nn.Module, setup: MethodSetup, rank: int, nf4_base: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    names = target_names(model, setup.targets_regex)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=names)
    model = get_peft_model(model, config)
    for name, param in model.named_parameters():
        if "lora_" not in name and re.search(setup.extra_trainable, name):
            param.requires_grad_(True)
    if nf4_base:
        for module in model.modules():
            if isinstance(module, LoraLayer) and isinstance(module.base_layer, nn.Linear):
                module.base_layer = NF4FrozenLinear(module.base_layer)
    return model


def _galore_torch_groups(model: nn.Module, setup: MethodSetup) -> list[dict[str, Any]]:
    names = {f"{n}.weight" for n in target_names(model, setup.targets_regex)}
    params = dict(model.named_parameters())
    return [
        {"params": [p for n, p in params.items() if n not in names and p.requires_grad]},
        {
            "params": [p for n, p in params.items() if n in names and p.requires_grad],
            "rank": setup.galore_rank,
            "update_proj_gap": setup.galore_gap,
            "scale": setup.galore_scale,
            "proj_type": "std",
        },
    ]


def galore_lr_multiplier(config: Any, step: int, steps: int) -> float:
    """The factor the Trainer integration (GaLoreCallback.multiplier_at) applies to the GaLore groups'
    learning rate before optimizer step `step` of `steps`: lr_scale, recovering linearly to 1 over
    lr_recovery_fraction of training."""
    if config.lr_recovery_fraction <= 0 or steps <= 0:
        return config.lr_scale
    progress = min(1.0, step / (config.lr_recovery_fraction * steps))
    return config.lr_scale + (1.0 - config.lr_scale) * progress


def _transformers_galore(model: nn.Module, setup: MethodSetup, lr: float) -> torch.optim.Optimizer:
    """transformers' own `optim="galore_adamw"` dispatch (Trainer.get_optimizer_cls_and_kwargs)."""
    from transformers import Trainer, TrainingArguments

    import hf_galore_plugin.integrations.names as plugin

    if plugin.served_optimizer_names().get("galore_adamw") == "takeover":
        raise RuntimeError(
            "hf_galore_plugin serves optim='galore_adamw' in this process; run this benchmark as a script "
            "(it sets HF_GALORE_PLUGIN_NO_TAKEOVER=1 before the plugin is imported)"
        )
    args = TrainingArguments(
        output_dir=os.devnull, optim="galore_adamw", learning_rate=lr, weight_decay=0.0, report_to="none",
        optim_target_modules=setup.targets_regex, use_cpu=True,
        optim_args=f"rank={setup.galore_rank},update_proj_gap={setup.galore_gap},scale={setup.galore_scale}",
    )  # fmt: skip
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    if not cls.__module__.startswith("galore_torch"):
        raise RuntimeError(f"transformers dispatched optim='galore_adamw' to {cls.__module__}.{cls.__name__}")
    params = kwargs.pop("params")
    return cls(params, **kwargs)


def setup_method(
    method: str, model: nn.Module, setup: MethodSetup, *, lr: float
) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """(model, optimizer, after_step) for `method`; weight decay 0 and Adam eps 1e-8 everywhere."""
    after_step: Callable[[], None] = lambda: None  # noqa: E731
    common = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    if method == "adamw":
        optimizer = torch.optim.AdamW(param_groups(model, setup, lr), **common)
    elif method == "adamw_fused":  # torch's fastest AdamW: one fused kernel per group (CUDA and CPU)
        optimizer = torch.optim.AdamW(param_groups(model, setup, lr), fused=True, **common)
    elif method == "torchao_adamw8bit":  # full-rank 8-bit state, torchao's blockwise layout
        from torchao.optim import AdamW8bit

        optimizer = AdamW8bit(param_groups(model, setup, lr), **common)
    elif method == "adamw_galore_rates":
        projected = set(target_names(model, setup.targets_regex))
        optimizer = torch.optim.AdamW(galore_rate_groups(model, projected, lr=lr, scale=setup.galore_scale), **common)
    elif method == "bnb_adamw8bit":
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(param_groups(model, setup, lr), **common)
    elif method == "galore_torch":
        from galore_torch import GaLoreAdamW

        optimizer = GaLoreAdamW(_galore_torch_groups(model, setup), **common)
    elif method == "transformers_galore":
        optimizer = _transformers_galore(model, setup, lr)
    elif method in EVERY_PRESET:
        from hf_galore_plugin import GaLoreConfig, after_step as galore_after_step, create_optimizer, prepare_model

        config = GaLoreConfig.preset(
            method, **{"rank": setup.galore_rank, "update_proj_gap": setup.galore_gap, "scale": setup.galore_scale,
                       "target_modules": setup.targets_regex, **dict(setup.galore_overrides)},
        )  # fmt: skip
        model = prepare_model(model, config)
        optimizer = create_optimizer(model, **common, param_groups=param_groups(model, setup, lr))

        def after_step() -> None:
            galore_after_step(model, optimizer)

    elif method in ("lora_r8", "lora_matched", "qlora_nf4"):
        rank = setup.lora_rank if method == "lora_r8" else setup.lora_matched_rank
        model = _lora(model, setup, rank, nf4_base=method == "qlora_nf4")
        optimizer = torch.optim.AdamW(param_groups(model, setup, lr), **common)
    else:
        raise ValueError(f"unknown method {method!r}")
    return model, optimizer, after_step


def galore_rate_groups(model: nn.Module, projected_layers: set[str], *, lr: float, scale: Any) -> list[dict[str, Any]]:
    """Plain AdamW's parameter groups at the rates a GaLore run at a fixed float `scale` gives each parameter:
    the weights of `projected_layers` (module names) at lr * scale (a GaLore weight moves by lr * scale per
    unit of normalised update), everything else (embeddings, norms, head) at lr. It separates GaLore's effect
    from its per-group rates (the adamw_galore_rates baseline)."""
    if not isinstance(scale, float):
        raise ValueError(f"adamw_galore_rates needs a float GaLore scale, got {scale!r}")
    names = {f"{layer}.weight" for layer in projected_layers}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = sorted(names - {n for n, _ in named})
    if missing:
        raise ValueError(f"projected_layers names no trainable weight {missing[:4]}; pass nn.Linear module names")
    return [
        {"params": [p for n, p in named if n not in names], "lr": lr, "weight_decay": 0.0},
        {"params": [p for n, p in named if n in names], "lr": lr * scale, "weight_decay": 0.0},
    ]


def method_note(method: str, setup: MethodSetup) -> str:
    if method == "adamw_galore_rates":
        return f"targets at lr x {setup.galore_scale}, the rest at lr"
    if setup.galore_overrides and method in OURS:
        overrides = ", ".join(f"{k}={v}" for k, v in setup.galore_overrides)
        return f"rank {setup.galore_rank}, gap {setup.galore_gap}, scale {setup.galore_scale}, {overrides}"
    if method in OURS or method in ("galore_torch", "transformers_galore"):
        return f"rank {setup.galore_rank}, gap {setup.galore_gap}, scale {setup.galore_scale}"
    if method == "lora_r8":
        return f"rank {setup.lora_rank}, alpha {2 * setup.lora_rank}"
    if method in ("lora_matched", "qlora_nf4"):
        return f"rank {setup.lora_matched_rank}, alpha {2 * setup.lora_matched_rank}" + (
            ", NF4 base (block 64, double quant)" if method == "qlora_nf4" else ""
        )
    return ""


# ---------------------------------------------------------------------- schedule, statistics, plots
def warmup_cosine(steps: int, warmup_fraction: float = 0.1, final_ratio: float = 0.1) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to `final_ratio` of the peak (the GaLore paper's schedule)."""
    warmup = max(1, int(steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def format_mean_spread(values: list[float], digits: int = 3) -> str:
    mean, spread = mean_spread(values)
    return f"{mean:.{digits}f} ± {spread:.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def mb(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f}"


def ema(values: list[float], beta: float = 0.9) -> list[float]:
    out, avg = [], None
    for v in values:
        avg = v if avg is None else beta * avg + (1 - beta) * v
        out.append(avg)
    return out


def plot_curves(curves: dict[str, list[float]], markers: dict[str, float], path, *, title: str, ylabel: str) -> None:
    """One smoothed (EMA 0.9) training-loss curve per method; an x at the end marks `markers[method]`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # More curves than the default colour cycle tells apart: 20 colours, then dashed and dotted, and the legend
    # beside the axes (two columns past 18 entries) instead of over the curves.
    many = len(curves) > 10
    columns = 2 if len(curves) > 18 else 1
    fig, ax = plt.subplots(figsize=(8 + 3.2 * columns if many else 8, 5.5 if many else 5))
    colors = plt.get_cmap("tab20").colors
    for index, (method, losses) in enumerate(curves.items()):
        steps = list(range(1, len(losses) + 1))
        style = {"color": colors[index % 20], "linestyle": ("-", "--", ":")[index // 20 % 3]} if many else {}
        line = ax.plot(steps, ema(losses), label=f"{method} ({markers[method]:.3f})", linewidth=1.2, **style)[0]
        ax.scatter([steps[-1]], [markers[method]], marker="x", color=line.get_color())
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if many:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=columns, frameon=False)
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_jobs(
    run_one: Callable[[dict], dict], jobs: list[dict[str, Any]], workers: int, log, describe: Callable[[dict], str]
) -> list[dict[str, Any]]:
    """Run `run_one(job)` for every job (`workers` processes at a time; `run_one` must be a module-level
    function so that 'spawn' can send it); each finished run is appended to `log` (JSON lines) and
    printed as `describe(result)`."""
    results = []

    def report(result: dict[str, Any]) -> None:
        with open(log, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(describe(result), flush=True)
        results.append(result)

    if workers <= 1:
        for job in jobs:
            report(run_one(job))
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            for future in concurrent.futures.as_completed([pool.submit(run_one, job) for job in jobs]):
                report(future.result())
    return results


def same_lr(a: float, b: float) -> bool:
    """Learning rates equal up to float noise (rates are products like 5e-5 * 3)."""
    return math.isclose(a, b, rel_tol=1e-9)


def seed_jobs_at_best(
    rows: list[dict[str, Any]], base: dict[str, Any], seeds: list[int], done=None
) -> list[dict[str, Any]]:
    """Jobs for `seeds` at each summarized method's best rate (skipping those `done(method, lr, seed)`)."""
    return [
        {**base, "method": row["method"], "lr": row["best_lr"], "seed": seed}
        for row in rows
        if row.get("best_lr") is not None
        for seed in seeds
        if done is None or not done(row["method"], row["best_lr"], seed)
    ]


def extend_runs(
    *, extend_from, out, methods, documented_lr: dict[str, float], multipliers, base: dict[str, Any],
    first_seed: int, other_seeds: list[int], run: Callable[[list[dict]], list[dict]],
    summarize: Callable[[list[dict], list[str]], list[dict]], skip: tuple[str, ...] = (),
) -> list[dict[str, Any]]:  # fmt: skip
    """A finished learning-rate grid extended upward (the quality and fine-tuning benchmarks' --extend-from).

    Copies the finished runs of `extend_from` to `out`/runs.jsonl, runs `first_seed` at the documented rate
    times each multiplier (lowest first; a method goes on to the next multiplier only while the last one
    is its best rate), then `other_seeds` at each method's best rate where missing. Methods in `skip`
    have no rate to sweep. Returns all runs, old ones first.
    """
    old = [json.loads(line) for line in extend_from.read_text().splitlines() if line.strip()]
    log = out / "runs.jsonl"
    if log.resolve() == extend_from.resolve():
        raise SystemExit(
            "--extend-from must not be --out's runs.jsonl (it is rewritten); copy it or choose another --out"
        )
    log.write_text("".join(json.dumps(r) + "\n" for r in old))
    results = list(old)
    print(f"extending {len(old)} finished runs from {extend_from} (copied to {log})", flush=True)

    def done(method: str, lr: float, seed: int) -> bool:
        return any(r["method"] == method and r["seed"] == seed and same_lr(r["lr"], lr) for r in results)

    for factor in multipliers:
        jobs = []
        for method in methods:
            if method in skip:
                continue
            lower = [f for f in multipliers if f < factor]
            if lower:
                best = summarize(results, [method])[0]
                if best.get("best_lr") is None or not same_lr(best["best_lr"], documented_lr[method] * max(lower)):
                    print(f"  {method}: x{factor:g} skipped (x{max(lower):g} did not improve on the best rate)")
                    continue
            lr = documented_lr[method] * factor
            if not done(method, lr, first_seed):
                jobs.append({**base, "method": method, "lr": lr, "seed": first_seed})
        if jobs:
            print(f"learning rate x{factor:g} at seed {first_seed}: {len(jobs)} runs", flush=True)
            results += run(jobs)
    seed_jobs = seed_jobs_at_best(summarize(results, methods), base, other_seeds, done)
    if seed_jobs:
        print(f"missing seeds at the best learning rate: {len(seed_jobs)} runs", flush=True)
        results += run(seed_jobs)
    return results


def add_grid_arguments(parser, *, methods, seeds, jobs: int, out, rate: str = "lr") -> None:
    """The command-line options the learning-rate-grid benchmarks (quality, fine-tuning) share."""
    parser.add_argument("--methods", default=",".join(methods), help=f"comma-separated subset of {','.join(methods)}")
    parser.add_argument("--seeds", type=int, default=len(seeds), help=f"seeds at the best lr (default {len(seeds)})")
    parser.add_argument("--no-sweep", action="store_true", help=f"documented {rate} only")
    parser.add_argument("--jobs", type=int, default=jobs, help=f"parallel runs (processes; default {jobs})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--out", type=pathlib.Path, default=out)
    parser.add_argument(
        "--from-runs", type=pathlib.Path, help="no training: write the report from a runs.jsonl (a partial grid too)"
    )
    parser.add_argument(
        "--extend-from", type=pathlib.Path,
        help="start from a finished runs.jsonl: run only --lr-multipliers at seed 0, then any missing seeds at the best lr",
    )  # fmt: skip
    parser.add_argument(
        "--lr-multipliers", default="",
        help=f"with --extend-from: comma-separated extra factors of the documented {rate}, e.g. 10,30 (lowest\n"
        "first; a factor is skipped once a lower listed factor lost to the method's best rate so far)",
    )  # fmt: skip


def check_grid_arguments(parser, args, *, methods, seeds) -> None:
    """Parse and check what add_grid_arguments added (after --quick has set its values)."""
    args.methods = (
        [m.strip() for m in args.methods.split(",") if m.strip()] if isinstance(args.methods, str) else args.methods
    )
    unknown = [m for m in args.methods if m not in methods]
    if unknown or not args.methods:
        parser.error(f"--methods: unknown {unknown}; choose from {','.join(methods)}")
    if not 1 <= args.seeds <= len(seeds):
        parser.error(f"--seeds must be between 1 and {len(seeds)}")
    try:
        args.lr_multipliers = sorted(float(f) for f in args.lr_multipliers.split(",") if f.strip())
    except ValueError:
        parser.error(f"--lr-multipliers: not a comma-separated list of numbers: {args.lr_multipliers!r}")
    if args.lr_multipliers and not args.extend_from:
        parser.error("--lr-multipliers needs --extend-from (the finished grid it extends)")
    if args.extend_from and args.from_runs:
        parser.error("--extend-from and --from-runs exclude each other")


def sweep_cell(sweep: list[dict[str, Any]], key: str) -> str:
    """A report's lr-sweep cell: "rate: value" for each seed-0 run of a method ("diverged" for None)."""
    return ", ".join(f"{s['lr']:.2g}: " + ("diverged" if s[key] is None else f"{s[key]:.3f}") for s in sweep)


def best_rate_fields(best: dict[str, Any], seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Summary fields every grid benchmark reports for a method's runs at its best rate."""
    return {
        "final_train_mean": mean_spread([r["final_train_loss"] for r in seeds])[0],
        "trainable_params": best["trainable_params"],
        "state_bytes": best["state_bytes"],
        "state_bytes_total": best["state_bytes_total"],
        "seconds_per_run": mean_spread([r["train_seconds"] for r in seeds])[0],
        "train_losses_seed0": best["train_losses"],
    }


def run_grid(sweep_jobs: list[dict[str, Any]], *, out, base: dict[str, Any], other_seeds: list[int], methods,
             run: Callable[[list[dict], Any], list[dict]], summarize) -> list[dict[str, Any]]:  # fmt: skip
    """The seed-0 learning-rate sweep, then `other_seeds` at each method's best rate; every finished run
    is appended to `out`/runs.jsonl (started empty). `run(jobs, log)` runs jobs."""
    log = out / "runs.jsonl"
    log.unlink(missing_ok=True)
    print(f"learning-rate sweep: {len(sweep_jobs)} runs (each appended to {log} when it finishes)", flush=True)
    results = run(sweep_jobs, log)
    seed_jobs = seed_jobs_at_best(summarize(results, methods), base, other_seeds)
    if seed_jobs:
        print(f"seeds at the best learning rate: {len(seed_jobs)} runs", flush=True)
        results += run(seed_jobs, log)
    return results
