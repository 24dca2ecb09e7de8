"""GaLore on the fused expert weights of mixture-of-experts models (hf_galore_plugin.layers.experts).

Oracles: the stock transformers experts module (outputs before training), a dense re-implementation
with one GaLoreLinear per expert (outputs, factor gradients, weights after each step), a single
GaLoreLinear trained on one expert's tokens alone, an uninterrupted run (resume), and the stock
transformers model class loading the merged checkpoint in a process without the plugin (logits).
"""

from __future__ import annotations

import copy
import json
import functools
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, galore_layers, prepare_model, state_of
from hf_galore_plugin.config import PAPER_REFRESH
from hf_galore_plugin.layers import GaLoreLinear
from hf_galore_plugin.layers.experts import GaLoreExperts, GaLoreExpertStack

transformers = pytest.importorskip("transformers", reason="platform: transformers is a dependency of the tests")

HIDDEN, MOE_INTERMEDIATE, EXPERTS, TOP_K = 64, 32, 4, 2


def qwen3_moe(seed: int = 0, **overrides):
    fields = dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=MOE_INTERMEDIATE,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, decoder_sparse_step=1, max_position_embeddings=64,
    )  # fmt: skip
    config = transformers.Qwen3MoeConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(config)


def mixtral(seed: int = 0):
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=MOE_INTERMEDIATE, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config)


def olmoe(seed: int = 0):
    config = transformers.OlmoeConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=MOE_INTERMEDIATE, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.OlmoeForCausalLM(config)


FAMILIES = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "olmoe": olmoe}


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, top-k expert indices (distinct per token) and weights, every expert used."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=g)
    index = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=g).softmax(-1)
    assert torch.bincount(index.reshape(-1), minlength=EXPERTS).min() > 0
    return hidden, index, weights


class _Holder(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, *args):
        return self.experts(*args)


class _DenseExperts(nn.Module):
    """The oracle: one GaLoreLinear per expert and projection, run as transformers' eager experts loop."""

    def __init__(self, stock: nn.Module, config: GaLoreConfig) -> None:
        super().__init__()
        linear_config = config.replace(rank=config.expert_rank)

        def layers(weight: torch.Tensor) -> nn.ModuleList:
            result = []
            for e in range(weight.shape[0]):
                linear = nn.Linear(weight.shape[2], weight.shape[1], bias=False)
                linear.weight = nn.Parameter(weight[e].detach().clone())
                result.append(GaLoreLinear(linear, linear_config))
            return nn.ModuleList(result)

        self.gate_up = layers(stock.gate_up_proj)
        self.down = layers(stock.down_proj)
        self.act_fn = stock.act_fn

    def forward(self, hidden, index, weights):
        final = torch.zeros_like(hidden)
        for e in range(len(self.gate_up)):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            gate, up = self.gate_up[e](hidden[token]).chunk(2, dim=-1)
            out = self.down[e](self.act_fn(gate) * up) * weights[token, slot, None]
            final.index_add_(0, token, out)
        return final


CONFIGS = {
    "plain": dict(),
    # Quantized W0 and bases and 8-bit state: expert slices are whole quantization blocks (64 x 64 and
    # 64 x 32 weights, 64 x 4 bases, 64 x 4 factors: 256-value state blocks), so the stack and the
    # per-expert layers quantize the same blocks. Deterministic rounding: the streams differ per layer.
    "quantized": dict(weight_storage="int8", basis_storage="int4", state_bits=8, stochastic_rounding=False),
    "nf4_project": dict(weight_storage="nf4", moment_handling="project", stochastic_rounding=False),
}


def _fused_against_dense(setting: str, *, weight_decay: float, update_proj_gap: int, same) -> dict:
    """Seven steps of a GaLoreExperts and of the dense oracle from the same stock experts, compared with `same`
    (outputs, factor gradients, merged weights and bases at every step); returns the stacks."""
    config = GaLoreConfig(
        rank=8, expert_rank=4, experts=True, update_proj_gap=update_proj_gap, **PAPER_REFRESH, **CONFIGS[setting]
    )
    stock = qwen3_moe().model.layers[0].mlp.experts
    dense = _DenseExperts(stock, config)
    fused = _Holder(GaLoreExperts(copy.deepcopy(stock), config))
    opt_fused = create_optimizer(fused, config, lr=1e-2, weight_decay=weight_decay)
    opt_dense = create_optimizer(dense, config.replace(rank=4), lr=1e-2, weight_decay=weight_decay)
    stacks = {"gate_up": fused.experts.gate_up_proj, "down": fused.experts.down_proj}
    for step in range(7):
        hidden, index, weights = _routing(24, seed=step)
        probe = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(100 + step))
        out_fused, out_dense = fused(hidden, index, weights), dense(hidden, index, weights)
        same(out_fused, out_dense)
        (out_fused * probe).sum().backward()
        (out_dense * probe).sum().backward()
        for name, stack in stacks.items():
            for e, layer in enumerate(getattr(dense, name)):
                same(stack.galore_factor.grad[e], layer.galore_factor.grad)
        for optimizer, model in ((opt_fused, fused), (opt_dense, dense)):
            optimizer.step()
            after_step(model, optimizer)
            optimizer.zero_grad()
        for name, stack in stacks.items():
            merged = stack.effective_weight()
            for e, layer in enumerate(getattr(dense, name)):
                same(merged[e], layer.effective_weight())
                for side in ("left", "right"):
                    basis = layer.basis(side, torch.float32)
                    if basis is not None:
                        same(stack.basis(side, torch.float32)[e], basis)
    # The weights moved (the comparison is not between two untrained copies).
    assert (stacks["down"].effective_weight() - stock.down_proj.detach()).abs().max() > 1e-3
    return stacks


