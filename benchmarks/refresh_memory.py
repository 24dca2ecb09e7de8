"""Refresh memory: the refresh records (dense fp32 gradients or streaming sketches) held at the peak step.

    python benchmarks/refresh_memory.py              # planned peaks at 7B/8B/70B + a measured tiny-Llama run
    python benchmarks/refresh_memory.py --steps 60   # the measured run's length (default 24: every phase)

Planned: GaLoreLinear layers of each model's shapes are built on the meta device (no memory) and packed
into phases by the same code a run uses (`assign_refresh_phases`, `refresh_record_nbytes`); the peak is
the largest phase's bytes. Measured: the quality grid's tiny Llama (benchmarks/quality.py, size tiny:
28 targeted layers, rank 32, gap 50) trains on random tokens and, after every backward, the bytes every
layer holds for its refresh (`recorded_nbytes`) are summed; the peak over the steps must equal the plan.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from torch import nn

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common  # noqa: E402  (sets HF_GALORE_PLUGIN_NO_TAKEOVER=1 before the plugin is imported)

from hf_galore_plugin import GaLoreConfig, GaLoreLinear, after_step, create_optimizer, galore_layers, prepare_model  # noqa: E402
from hf_galore_plugin.layers import assign_refresh_phases  # noqa: E402

# Report name: the planner's model name (hf_galore_plugin/plan/models.json holds the published shapes).
MODELS = {"Llama-2-7B": "llama-2-7b", "Llama-3-8B": "llama-3-8b", "Llama-3-70B": "llama-3-70b"}
VARIANTS = {
    "aligned, svd (the paper's)": {"refresh_schedule": "aligned", "basis_method": "svd"},
    "staggered, svd": {"refresh_schedule": "staggered", "basis_method": "svd"},
    "aligned, sketch": {"refresh_schedule": "aligned", "basis_method": "sketch"},
    "staggered, sketch (default)": {"refresh_schedule": "staggered", "basis_method": "sketch"},
}


def planned_peak(shapes: list[tuple[int, int]], config: GaLoreConfig) -> dict[str, int]:
    """Peak and total refresh-record bytes of layers of `shapes` ((out, in)), and the number of phases."""
    layers = [
        GaLoreLinear(nn.Linear(n_in, n_out, bias=False, device="meta"), config, layer_index=i)
        for i, (n_out, n_in) in enumerate(shapes)
    ]
    loads: dict[int, int] = {}
    for layer, phase in zip(layers, assign_refresh_phases(layers)):
        loads[phase] = loads.get(phase, 0) + layer.refresh_record_nbytes()
    return {"peak": max(loads.values()), "total": sum(loads.values()), "phases": len(loads)}


def llama_shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of q, k, v, o, gate, up, down of every decoder layer of the planner's `model`."""
    from hf_galore_plugin.plan import load_config

    config = load_config(model)
    hidden, intermediate, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = hidden // config.num_attention_heads * config.num_key_value_heads
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                 (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]  # fmt: skip
    return per_layer * layers


def measured_tiny(config_overrides: dict, steps: int) -> dict[str, int]:
    import quality

    size = quality.SIZES["tiny"]
    model = quality.build_model(size, size.vocab_size, seed=0, device=torch.device("cpu"))
    config = GaLoreConfig.preset(
        "qgalore_adamw_8bit",
        rank=size.rank,
        update_proj_gap=size.gap,
        target_modules=quality.TARGETS,
        **config_overrides,
    )
    model = prepare_model(model, config)
    optimizer = create_optimizer(model, lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    per_step = []
    for _ in range(steps):
        ids = torch.randint(0, size.vocab_size, (size.batch_size, size.seq_len), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        per_step.append(sum(layer.recorded_nbytes() for _, layer in galore_layers(model)))
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad()
    shapes = [(layer.out_features, layer.in_features) for _, layer in galore_layers(model)]
    plan = planned_peak(shapes, config)
    return {"peak": max(per_step), "steps_recording": sum(1 for b in per_step if b), "plan": plan}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=24, help="steps of the measured tiny-Llama run (its 20 phases fit 24)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rank", type=int, default=256, help="GaLore rank of the planned models (default 256)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(f"Planned refresh-record peak per step (rank {args.rank}, gap 200, every q/k/v/o/gate/up/down targeted):\n")
    print("| model | schedule, basis | peak per step | all layers at once | phases (calibration steps) |")
    print("|---|---|---|---|---|")
    for name, model in MODELS.items():
        shapes = llama_shapes(model)
        for variant, overrides in VARIANTS.items():
            plan = planned_peak(shapes, GaLoreConfig(rank=args.rank, update_proj_gap=200, **overrides))
            print(
                f"| {name} | {variant} | {_common.mb(plan['peak'])} | {_common.mb(plan['total'])} | {plan['phases']} |"
            )

    print(f"\nMeasured on the tiny Llama (qgalore_adamw_8bit, rank 32, gap 50, {args.steps} steps, random tokens):\n")
    print("| schedule, basis | measured peak per step | planned peak | steps that recorded |")
    print("|---|---|---|---|")
    for variant, overrides in VARIANTS.items():
        result = measured_tiny(overrides, args.steps)
        assert result["peak"] == result["plan"]["peak"], (variant, result)
        print(
            f"| {variant} | {_common.mb(result['peak'])} | {_common.mb(result['plan']['peak'])} | {result['steps_recording']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
