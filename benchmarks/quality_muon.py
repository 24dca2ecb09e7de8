"""Muon rows of the pre-training quality grid: `galore_muon` against `galore_adamw` and full-rank torch.optim.Muon.

    python benchmarks/quality_muon.py                       # size tiny, the three methods, 3 seeds (~15 min, 1 job)
    python benchmarks/quality_muon.py --methods galore_muon --lrs 0.01,0.03,0.1
    python benchmarks/quality_muon.py --methods muon --lrs 0.03 --at-seeds 1,2 --out outputs/quality_muon_seeds
    cat outputs/quality_muon/runs.jsonl outputs/quality_muon_seeds/runs.jsonl > all.jsonl
    python benchmarks/quality_muon.py --from-runs all.jsonl   # the table of the runs together

The protocol of benchmarks/quality.py (its data, model, batches, schedule, clipping, held-out loss and
`run_one`), for three methods:
- `galore_adamw`: quality.py's row (rank 32, gap 50, scale 0.25, plain API).
- `galore_muon`: the same with ``inner_optimizer='muon'`` (Muon on the factors, AdamW on embeddings, norms, head).
- `muon`: full-rank ``torch.optim.Muon`` (its defaults, ``adjust_lr_fn='match_rms_adamw'``, weight decay 0) on
  the weights GaLore projects (attention and MLP matrices), torch's AdamW on the rest, at one rate.
Each method runs its rates at seed 0, then seeds 1 and 2 at its best rate (lowest held-out loss).
Besides quality.py's fields, each run records the optimizer state of the targeted weights ("target state"):
the factors' state for the GaLore rows, the full matrices' Muon momentum for `muon`.

Written to --out (default outputs/quality_muon): runs.jsonl, quality_muon.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any, Optional

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common  # noqa: E402  (first: it sets HF_GALORE_PLUGIN_NO_TAKEOVER before the plugin is imported)
import _models  # noqa: E402
import quality  # noqa: E402
import torch  # noqa: E402

METHODS = ("galore_adamw", "galore_muon", "muon", "galore_adamw_auto", "galore_muon_auto")
# Rates of the grid per method: galore_adamw's and galore_muon's around quality.py's GaLore rate at scale 0.25
# (1e-2; galore_adamw's best there is 3e-2), Muon's around AdamW's (1e-3; AdamW's best there is 3e-3): Muon's
# update is RMS-matched to AdamW's.
# `<name>_auto`: the preset as a user switching from AdamW runs it (quality.py's `_auto` rows: scale 'auto', the
# Trainer's lr_scale), around AdamW's rates.
LRS = {
    "galore_adamw": (0.01, 0.03, 0.1), "galore_muon": (0.01, 0.03, 0.1), "muon": (0.001, 0.003, 0.01),
    "galore_adamw_auto": (0.001, 0.003, 0.01), "galore_muon_auto": (0.001, 0.003, 0.01),
}  # fmt: skip
SEEDS = (0, 1, 2)
# Filled by _target_state_bytes at a run's last step (the run's own process).
_TARGET_STATE: dict[str, int] = {}


class _MuonAndAdamW(torch.optim.Optimizer):
    """torch.optim.Muon and torch.optim.AdamW as one optimizer (one scheduler, one zero_grad): they share the
    group dicts, so a rate set here is the inner optimizers' rate."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.inner = (muon, adamw)
        super().__init__(muon.param_groups + adamw.param_groups, {})
        self.state = {**muon.state, **adamw.state}  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure=None):
        for optimizer in self.inner:
            optimizer.step()
        self.state = {**self.inner[0].state, **self.inner[1].state}  # type: ignore[assignment]
        return None


def _setup(method, model, setup, *, lr):
    """quality.py's setup for the two methods _common does not know; every other method as _common sets it up."""
    common = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    if method == "muon":
        targets = {f"{name}.weight" for name in _common.target_names(model, setup.targets_regex)}
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        muon = torch.optim.Muon([p for n, p in named if n in targets], lr=lr, weight_decay=0.0,
                                adjust_lr_fn="match_rms_adamw")  # fmt: skip
        adamw = torch.optim.AdamW([p for n, p in named if n not in targets], **common)
        return model, _MuonAndAdamW(muon, adamw), lambda: None
    if method == "galore_muon":
        from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, prepare_model

        config = GaLoreConfig.preset(
            method, rank=setup.galore_rank, update_proj_gap=setup.galore_gap, scale=setup.galore_scale,
            target_modules=setup.targets_regex,
        )  # fmt: skip
        model = prepare_model(model, config)
        optimizer = create_optimizer(model, **common, param_groups=_common.param_groups(model, setup, lr))
        return model, optimizer, lambda: after_step(model, optimizer)
    return _ORIGINAL_SETUP(method, model, setup, lr=lr)


def _target_state_bytes(model, optimizer, **kwargs):
    """_models.training_state_bytes, recording the state bytes of the targeted weights (GaLore factors, or the
    full matrices Muon steps) on the side."""
    from hf_galore_plugin.layers import GaLoreLinear

    factors = [m.galore_factor for m in model.modules() if isinstance(m, GaLoreLinear)]
    if factors:
        targets = factors
    else:
        muon = getattr(optimizer, "inner", (None,))[0]
        targets = [p for g in muon.param_groups for p in g["params"]] if muon is not None else []
    _TARGET_STATE["bytes"] = sum(
        v.numel() * v.element_size() for p in targets for v in optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor)
    )  # fmt: skip
    return _ORIGINAL_STATE_BYTES(model, optimizer, **kwargs)