def _equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(got, expected), (got - expected).abs().max()


@pytest.mark.parametrize("setting", sorted(CONFIGS))
def test_fused_experts_match_one_galore_linear_per_expert(setting):
    # The paper's refresh: the dense oracle's layers then refresh at the same steps from the same exact SVD as
    # the stack's experts (staggered phases and sketch test matrices are drawn per layer). Bit for bit: each
    # grouped GEMM is the per-expert GEMM of the dense layer (alpha = 1: no weight decay; see the next test).
    stacks = _fused_against_dense(setting, weight_decay=0.0, update_proj_gap=2, same=_equal)
    assert stacks["down"].counter("galore_num_refreshes") == 4  # steps 0, 2, 4, 6


@pytest.mark.parametrize("experts_per_read", [1, 3])
@pytest.mark.parametrize("setting", ["quantized", "nf4_project"])
def test_quantized_stack_read_in_groups_of_experts_matches_one_galore_linear_per_expert(
    setting, experts_per_read, monkeypatch
):
    """A stack whose dequantized W0 exceeds READ_BUDGET_BYTES is read a few experts at a time (each group's
    grouped GEMM on its rows, forward and backward) rather than whole: still bit for bit the dense oracle's
    per-expert layers (groups of `experts_per_read` gate_up_proj experts, twice as many of down_proj's)."""
    from hf_galore_plugin.layers import grouped

    gate_up_bytes = 2 * MOE_INTERMEDIATE * HIDDEN * 4  # the larger stack's expert, fp32
    monkeypatch.setattr(grouped, "READ_BUDGET_BYTES", experts_per_read * gate_up_bytes)
    groups: list[int] = []
    grouped_mm = grouped.grouped_mm

    def counted(a, b, offs):
        groups.append(b.shape[0])  # the experts of the weight (a group of them: fewer than EXPERTS)
        return grouped_mm(a, b, offs)

    monkeypatch.setattr(grouped, "grouped_mm", counted)
    _fused_against_dense(setting, weight_decay=0.0, update_proj_gap=2, same=_equal)
    assert experts_per_read in groups and max(groups) == EXPERTS  # W0 in groups; bases and factors whole


# Weight decay makes W0's multiplier alpha != 1. A GaLoreLinear forms alpha x W0^T inside its addmm (the CPU BLAS
# scales W0 as it packs it); the stack forms x_e W0_e^T in the grouped GEMM and then adds it times alpha:
# another rounding of the same sum. Bound: max |stack - dense| <= 2e-6 max |dense| (16 fp32 ulps of the largest
# value) for outputs, factor gradients and merged weights over 7 steps (measured: 9e-7). No refresh after
# alpha moves: a refresh's SVD can flip the sign of a basis vector on a difference that small, after which
# moment_handling='keep' carries the moments in the other orientation (a different trajectory, not rounding).
@pytest.mark.parametrize("setting", sorted(CONFIGS))
def test_fused_experts_with_weight_decay_match_dense_within_rounding(setting):
    def within(got: torch.Tensor, expected: torch.Tensor) -> None:
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6 * float(expected.detach().abs().max()))

    stacks = _fused_against_dense(setting, weight_decay=0.1, update_proj_gap=100, same=within)
    assert stacks["down"]._alpha < 0.995  # weight decay moved alpha


