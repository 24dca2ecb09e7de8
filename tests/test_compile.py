"""Training compiled from step 0: ``torch.compile(model)`` before the first step, through calibration and
the staggered refresh phases, against the same run in eager mode.

The compiled forward records a refresh step's gradient through two opaque ops guarded by one model-wide
flag (hf_galore_plugin/layers/function.py, "the refresh record, compiled"), so a whole run is two graphs
(ordinary steps, record steps) whatever the number of layers and phases, without graph breaks. Dynamo's
own counters are the oracle of graphs and breaks; the eager run is the oracle of losses and refreshes.
The "eager" backend runs Dynamo's capture (guards, breaks, recompiles) without code generation;
test_integration_features.py runs inductor itself.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

import hf_galore_plugin as hgp
from hf_galore_plugin.inject import iter_galore_layers
from conftest import build_tiny_llama

STEPS = 10
GAP = 3  # staggered: calibration at steps 0 and 1, then refresh phases at 3-4, 6-7, 9
# Two phases at 2 x 16 tokens (each layer holds its sketch and its kept input of 32 fp32 tokens on its refresh step)
BUDGET_MB = 0.1


def _run(
    preset: str, *, compiled: bool, layers: int = 2, update_proj_gap: int = GAP, refresh_budget_mb=BUDGET_MB, **config
) -> dict:
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = build_tiny_llama(seed=0, num_hidden_layers=layers)
    config = hgp.GaLoreConfig.preset(
        preset, rank=8, update_proj_gap=update_proj_gap, refresh_budget_mb=refresh_budget_mb, **config
    )
    model = hgp.prepare_model(model, config)
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    forward = torch.compile(model, backend="eager") if compiled else model
    ids = torch.randint(0, 256, (STEPS, 2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    # Hitting Dynamo's recompile limit is an error here, not a silent fall back to eager frames.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for step in range(STEPS):
            loss = forward(input_ids=ids[step], labels=ids[step]).loss
            loss.backward()
            optimizer.step()
            hgp.after_step(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    layers_ = [layer for _, layer in iter_galore_layers(model)]
    return {
        "losses": losses,
        "refreshes": [layer.counter("galore_num_refreshes") for layer in layers_],
        "phases": [layer.counter("galore_phase") for layer in layers_],
        "bases": [layer.basis("right", torch.float32) for layer in layers_],
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
    }


@pytest.mark.parametrize(
    "preset, config, graphs",
    [
        ("galore_adamw", {}, 2),  # ordinary steps and record steps
        ("qgalore_adamw_8bit", {}, 2),
        # and the first call, before which the head has no forward of its own (loss.ChunkedLossForward)
        ("galore_adamw", {"chunked_loss": True}, 3),
    ],
    ids=["galore_adamw", "qgalore_adamw_8bit", "chunked_loss"],
)
def test_compiled_from_step_zero_is_two_graphs_without_breaks_and_trains_as_eager(preset, config, graphs):
    eager = _run(preset, compiled=False, **config)
    compiled = _run(preset, compiled=True, **config)
    assert compiled["breaks"] == 0
    assert compiled["graphs"] == graphs
    # Every layer refreshed as often as in eager mode (calibration + 2 or 3 refreshes), to the same basis.
    assert compiled["refreshes"] == eager["refreshes"] and min(eager["refreshes"]) >= 3
    for got, expected in zip(compiled["bases"], eager["bases"]):
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-5)


def test_graph_count_does_not_grow_with_layers_or_phases():
    # 6 decoder layers (three times the GaLore layers above, and more staggered phases) over a longer gap.
    run = _run("galore_adamw", compiled=True, layers=6, update_proj_gap=8, refresh_budget_mb=0.15)  # 4 phases
    assert max(layer_phases := run["phases"]) >= 2, layer_phases
    assert run["graphs"] == 2 and run["breaks"] == 0


def test_rank_auto_compiled_recompiles_for_the_new_shapes_only_and_trains_as_eager():
    """rank_allocation='auto': the layers take their ranks at steps 3-4 (new factor and basis shapes), which
    the graphs are recompiled for (a bounded number of graphs, Dynamo's limit not hit: an error here), without
    breaks, training as eager."""
    eager = _run("galore_adamw", compiled=False, rank_allocation="auto")
    compiled = _run("galore_adamw", compiled=True, rank_allocation="auto")
    assert compiled["breaks"] == 0
    assert compiled["graphs"] <= 8  # measured 4: the two step kinds, each at the starting and the new shapes
    assert compiled["refreshes"] == eager["refreshes"] and min(eager["refreshes"]) >= 3
    assert {tuple(b.shape) for b in compiled["bases"] if b is not None} != {(64, 8)}, "the ranks changed"
    for got, expected in zip(compiled["bases"], eager["bases"]):
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-5)


def test_a_copied_model_records_into_its_own_layers():
    import copy

    config = hgp.GaLoreConfig(rank=8, update_proj_gap=3, refresh_schedule="aligned")  # every layer records at step 0
    model = hgp.prepare_model(build_tiny_llama(seed=0), config)
    twin = copy.deepcopy(model)
    layer, twin_layer = next(iter_galore_layers(model))[1], next(iter_galore_layers(twin))[1]
    assert twin_layer.recorder_id != layer.recorder_id
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.compile(twin, backend="eager")(input_ids=ids, labels=ids).loss.backward()
    assert twin_layer._pending_grad is not None and layer._pending_grad is None


MOE_GAP, MOE_STEPS = 10, 60  # the run: default settings, six refresh gaps


def _moe_run(preset: str, layers: int, *, compiled: bool) -> dict:
    from test_experts import qwen3_moe

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    config = hgp.GaLoreConfig.preset(preset, rank=8, update_proj_gap=MOE_GAP, experts=True)
    model = hgp.prepare_model(qwen3_moe(0, num_hidden_layers=layers), config)
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    forward = torch.compile(model, backend="eager") if compiled else model
    ids = torch.randint(0, 128, (MOE_STEPS, 2, 16), generator=torch.Generator().manual_seed(1))
    layers_ = [layer for _, layer in iter_galore_layers(model)]
    losses, graphs, kinds = [], [], set()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for batch in ids:
            kinds.add(layers_[0].compiled_record)  # the step driver sets it alike on every layer
            loss = forward(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            hgp.after_step(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            graphs.append(counters["stats"]["unique_graphs"])
    return {
        "losses": losses,
        "graphs": graphs,
        "kinds": kinds,
        "breaks": sum(counters["graph_break"].values()),
        "refreshes": [layer.counter("galore_num_refreshes") for layer in layers_],
    }


@pytest.mark.parametrize(
    "preset, layers",
    [("galore_adamw", 2), ("galore_adamw", 4), ("galore_adamw_8bit", 2), ("qgalore_adamw_8bit", 2)],
)
@pytest.mark.filterwarnings("ignore:refresh_schedule='staggered'")  # 4 layers: every step has a phase
def test_moe_expert_stacks_compile_from_step_zero_without_breaks_or_recompiles(preset, layers):
    """MoE expert stacks (GaLoreExperts) traced into the model's graph: the dispatch is grouped GEMMs sized by a
    tensor of offsets (layers/grouped.py), so no routed count is a host int a graph would specialise on.
    A whole run is one graph per kind of step it has (ordinary, record), whatever the number of MoE layers
    (with 4 decoder layers every step has a layer recording), without a graph break, as eager."""
    eager = _moe_run(preset, layers, compiled=False)
    compiled = _moe_run(preset, layers, compiled=True)
    assert compiled["breaks"] == 0
    assert compiled["graphs"][-1] == len(compiled["kinds"]) <= 2, (compiled["graphs"], compiled["kinds"])
    assert compiled["graphs"][MOE_GAP] == compiled["graphs"][-1]  # nothing compiled after the first gap
    assert compiled["refreshes"] == eager["refreshes"] and min(eager["refreshes"]) >= MOE_STEPS // MOE_GAP
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-5)


def _saved_by_a_compiled_quantized_step(model, vocab: int) -> list[torch.Tensor]:
    """What autograd keeps from an inductor-compiled forward for the backward: `model` (prepared, quantized W0)
    compiled, trained through its calibration and an ordinary step, then one more forward, whose saved tensors
    are returned (after its backward)."""
    torch._dynamo.reset()
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    forward = torch.compile(model)
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # calibration, then an ordinary step
        forward(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        hgp.after_step(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = forward(input_ids=ids, labels=ids).loss
    loss.backward()
    return saved


def test_compiled_moe_quantized_w0_is_read_again_in_the_backward_not_saved_from_the_forward():
    """Inductor, MoE expert stacks with an INT8 W0: autograd keeps no dequantized E x m x n stack from the
    forward for the backward (the stack's W0 is read inside a checkpointed region, read again in the backward)."""
    from test_experts import qwen3_moe

    config = hgp.GaLoreConfig.preset("qgalore_adamw_8bit", rank=8, update_proj_gap=100, experts=True)
    model = hgp.prepare_model(qwen3_moe(0, num_hidden_layers=1), config)
    stacks = {(layer.num_experts, layer.out_features, layer.in_features) for layer in
              (layer for _, layer in iter_galore_layers(model)) if hasattr(layer, "num_experts")}  # fmt: skip
    assert stacks and all(layer.weight is None for _, layer in iter_galore_layers(model))  # W0 quantized
    saved = _saved_by_a_compiled_quantized_step(model, vocab=128)
    dense = [tuple(t.shape) for t in saved if t.is_floating_point() and tuple(t.shape) in stacks]
    assert dense == [], f"dequantized expert W0 kept for the backward: {dense}"


@pytest.mark.parametrize("weight_storage", ["int8", "nf4"])
def test_compiled_quantized_w0_is_read_again_in_the_backward_not_saved_from_the_forward(weight_storage):
    """Inductor, quantized W0: what autograd keeps from the forward for the backward holds the layers' W0 as
    its codes (the 1-byte codes for int8; 4-bit bytes for nf4), never a dequantized fp32 m x n copy, which would
    cost at every step the memory quantizing W0 saves. 32 tokens, so no activation has a W0's shape."""
    model = build_tiny_llama(seed=0, num_hidden_layers=1)
    config = hgp.GaLoreConfig.preset("qgalore_adamw_8bit", rank=8, update_proj_gap=100, weight_storage=weight_storage)
    model = hgp.prepare_model(model, config)
    saved = _saved_by_a_compiled_quantized_step(model, vocab=256)
    shapes = {(layer.out_features, layer.in_features) for _, layer in iter_galore_layers(model)}
    dense = [tuple(t.shape) for t in saved if t.is_floating_point() and tuple(t.shape) in shapes]
    assert dense == [], f"dequantized W0 kept for the backward: {dense}"
    code_sizes = {t.numel() for t in saved if t.dtype in (torch.int8, torch.uint8)}
    expected = {m * n if weight_storage == "int8" else m * n // 2 for m, n in shapes}
    assert expected <= code_sizes, (expected, code_sizes)  # every W0 is read again from its codes


# ---------------------------------------------------------------------- guards per layer
# Dynamo checks every guard of a compiled model before each call, so the Python values a layer's compiled forward
# reads are paid at every step (docs/benchmarks/step-time.md, "compiled from the first step"). The guard tree is
# read from its text form (torch 2.13's GuardManagerWrapper), each guard counted for the GaLore layer whose module
# path its manager's source holds.
_MANAGERS = {"GuardManager", "DictGuardManager", "KeyValueManager", "KeyManager", "ValueManager", "RootGuardManager"}
_TENSOR_GUARDS = {"TENSOR_MATCH", "DIMENSION_DYNAMIC_MARKING_GUARD", "NO_TENSOR_ALIASING"}


def _guards_per_layer(model) -> list[dict[str, Counter[str]]]:
    """Per compiled graph of `model`'s forward: GaLore layer name -> its guards by kind."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    paths = {"".join(f"._modules['{part}']" for part in name.split(".")): name for name, _ in iter_galore_layers(model)}
    graphs = []
    for entry in _debug_get_cache_entry_list(type(model).forward.__code__):
        counts: dict[str, Counter[str]] = {name: Counter() for name in paths.values()}
        stack: list[tuple[int, str | None]] = []  # (depth, layer) of the managers above the current line
        for line in str(entry.guard_manager).splitlines():
            match = re.match(r"^((?:\| )*)\+- (\w+)", line)
            if not match:
                continue
            depth, kind = len(match.group(1)) // 2, match.group(2)
            while stack and stack[-1][0] >= depth:
                stack.pop()
            owner = stack[-1][1] if stack else None
            if kind in _MANAGERS:
                source = line.split("source=", 1)[-1].split(", accessed_by=", 1)[0]
                owner = next((name for path, name in paths.items() if path in source), owner)
                stack.append((depth, owner))
            elif owner is not None:
                counts[owner][kind] += 1
        graphs.append(counts)
    return graphs


@pytest.mark.parametrize(
    "preset, tensors",
    [("galore_adamw", 4), ("qgalore_adamw_8bit", 6)],  # factor, W0 (int8: codes, scales), basis (int4: 2), alpha
)
def test_compiled_forward_guards_few_python_values_per_layer(preset, tensors):
    """Each GaLore layer's compiled forward guards its tensors and 7 Python values on an ordinary step (the
    module's type, that `forward` is not shadowed, its parameter and buffer dicts, the bias, its trace-plan key,
    the record flag), 8 on a record step (its recorder id). Measured when the forward read its storage objects'
    fields and methods: 17-20 and 18-21 (galore_adamw), 48-51 and 49-52 (qgalore_adamw_8bit)."""
    torch._dynamo.reset()
    model = hgp.prepare_model(
        build_tiny_llama(seed=0, num_hidden_layers=1),
        hgp.GaLoreConfig.preset(preset, rank=8, update_proj_gap=10, refresh_schedule="aligned"),
    )
    optimizer = hgp.create_optimizer(model, lr=1e-3)
    forward = torch.compile(model, backend="eager")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):  # a record step (calibration), then ordinary ones
        forward(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        hgp.after_step(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
    graphs = _guards_per_layer(model)
    assert len(graphs) == 2  # ordinary steps and record steps
    most = []
    for counts in graphs:
        assert len(counts) == 7
        for name, kinds in counts.items():
            assert kinds["TENSOR_MATCH"] == tensors, (name, kinds)
        python = {
            name: sum(n for kind, n in kinds.items() if kind not in _TENSOR_GUARDS) for name, kinds in counts.items()
        }
        most.append(max(python.values()))
        assert most[-1] <= 8, (python, counts)
    assert min(most) <= 7, most  # the ordinary step's graph reads no recorder id


@pytest.mark.parametrize("preset", ["galore_adamw", "qgalore_adamw_8bit"])
def test_compiled_forward_follows_a_layer_whose_storage_changes(preset):
    """What the compiled forward takes from the layer's trace plan instead of guarding the storage objects (how a
    basis and W0 are stored: a quantized basis's shape and block layout) still reaches the graph: a new rank (new
    factor and basis shapes, a new int4 layout) gives the layer a new plan key, a guard fails and the forward
    is traced again, matching the eager layer; new values of the same tensors (a refresh, weight decay of W0)
    are graph inputs."""
    from torch import nn

    from hf_galore_plugin.layers.linear import GaLoreLinear

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    config = hgp.GaLoreConfig.preset(preset, rank=8)
    layer = GaLoreLinear(nn.Linear(64, 48, bias=True), config)  # m < n: a left basis P (48 x 8)
    compiled = torch.compile(layer, backend="eager")
    x = torch.randn(2, 5, 64)

    def set_rank(rank: int) -> None:
        layer.galore_factor = nn.Parameter(torch.randn(rank, 64))
        layer.set_basis("left", torch.linalg.qr(torch.randn(48, rank))[0])

    set_rank(8)
    key = layer._trace_key
    torch.testing.assert_close(compiled(x), layer(x))
    layer.scale_base(0.5)  # alpha: a tensor input, no recompile
    layer.set_basis("left", torch.linalg.qr(torch.randn(48, 8))[0])  # new values, same layout and key
    assert layer._trace_key == key
    torch.testing.assert_close(compiled(x), layer(x))
    set_rank(4)
    if preset == "qgalore_adamw_8bit":
        assert layer._trace_key != key  # the int4 basis's numel and shape are in the plan
    torch.testing.assert_close(compiled(x), layer(x))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # traced again for the new rank