_ORIGINAL_SETUP = _common.setup_method
_ORIGINAL_STATE_BYTES = _models.training_state_bytes


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """quality.run_one with the two methods above and the target-state record."""
    _common.setup_method = _setup
    _models.training_state_bytes = _target_state_bytes
    _TARGET_STATE.clear()
    result = quality.run_one(job)
    result["target_state_bytes"] = _TARGET_STATE.get("bytes")
    result["note"] = {
        "muon": "torch.optim.Muon (match_rms_adamw) on the targets, AdamW on the rest",
        "galore_muon": f"rank {job['size']['rank']}, gap {job['size']['gap']}, scale {quality.GALORE_SCALE}",
        "galore_adamw": f"rank {job['size']['rank']}, gap {job['size']['gap']}, scale {quality.GALORE_SCALE}",
        "galore_adamw_auto": f"rank {job['size']['rank']}, gap {job['size']['gap']}, scale auto, lr_scale 0.85",
        "galore_muon_auto": f"rank {job['size']['rank']}, gap {job['size']['gap']}, scale auto, lr_scale 0.85",
    }[job["method"]]
    return result


def table(results: list[dict[str, Any]], methods: list[str]) -> str:
    rows = quality.summarize(results, methods)
    lines = [
        "| method | setting | lr sweep (seed 0 held-out loss) | best lr | held-out loss (mean ± std, seeds) | "
        "final train loss | training-state MB (weights / grads / optimizer / bases) | target state KB | s per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("best_lr") is None:
            lines.append(f"| {row['method']} | | all diverged | | | | | | |")
            continue
        seeds = [r for r in results if r["method"] == row["method"] and _common.same_lr(r["lr"], row["best_lr"])]
        held = [r["heldout_loss"] for r in seeds if not r["diverged"]]
        mean, spread = _common.mean_spread(held)
        parts = seeds[0]["state_bytes"]
        state = " / ".join(_common.mb(parts[k]) for k in ("weights", "grads", "optimizer_state", "bases"))
        target = seeds[0].get("target_state_bytes")
        lines.append(
            f"| {row['method']} | {seeds[0]['note']} | {_common.sweep_cell(row['sweep'], 'heldout_loss')} | "
            f"{row['best_lr']:.2g} | {mean:.4f} ± {spread:.4f} ({len(held)}) | "
            f"{_common.mean_spread([r['final_train_loss'] for r in seeds])[0]:.3f} | "
            f"{_common.mb(sum(parts.values()))} ({state}) | {target / 1024 if target is not None else 0:.1f} | "
            f"{_common.mean_spread([r['train_seconds'] for r in seeds])[0]:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--lrs", default="", help="comma-separated rates for every method (default: LRS per method)")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help="seeds at the best lr (default 3)")
    parser.add_argument("--steps", type=int, help="override the size's optimizer steps")
    parser.add_argument("--jobs", type=int, default=1, help="parallel runs (processes; default 1)")
    parser.add_argument("--out", type=pathlib.Path, default=HERE.parent / "outputs" / "quality_muon")
    parser.add_argument("--at-seeds", default="", help="no sweep: every rate of --lrs at these seeds, e.g. 1,2")
    parser.add_argument("--from-runs", type=pathlib.Path, help="no training: the report of a runs.jsonl")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if any(m not in METHODS for m in methods):
        parser.error(f"--methods: choose from {','.join(METHODS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_runs:
        results = [json.loads(line) for line in args.from_runs.read_text().splitlines() if line.strip()]
        print(table(results, [m for m in methods if any(r["method"] == m for r in results)]))
        return 0
    size = quality.SIZES["tiny"]
    if args.steps:
        size = dataclasses.replace(size, steps=args.steps)
    data_path = args.out / "tokens.pt"
    quality.prepare_data(size, data_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = {"size": dataclasses.asdict(size), "data": str(data_path), "device": device, "threads": 1}
    lrs = {m: tuple(float(x) for x in args.lrs.split(",")) if args.lrs else LRS[m] for m in methods}
    started = time.perf_counter()
    if args.at_seeds:
        log = args.out / "runs.jsonl"
        log.unlink(missing_ok=True)
        seeds = [int(x) for x in args.at_seeds.split(",") if x]
        jobs = [{**base, "method": m, "lr": lr, "seed": seed} for m in methods for lr in lrs[m] for seed in seeds]
        _common.run_jobs(run_one, jobs, args.jobs, log, quality.describe)
        print(f"{len(jobs)} runs in {log} ({(time.perf_counter() - started) / 60:.1f} min)")
        data_path.unlink()
        return 0
    sweep = [{**base, "method": m, "lr": lr, "seed": SEEDS[0]} for m in methods for lr in lrs[m]]
    results = _common.run_grid(
        sweep, out=args.out, base=base, other_seeds=list(SEEDS[1 : args.seeds]), methods=methods,
        run=lambda jobs, log: _common.run_jobs(run_one, jobs, args.jobs, log, quality.describe),
        summarize=quality.summarize,
    )  # fmt: skip
    report = table(results, methods)
    minutes = sum(r["train_seconds"] for r in results) / 60
    header = (
        f"Size `tiny` ({size.steps} steps of {size.batch_size} x {size.seq_len} tokens), device {device}, 1 thread "
        f"per run, {args.jobs} run(s) in parallel; {len(results)} runs ({minutes:.1f} min of training); wall time "
        f"{(time.perf_counter() - started) / 60:.1f} min.\n\n"
    )
    (args.out / "quality_muon.md").write_text(header + report)
    print(header + report)
    data_path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