def _sparse_routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing in which expert 1 receives no token and some slots go to index EXPERTS (no local expert, as under
    expert parallelism): each token's two slots are distinct picks of (0, 2, 3, EXPERTS)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=g)
    choices = torch.tensor([0, 2, 3, EXPERTS])
    index = torch.stack([choices[torch.randperm(4, generator=g)[:TOP_K]] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=g).softmax(-1)
    counts = torch.bincount(index.reshape(-1), minlength=EXPERTS + 1)
    assert counts[1] == 0 and counts[EXPERTS] > 0 and counts[[0, 2, 3]].min() > 0
    return hidden, index, weights


@pytest.mark.filterwarnings("ignore:GaLore layer .*no backward ran")  # the oracle's layers of expert 1
def test_grouped_dispatch_equals_the_loop_over_experts(monkeypatch):
    """The grouped dispatch (sorted rows, offsets, grouped GEMMs) against transformers' stock experts loop (output
    before training) and the dense oracle's loop of one GaLoreLinear per expert (outputs and the gradients of the
    hidden states, routing weights and factors, over steps with bases and trained factors), bit for bit, with an
    expert that receives no token and slots routed to no local expert (which contribute nothing). The rows the
    grouped kernel leaves unwritten (past the last offset) are NaN here, so a leak of them shows."""
    grouped_mm = torch._grouped_mm

    def poisoned(a, b, offs=None, **kwargs):
        out = grouped_mm(a, b, offs=offs, **kwargs)
        if a.dim() == 2 and b.dim() == 3:
            out[offs[-1] :] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", poisoned)
    config = GaLoreConfig(rank=8, expert_rank=4, experts=True, update_proj_gap=2, **PAPER_REFRESH)
    stock = qwen3_moe().model.layers[0].mlp.experts
    # transformers' loop over the experts (its default here is its own grouped_mm path, which drops no slot
    # routed to no local expert unless the module is marked expert-parallel)
    stock.config._experts_implementation = "eager"
    dense = _DenseExperts(stock, config)
    fused = _Holder(GaLoreExperts(copy.deepcopy(stock), config))
    opt_fused = create_optimizer(fused, config, lr=1e-2, weight_decay=0.0)
    opt_dense = create_optimizer(dense, config.replace(rank=4), lr=1e-2, weight_decay=0.0)
    for step in range(4):  # calibration at step 0, ordinary step 1 (trained factors), refresh at step 2
        hidden, index, weights = _sparse_routing(20, seed=step)
        if step == 0:
            with torch.no_grad():
                _equal(fused(hidden, index, weights), stock(hidden, index, weights))
        outputs, grads = [], []
        for model in (fused, dense):
            h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
            out = model(h, index, w)
            (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + step))).sum().backward()
            outputs.append(out)
            grads.append((h.grad, w.grad))
        _equal(outputs[0], outputs[1])
        _equal(grads[0][0], grads[1][0])
        _equal(grads[0][1], grads[1][1])
        assert torch.count_nonzero(grads[0][1][index == EXPERTS]) == 0  # unrouted slots: no gradient
        for name, stack in (("gate_up", fused.experts.gate_up_proj), ("down", fused.experts.down_proj)):
            for e, layer in enumerate(getattr(dense, name)):
                expected = layer.galore_factor.grad
                _equal(
                    stack.galore_factor.grad[e], torch.zeros_like(layer.galore_factor) if expected is None else expected
                )
            assert torch.count_nonzero(stack.galore_factor.grad[1]) == 0
        for optimizer, model in ((opt_fused, fused), (opt_dense, dense)):
            optimizer.step()
            after_step(model, optimizer)
            optimizer.zero_grad()
    assert fused.experts.down_proj.galore_expert_refreshes.tolist() == [2, 0, 2, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rank", [4, 2])
def test_grouped_gemms_equal_the_loop_over_experts(dtype, rank):
    """grouped_mm and grouped_mm_t against a loop of per-expert matmuls, bit for bit: an expert without rows,
    rows past the last offset (not read; grouped_mm_t gives the empty expert zeros), operands whose strides
    the kernel refuses (rank 2: rows of 8 bytes, copied padded), float64 (no kernel: a loop)."""
    from hf_galore_plugin.layers.grouped import grouped_mm, grouped_mm_t, offsets_of

    g = torch.Generator().manual_seed(0)
    counts = [5, 0, 7, 3]
    rows = sum(counts) + 3  # 3 rows routed to no expert
    x = torch.randn(rows, 64, generator=g).to(dtype)
    q = torch.randn(EXPERTS, 64, rank, generator=g).to(dtype)
    factor = torch.randn(EXPERTS, 48, rank, generator=g).to(dtype)
    dy = torch.randn(rows, 48, generator=g).to(dtype)
    offsets = offsets_of(counts, x.device)
    t = grouped_mm(x, q, offsets)
    h = grouped_mm(t, factor.mT, offsets)
    grad = grouped_mm_t(dy.mT, t, offsets)
    start = 0
    for e, count in enumerate(counts):
        part = slice(start, start + count)
        _equal(t[part], x[part] @ q[e])
        _equal(h[part], t[part] @ factor[e].mT)
        _equal(grad[e], dy[part].mT @ t[part])
        start += count
    assert torch.count_nonzero(grad[1]) == 0


def test_a_stacked_w0_view_that_requires_a_gradient_gets_none():
    """As a linear layer's (tests/test_core.py): an expert stack's frozen W0 handed over as a view of a parameter
    that requires a gradient (FSDP1's flat parameter) is detached, so no gradient reaches it; output and dX are
    those of the plain stack."""
    from hf_galore_plugin.layers.grouped import grouped_galore, offsets_of

    g = torch.Generator().manual_seed(0)
    counts, m, n, r = [5, 0, 7, 3], 12, 16, 4
    flat = torch.randn(EXPERTS * m * n + EXPERTS * m * r, generator=g, requires_grad=True)
    weight = flat[: EXPERTS * m * n].view(EXPERTS, m, n)
    factor = flat[EXPERTS * m * n :].view(EXPERTS, m, r)
    q = torch.randn(EXPERTS, n, r, generator=g)
    x = torch.randn(sum(counts), n, generator=g, requires_grad=True)
    offsets = offsets_of(counts, x.device)
    y = grouped_galore(x, offsets, factor, weight, None, None, None, q, 0.9, 1.0, torch.float32)
    y.backward(torch.ones_like(y))
    assert flat.grad[: EXPERTS * m * n].abs().sum() == 0 and flat.grad[EXPERTS * m * n :].abs().sum() > 0
    x_dense = x.detach().requires_grad_(True)
    rows = torch.repeat_interleave(torch.arange(EXPERTS), torch.tensor(counts))
    merged = 0.9 * weight.detach() + factor.detach() @ q.mT
    dense = torch.einsum("sn,smn->sm", x_dense, merged[rows])
    dense.backward(torch.ones_like(dense))
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_dense.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prepared_model_computes_the_stock_logits(family):
    model = FAMILIES[family]()
    reference = copy.deepcopy(model)
    prepare_model(model, GaLoreConfig(rank=8, expert_rank=4, experts=True))
    kinds = {type(m).__name__ for m in model.modules()}
    assert "GaLoreExperts" in kinds and not any(k.endswith("Experts") and k != "GaLoreExperts" for k in kinds)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_one_expert_update_equals_galore_on_that_expert_alone():
    config = GaLoreConfig(rank=8, expert_rank=4, experts=True, update_proj_gap=2)
    weight = torch.randn(EXPERTS, 48, 40, generator=torch.Generator().manual_seed(0))
    stack_model = _Holder(GaLoreExpertStack(nn.Parameter(weight.clone()), config))
    linear = nn.Linear(40, 48, bias=False)
    linear.weight = nn.Parameter(weight[2].clone())
    alone = _Holder(GaLoreLinear(linear, config.replace(rank=4)))
    opt_stack = create_optimizer(stack_model, config, lr=1e-2)
    opt_alone = create_optimizer(alone, config.replace(rank=4), lr=1e-2)
    for step in range(5):
        x = torch.randn(16, 40, generator=torch.Generator().manual_seed(step))
        probe = torch.randn(16, 48, generator=torch.Generator().manual_seed(50 + step))
        (stack_model(x, [0, 0, 16, 0]) * probe).sum().backward()
        (alone(x) * probe).sum().backward()
        for optimizer, model in ((opt_stack, stack_model), (opt_alone, alone)):
            optimizer.step()
            after_step(model, optimizer)
            optimizer.zero_grad()
    stack = stack_model.experts
    merged = stack.effective_weight()
    torch.testing.assert_close(merged[2], alone.experts.effective_weight(), atol=1e-5, rtol=1e-5)
    assert (merged[2] - weight[2]).abs().max() > 1e-3
    # The experts that never received a token never moved and never got a basis.
    for e in (0, 1, 3):
        assert torch.equal(merged[e], weight[e])
        assert torch.count_nonzero(stack.basis("right", torch.float32)[e]) == 0
    assert stack.galore_expert_refreshes.tolist() == [0, 0, 3, 0]


def test_expert_without_tokens_keeps_its_basis_at_a_refresh(caplog):
    config = GaLoreConfig(rank=8, expert_rank=4, experts=True, update_proj_gap=2)
    weight = torch.randn(EXPERTS, 48, 40, generator=torch.Generator().manual_seed(0))
    model = _Holder(GaLoreExpertStack(nn.Parameter(weight), config))
    optimizer = create_optimizer(model, config, lr=1e-2)
    stack = model.experts

    def step(counts, seed):
        x = torch.randn(sum(counts), 40, generator=torch.Generator().manual_seed(seed))
        model(x, counts).square().sum().backward()
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad()

    step([4, 4, 4, 4], 0)  # calibration: every expert gets a basis
    before = stack.basis("right", torch.float32).clone()
    step([4, 4, 4, 4], 1)
    with caplog.at_level("INFO", logger="hf_galore_plugin.layers.experts"):
        step([6, 0, 6, 4], 2)  # refresh step: expert 1 gets no tokens
    after = stack.basis("right", torch.float32)
    assert torch.equal(after[1], before[1])
    for e in (0, 2, 3):
        assert not torch.allclose(after[e], before[e], atol=1e-3)
    assert stack.galore_expert_refreshes.tolist() == [2, 1, 2, 2]
    assert "1 of 4 experts received no tokens" in caplog.text


@pytest.mark.parametrize("basis_method", ["sketch", "svd"])
def test_expert_with_fewer_tokens_than_its_rank_gets_a_basis_rounding_cannot_move(basis_method):
    # Expert 1 gets 2 tokens on the refresh step: its gradient has rank 2 < expert_rank 4, so a decomposition's
    # columns 3 and 4 (singular value ~0) are picked by the record's last bits. Two runs whose records differ by
    # rounding (here: noise of 1e-7 relative, what two data-parallel ranks against one process differ by) must
    # still agree on the whole basis.
    config = GaLoreConfig(rank=8, expert_rank=4, experts=True, update_proj_gap=2, basis_method=basis_method)
    weight = torch.randn(EXPERTS, 48, 40, generator=torch.Generator().manual_seed(0))
    runs = []
    for noise in (0.0, 1e-7):
        model = _Holder(GaLoreExpertStack(nn.Parameter(weight.clone()), config))
        optimizer = create_optimizer(model, config, lr=1e-2)
        stack = model.experts
        for step, counts in enumerate(([4, 4, 4, 4], [4, 4, 4, 4], [4, 2, 4, 4])):
            x = torch.randn(sum(counts), 40, generator=torch.Generator().manual_seed(step))
            model(x, counts).square().sum().backward()
            optimizer.step()
            if step == 2:
                previous = stack.basis("right", torch.float32)[1].clone()
                record = stack._pending_grad
                for value in record.values() if isinstance(record, dict) else [record]:
                    value.mul_(1 + noise * torch.randn(value.shape, generator=torch.Generator().manual_seed(9)))
            after_step(model, optimizer)
            optimizer.zero_grad()
        runs.append(stack.basis("right", torch.float32)[1].clone())
    new, perturbed = runs
    torch.testing.assert_close(new.mT @ new, torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(perturbed @ perturbed.mT, new @ new.mT, atol=1e-4, rtol=0)
    # The oracle: the gradient's two directions (G^T = x^T dy spans the expert's 2 input rows), then the previous
    # basis' first two vectors with those directions projected out (Gram-Schmidt).
    rows = torch.randn(14, 40, generator=torch.Generator().manual_seed(2))[4:6]
    columns = list(torch.linalg.qr(rows.mT).Q.unbind(1))
    for candidate in previous.unbind(1)[:2]:
        kept = torch.stack(columns, 1)
        residual = candidate - kept @ (kept.mT @ candidate)
        assert residual.norm() > 0.5
        columns.append(residual / residual.norm())
    expected = torch.stack(columns, 1)
    torch.testing.assert_close(new @ new.mT, expected @ expected.mT, atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset", ["galore_adamw", "qgalore_adamw_8bit"])
def test_resume_with_experts_is_bit_exact(preset, round_trip):
    config = GaLoreConfig.preset(preset, rank=8, expert_rank=4, experts=True, update_proj_gap=3, lazy_window=1)

    def build():
        model = prepare_model(qwen3_moe(), config)
        return model, create_optimizer(model, lr=1e-2, weight_decay=0.01)

    data = [torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(10)]

    def run(model, optimizer, batches):
        for ids in batches:
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            after_step(model, optimizer)
            optimizer.zero_grad()

    model, optimizer = build()
    run(model, optimizer, data)
    uninterrupted = model.state_dict()

    model, optimizer = build()
    run(model, optimizer, data[:4])
    saved = round_trip({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    model, optimizer = build()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    run(model, optimizer, data[4:])
    resumed = model.state_dict()
    stacks = [layer for _, layer in galore_layers(model) if isinstance(layer, GaLoreExpertStack)]
    assert len(stacks) == 4 and all(s.counter("galore_num_refreshes") >= 3 for s in stacks)
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        assert torch.equal(resumed[key], uninterrupted[key]), key


def test_merged_checkpoint_loads_into_the_stock_class_without_the_plugin(tmp_path, python_subprocess):
    import hf_galore_plugin  # noqa: F401  (installs the save_pretrained patch)

    model = prepare_model(qwen3_moe(), GaLoreConfig(rank=8, expert_rank=4, experts=True, update_proj_gap=2))
    optimizer = create_optimizer(model, lr=1e-2)
    for i in range(3):
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(i))
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path / "merged")
    torch.save(ids, tmp_path / "ids.pt")
    python_subprocess(
        f"""
        import sys, torch
        from transformers import Qwen3MoeForCausalLM
        model = Qwen3MoeForCausalLM.from_pretrained({str(tmp_path / "merged")!r})
        assert not any(name.startswith("hf_galore_plugin") for name in sys.modules)
        assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
        with torch.no_grad():
            logits = model(torch.load({str(tmp_path / "ids.pt")!r})).logits
        torch.save(logits, {str(tmp_path / "logits.pt")!r})
        """
    )
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-5, rtol=1e-5)


def test_summary_line_names_unprojected_experts_and_the_option():
    model = mixtral()
    experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    share = experts / sum(p.numel() for p in model.parameters())
    line = state_of(prepare_model(model, GaLoreConfig(rank=8))).report.summary()
    assert f"2 expert modules ({experts:,} parameters, {share:.0%} of the model) are not projected" in line
    assert "set experts=True (optim_args experts=true)" in line
    projected = state_of(prepare_model(mixtral(), GaLoreConfig(rank=8, experts=True, expert_rank=4))).report.summary()
    assert "experts: 2 expert modules" in projected and "not projected" not in projected


def test_peft_expert_lora_is_left_to_peft_and_its_frozen_base_untouched():
    """A peft model with LoRA on the fused experts (peft's ``target_parameters``): GaLore (experts=True) takes the
    trainable linear layers named in target_modules, leaves peft's expert wrappers and their frozen base as they
    are (the base bit-equal after training), and the expert adapters train in the plain groups."""
    peft = pytest.importorskip("peft", reason="platform: peft is a dependency of the tests")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    model = peft.get_peft_model(qwen3_moe(), lora)
    stock = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n and "lora_" in n}
    assert len(stock) == 4 and len(adapters) == 8
    config = GaLoreConfig(rank=8, experts=True, update_proj_gap=2, target_modules=["o_proj"])
    model = prepare_model(model, config)
    assert [n for n, _ in galore_layers(model)] == [
        f"base_model.model.model.layers.{i}.self_attn.o_proj.modules_to_save.default" for i in (0, 1)
    ]
    assert not any(isinstance(m, (GaLoreExperts, GaLoreExpertStack)) for m in model.modules())
    assert "2 frozen expert modules left as they are (not trained)" in state_of(model).report.summary()
    assert "keep plain optimizer state" not in state_of(model).report.summary()
    optimizer = create_optimizer(model, config, lr=1e-2)
    params = dict(model.named_parameters())
    plain = {id(p) for g in optimizer.param_groups if not g.get("galore") for p in g["params"]}
    assert {id(params[n]) for n in adapters} <= plain
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad()
    params = dict(model.named_parameters())
    for name, weight in stock.items():
        assert torch.equal(params[name], weight), name
    assert all(not torch.equal(params[n], before) for n, before in adapters.items() if "lora_B" in n)


def test_merge_and_unload_puts_back_the_stock_experts_module():
    from hf_galore_plugin import merge_and_unload

    model = prepare_model(olmoe(), GaLoreConfig(rank=8, expert_rank=4, experts=True, update_proj_gap=2))
    optimizer = create_optimizer(model, lr=1e-2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad()
    with torch.no_grad():
        expected = model(ids).logits
    merge_and_unload(model)
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "OlmoeExperts" and experts.gate_up_proj.shape == (EXPERTS, 64, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_expert_options_are_validated():
    with pytest.raises(ValueError, match=r"GaLoreConfig.expert_rank=0 is invalid: use a positive rank"):
        GaLoreConfig(expert_rank=0)
    with pytest.raises(TypeError, match="GaLoreConfig.experts must be a bool"):
        GaLoreConfig(experts="yes")
    from hf_galore_plugin.integrations.optim_args import parse_optim_args

    assert parse_optim_args("experts=true,expert_rank=16") == {"experts": True, "expert_rank": 16}


# Each run: (engine, schedule, moment_handling, proj_type, sparse); see tests/distributed/moe_engines.py.
ENGINE_RUNS = [
    ("ddp", "default", "keep", "std", False),  # the package's defaults: staggered phases, sketch bases
    ("ddp", "paper", "reset", "std", False),  # aligned refresh, exact SVD of the dense per-expert record
    # 7 experts, top-1, 4 tokens a rank: experts without tokens (keep basis and moments), experts routed to on
    # one rank only, per-expert records of lower rank than expert_rank; FSDP2 cuts the experts 4 + 3
    ("ddp", "default", "reset", "std", True),
    ("fsdp1", "default", "keep", "std", False),  # use_orig_params: each stack's tensors whole or flat-sharded per rank
    ("fsdp2", "default", "keep", "std", False),  # factor and W0 sharded on the expert dimension
    ("fsdp2", "default", "keep", "left", False),  # left bases: each rank folds its experts' P_e B_e
    ("fsdp2", "default", "project", "right", True),  # moments transported / reset on the local experts
    # ZeRO under the aligned schedule: a staggered calibration resets some factors of ZeRO's flat group while
    # its step counter runs on (DeepSpeedGaLoreOptimizer's documented difference, linear layers alike)
    ("zero1", "aligned", "keep", "std", False),
    ("zero2", "aligned", "keep", "std", False),
    ("zero2", "aligned", "keep", "std", True),
    ("zero3", "aligned", "keep", "std", False),  # W0 and factor partitioned, gathered per refresh
]


@functools.lru_cache(maxsize=None)
def _moe_single_process(
    schedule: str, moment_handling: str, proj_type: str, sparse: bool, ranks_file: str = ""
) -> dict:
    from distributed._launch import SCRIPT, run_one_process

    out = Path(tempfile.mkdtemp(prefix="galore_moe_single_")) / "single.pt"
    env = _moe_env(schedule, moment_handling, proj_type, sparse, ranks_file)
    result = run_one_process(out, script=SCRIPT.with_name("moe_engines.py"), ENGINE="single", **env)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out)


def _moe_env(schedule: str, moment_handling: str, proj_type: str, sparse: bool, ranks_file: str = "") -> dict:
    return dict(
        PRESET="galore_adamw", SCHEDULE=schedule, MOMENT_HANDLING=moment_handling, PROJ_TYPE=proj_type,
        SPARSE="1" if sparse else "0", RANKS_FILE=ranks_file,
    )  # fmt: skip


def _run_moe_two_ranks(tmp_path, engine: str, env: dict) -> dict:
    from distributed._launch import SCRIPT, run_two_ranks

    if engine.startswith("zero"):
        pytest.importorskip("deepspeed", reason="platform: deepspeed is the [deepspeed] extra, which dev installs")
    result = run_two_ranks(tmp_path / "multi.pt", script=SCRIPT.with_name("moe_engines.py"), ENGINE=engine, **env)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(tmp_path / "multi.pt")


def _assert_moe_runs_match(multi: dict, one: dict, *, sparse: bool) -> None:
    """Two ranks against one process: losses and merged weights within the engine tolerances, the experts' bases
    spanning the same subspaces, their counters and per-expert refresh counts equal."""
    from distributed._launch import LOSS_RTOL, assert_weights_match

    assert multi["refreshes"] == one["refreshes"] >= 3
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor(one["losses"]), rtol=LOSS_RTOL, atol=0)
    assert multi["weights"].keys() == one["weights"].keys()
    assert "model.layers.1.mlp.experts.down_proj" in one["weights"]
    assert one["moved"] > 1e-4  # the expert weights move far beyond the bound they are compared within (1e-6)
    for key, value in one["weights"].items():
        assert_weights_match(multi["weights"][key], value, key=key)
    refreshed = {key: value for key, value in one["experts"].items() if key.endswith("galore_expert_refreshes")}
    assert len(refreshed) == 4
    for key, value in one["experts"].items():
        got = multi["experts"][key]
        if "galore_basis" in key:
            # The subspaces (projectors Q Q^T of the orthonormal bases: the stored one carries the layer's scale):
            # another summation order may flip a singular vector's sign or turn two vectors of nearly equal
            # singular values within their span.
            scale = one["experts"].get(key.rsplit(".", 1)[0] + ".galore_folded_scale", torch.tensor(1.0))
            got, value = got / scale, value / scale
            torch.testing.assert_close(got @ got.mT, value @ value.mT, rtol=0, atol=1e-5, msg=key)
        elif not value.is_floating_point():  # counters, per-expert refresh counts: the same decisions
            assert torch.equal(got, value), key
    counts = torch.stack(list(refreshed.values()))
    stacks = torch.stack([one["experts"][k.replace("expert_refreshes", "num_refreshes")] for k in refreshed])
    if sparse:  # some expert kept its basis at some refresh (it got no tokens in the recorded step)
        assert bool((counts < stacks[:, None]).any())
    else:
        assert torch.equal(counts, stacks[:, None].expand_as(counts))


@pytest.mark.distributed
@pytest.mark.parametrize("engine, schedule, moment_handling, proj_type, sparse", ENGINE_RUNS)
def test_two_ranks_with_experts_match_single_process(tmp_path, engine, schedule, moment_handling, proj_type, sparse):
    multi = _run_moe_two_ranks(tmp_path, engine, _moe_env(schedule, moment_handling, proj_type, sparse))
    _assert_moe_runs_match(multi, _moe_single_process(schedule, moment_handling, proj_type, sparse), sparse=sparse)


# Per-layer ranks as an 'auto' run writes them (galore_ranks.json rows), all different from the uniform ranks of
# the runs above (rank 8, expert_rank 4): the attention projections and each expert stack of the tiny Qwen3-MoE.
MOE_RANKS = {
    **{f"model.layers.{i}.self_attn.{kind}": r + i for i in range(2) for kind, r in
       {"q_proj": 3, "k_proj": 5, "v_proj": 6, "o_proj": 4}.items()},
    "model.layers.0.mlp.experts.gate_up_proj": 2, "model.layers.0.mlp.experts.down_proj": 6,
    "model.layers.1.mlp.experts.gate_up_proj": 7, "model.layers.1.mlp.experts.down_proj": 3,
}  # fmt: skip


@pytest.fixture(scope="module")
def moe_ranks_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("moe_ranks") / "galore_ranks.json"
    path.write_text(json.dumps([{"layer": name, "rank": rank} for name, rank in MOE_RANKS.items()]))
    return str(path)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "engine, schedule", [("ddp", "default"), ("fsdp2", "default"), ("zero2", "aligned"), ("zero3", "aligned")]
)
def test_expert_ranks_from_a_file_match_single_process(tmp_path, moe_ranks_file, engine, schedule):
    """Ranks an 'auto' allocation chose for an MoE model, expert stacks included, fixed from the start under an
    engine (rank_allocation=<galore_ranks.json>): trained as one process trains them."""
    one = _moe_single_process(schedule, "keep", "std", False, moe_ranks_file)
    uniform = _moe_single_process(schedule, "keep", "std", False)
    assert one["losses"] != uniform["losses"], "the file's ranks apply"
    for name, rank in MOE_RANKS.items():
        if ".experts." in name:  # each stack's factor: [experts, rows, rank] under std's right bases
            assert one["experts"][f"{name}.galore_factor"].shape[-1] == rank, name
    multi = _run_moe_two_ranks(tmp_path, engine, _moe_env(schedule, "keep", "std", False, moe_ranks_file))
    for name, rank in MOE_RANKS.items():
        if ".experts." in name:
            assert multi["experts"][f"{name}.galore_factor"].shape[-1] == rank, name
    _assert_moe_runs_match(multi, one, sparse=False)


def test_planner_traces_projected_experts(tmp_path):
    import json

    from hf_galore_plugin.plan import estimate

    fields = dict(
        model_type="qwen3_moe", vocab_size=128, hidden_size=HIDDEN, intermediate_size=128,
        moe_intermediate_size=MOE_INTERMEDIATE, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=1, tie_word_embeddings=False,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(fields))
    plans = {
        flag: estimate(
            config=str(tmp_path / "config.json"),
            methods=["galore_adamw"],
            seq_len=32,
            rank=8,
            optim_args="experts=true,expert_rank=4" if flag == "true" else "experts=false",
            full_trace=True,
            device="cpu",
        )["methods"]["galore_adamw"]  # fmt: skip
        for flag in ("false", "true")
    }
    # fp32 Adam state, two moments of 4 bytes per value: unprojected, of the 3-D expert weights; projected, of
    # the factors (right bases: E x 64 x 4 for gate_up_proj (64 x 64) and for down_proj (64 x 32), 2 layers).
    expert_values = 2 * EXPERTS * (2 * MOE_INTERMEDIATE * HIDDEN + HIDDEN * MOE_INTERMEDIATE)
    factor_values = 2 * EXPERTS * (2 * MOE_INTERMEDIATE * 4 + HIDDEN * 4)
    state = {flag: plan["parts"]["optimizer_state"] for flag, plan in plans.items()}
    assert state["false"] - state["true"] == 8 * (expert_values - factor_values)


def test_trainer_resume_with_experts_is_bit_exact(tmp_path):
    from conftest import logged_losses, token_data, training_args

    import hf_galore_plugin  # noqa: F401  (registers the optimizer names)

    def run(output_dir, resume=None):
        args = training_args(
            output_dir, optim="qgalore_adamw_8bit", optim_args="rank=8,update_proj_gap=3,experts=true,expert_rank=4",
            max_steps=8, save_strategy="steps", save_steps=4,
        )  # fmt: skip
        trainer = transformers.Trainer(model=qwen3_moe(), args=args, train_dataset=token_data(vocab=128))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    assert any(isinstance(m, GaLoreExperts) for m in full.model.modules())
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-4"))
    assert logged_losses(resumed) == logged_losses(full) and len(logged_losses(full)) == 8
    full_state, resumed_state = full.model.state_dict(), resumed.model.state_dict()
    assert full_state.keys() == resumed_state.keys()
    for key in full_state:
        assert torch.equal(full_state[key], resumed_state[key]), key
