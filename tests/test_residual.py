"""Residual mode (``GaLoreConfig.residual``; Fira, Chen et al. 2024, arXiv 2410.01623) against a dense float64
reference that forms the full gradient G = dy^T x, its part outside the subspace S = G - G Q Q^T (G - P P^T G
for a left basis), the previous step's scaling ratio from the factor's Adam update, Fira's growth limiter
(starting from the norm of the basis's first projected update) and the lagged rate (layers/linear.py,
``GaLoreLinear._apply_residual``, states the rule). Also: the default runs none of it, the rate includes a
scaling applied inside ``optimizer.step()`` (GaLoreCallback's lr_scale), a checkpoint resumes exactly, and the
engines that cannot run it refuse it by name.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, galore_layers, prepare_model
from hf_galore_plugin.engines import contract
from hf_galore_plugin.engines.capabilities import ENGINES, UnsupportedByEngine, check_residual
from hf_galore_plugin.layers.linear import RESIDUAL_GROWTH_LIMIT
from hf_galore_plugin.optim import AdamW
from hf_galore_plugin.state import record_state

LR, WEIGHT_DECAY, BETAS, EPS = 3e-3, 0.1, (0.9, 0.999), 1e-8
# (m, n) of the layer: 12 x 8 takes a right basis under proj_type='std' (ratio per output row), 6 x 10 a left one
# (ratio per input column).
SHAPES = {"right": (12, 8), "left": (6, 10)}


def _model(side: str, *, residual: bool = True, weight_storage: str = "as_loaded", seed: int = 0) -> nn.Sequential:
    m, n = SHAPES[side]
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(n, m, bias=False))
    config = GaLoreConfig(
        rank=3,
        update_proj_gap=100,  # no refresh after the calibration within these runs: the reference keeps Q
        basis_method="svd",
        refresh_schedule="aligned",
        target_modules=["0"],
        residual=residual,
        weight_storage=weight_storage,
    )
    return prepare_model(model, config)


def _batches(side: str, steps: int, micro: int, *, seed: int = 1, tokens: int = 6):
    """`steps` lists of `micro` (x, y) micro-batches; targets grow step by step so that the gradient outside the
    subspace grows too and the growth limiter cuts some steps."""
    m, n = SHAPES[side]
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(m, n, generator=gen)
    out = []
    for step in range(steps):
        batch = []
        for _ in range(micro):
            x = torch.randn(tokens, n, generator=gen)
            y = (1.0 + 0.6 * step) * x @ target.T + 0.1 * torch.randn(tokens, m, generator=gen)
            batch.append((x, y))
        out.append(batch)
    return out


def _train_step(model, optimizer, batch) -> None:
    for x, y in batch:
        loss = nn.functional.mse_loss(model(x), y) / len(batch)
        loss.backward()
    optimizer.step()
    after_step(model, optimizer)
    optimizer.zero_grad()


class DenseResidual:
    """GaLore with Fira's residual, dense and in float64, from a layer's state after its calibration step."""

    def __init__(self, layer, side: str, *, lr: float, weight_decay: float) -> None:
        self.side = side
        self.w0 = layer.base_weight(torch.float64).detach().clone()
        self.alpha = layer.alpha
        self.scale = layer.scale
        self.basis = layer.basis(side, torch.float64).detach().clone()
        self.factor = layer.galore_factor.detach().double().clone()
        self.exp_avg = torch.zeros_like(self.factor)
        self.exp_avg_sq = torch.zeros_like(self.factor)
        self.adam_step = 0
        self.lr, self.wd = lr, weight_decay
        self.ratio = None  # phi of the previous step, and that step's rate
        self.rate = None
        # the limited norm of the previous step's scaled residual; before the first, the norm of the first projected
        # update in W's space (scale * ||psi||), set by the first Adam step (0: none yet)
        self.previous_norm = 0.0
        self.limited = self.unlimited = 0  # micro-batches the limiter cut / let through

    def weight(self) -> torch.Tensor:
        low = self.factor @ self.basis.T if self.side == "right" else self.basis @ self.factor
        return self.alpha * self.w0 + self.scale * low

    def outside(self, g: torch.Tensor) -> torch.Tensor:
        q = self.basis
        return g - g @ q @ q.T if self.side == "right" else g - q @ q.T @ g

    def step(self, batch) -> None:
        grad_factor = torch.zeros_like(self.factor)
        applied = 0.0
        for x, y in batch:
            w = self.weight().requires_grad_(True)
            loss = nn.functional.mse_loss(x.double() @ w.T, y.double()) / len(batch)
            (g,) = torch.autograd.grad(loss, w)  # the full gradient dy^T x
            q = self.basis
            grad_factor += self.scale * (g @ q if self.side == "right" else q.T @ g)
            if self.ratio is None:
                continue
            s = self.outside(g)
            scaled = self.ratio[:, None] * s if self.side == "right" else s * self.ratio[None, :]
            norm = float(scaled.norm())
            limit = 1.0
            if self.previous_norm > 0:
                limit = min(1.0, max(RESIDUAL_GROWTH_LIMIT * self.previous_norm - applied, 0.0) / max(norm, 1e-300))
            self.limited += limit < 1.0
            self.unlimited += limit == 1.0
            applied += limit * norm
            self.w0 -= self.rate * limit * scaled / self.alpha
        # AdamW on the factor, eps * scale as the GaLore groups have it (api.galore_param_groups)
        eps = EPS * self.scale
        self.adam_step += 1
        beta1, beta2 = BETAS
        self.factor *= 1.0 - self.lr * self.wd
        self.exp_avg.lerp_(grad_factor, 1.0 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad_factor, grad_factor, value=1.0 - beta2)
        denom = self.exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**self.adam_step) + eps
        update = self.exp_avg / denom / (1.0 - beta1**self.adam_step)
        self.factor -= self.lr * update
        dim = 1 if self.side == "right" else 0
        self.ratio = update.norm(dim=dim) / (grad_factor.norm(dim=dim) / self.scale + 1e-8)
        self.rate = self.lr
        if applied:
            self.previous_norm = applied
        elif self.previous_norm == 0:
            self.previous_norm = self.scale * float(update.norm())
        self.alpha *= 1.0 - self.lr * self.wd


@pytest.mark.parametrize("micro", [1, 2], ids=["one-micro-batch", "two-micro-batches"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_residual_matches_dense_reference(side, micro):
    model = _model(side)
    ((_, layer),) = galore_layers(model)
    assert layer._residual_side == side
    optimizer = create_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
    batches = _batches(side, 6, micro)
    _train_step(model, optimizer, batches[0])  # calibration: the first basis
    assert layer.calibrated and not layer._residual_ready
    reference = DenseResidual(layer, side, lr=LR, weight_decay=WEIGHT_DECAY)
    w0_start = layer.base_weight(torch.float64).clone()
    for batch in batches[1:]:
        _train_step(model, optimizer, batch)
        reference.step(batch)
    # steps 1..5: no ratio at step 1 (the lag), residuals at steps 2..5, the limiter both cutting and not
    assert reference.limited >= 1 and reference.unlimited >= 1, (reference.limited, reference.unlimited)
    moved = (reference.w0 - w0_start).abs().max()
    assert moved > 1e-2  # the residual moved W0 (the low-rank part moves the factor, not W0)
    torch.testing.assert_close(layer.base_weight(torch.float64), reference.w0, rtol=1e-5, atol=1e-5 * float(moved))
    torch.testing.assert_close(layer.galore_factor.double(), reference.factor, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(
        layer.galore_residual_norm.double(),
        torch.tensor(reference.previous_norm, dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )


def test_quantized_base_takes_the_residual_through_stochastic_rounding():
    # int8 W0: every micro-batch's residual is stored again, stochastically rounded (unbiased: each store adds
    # noise of at most one quantization step per entry, of variance at most step^2 / 4), so W0 follows the
    # reference up to that noise summed over the stores, far below what the residual moved it.
    side, micro, lr = "right", 2, 3e-2
    model = _model(side, weight_storage="int8")
    ((_, layer),) = galore_layers(model)
    optimizer = create_optimizer(model, lr=lr, weight_decay=WEIGHT_DECAY)
    batches = _batches(side, 6, micro)
    _train_step(model, optimizer, batches[0])
    reference = DenseResidual(layer, side, lr=lr, weight_decay=WEIGHT_DECAY)
    w0_start = layer.base_weight(torch.float64).clone()
    for batch in batches[1:]:
        _train_step(model, optimizer, batch)
        reference.step(batch)
    stores = reference.limited + reference.unlimited  # one per micro-batch with a residual
    step = float(reference.w0.abs().max()) / 127  # one block of 256 >= 96 values: absmax / 127
    noise = 3 * math.sqrt(stores * reference.w0.numel()) * step / 2  # three standard deviations
    moved = float((reference.w0 - w0_start).norm())
    error = float((layer.base_weight(torch.float64) - reference.w0).norm())
    assert error < noise < 0.25 * moved, (error, noise, moved)


def test_off_by_default_and_a_residual_layer_elsewhere_changes_nothing():
    assert GaLoreConfig().residual is False
    side = "right"
    batches = _batches(side, 4, 2)

    def run() -> torch.Tensor:
        model = _model(side, residual=False)
        ((_, layer),) = galore_layers(model)
        assert layer._residual_side is None and contract.update_observer(layer.galore_factor) is None
        assert not any("residual" in key for key in layer.state_dict())
        optimizer = create_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
        for batch in batches:
            _train_step(model, optimizer, batch)
        return layer.effective_weight()

    alone = run()
    other = _model(side, seed=3)  # a residual layer in the process: the optimizers now look observers up
    assert contract.has_update_observers()
    assert torch.equal(run(), alone)
    del other


def test_rate_is_the_rate_the_step_used():
    # GaLoreCallback applies lr_scale inside optimizer.step() (a pre-hook scales the GaLore groups' lr, a post-hook
    # restores it): the residual's rate is the scaled one, which the factor stepped with.
    model = _model("left")
    ((_, layer),) = galore_layers(model)
    optimizer = create_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
    saved = []

    def scale(opt, args, kwargs):
        for group in opt.param_groups:
            if group.get("galore"):
                saved.append((group, group["lr"]))
                group["lr"] = group["lr"] * 0.85

    def restore(opt, args, kwargs):
        for group, lr in saved:
            group["lr"] = lr
        saved.clear()

    optimizer.register_step_pre_hook(scale)
    optimizer.register_step_post_hook(restore)
    for batch in _batches("left", 3, 1):
        _train_step(model, optimizer, batch)
    assert layer._residual_ready
    assert float(layer.galore_residual_rate) == pytest.approx(LR * 0.85, rel=1e-6)


def test_a_checkpoint_resumes_exactly():
    side = "right"
    batches = _batches(side, 6, 2)

    def fresh():
        model = _model(side)
        return model, create_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)

    model, optimizer = fresh()
    for batch in batches:
        _train_step(model, optimizer, batch)
    straight = galore_layers(model)[0][1].effective_weight()

    model, optimizer = fresh()
    for batch in batches[:3]:
        _train_step(model, optimizer, batch)
    saved_model, saved_optimizer = model.state_dict(), optimizer.state_dict()
    assert {"0.galore_residual_ratio", "0.galore_residual_rate", "0.galore_residual_norm"} <= set(saved_model)
    model, optimizer = fresh()
    model.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_optimizer)
    assert galore_layers(model)[0][1]._residual_ready
    for batch in batches[3:]:
        _train_step(model, optimizer, batch)
    assert torch.equal(galore_layers(model)[0][1].effective_weight(), straight)


@pytest.mark.parametrize("saved_with", [True, False])
def test_a_state_of_the_other_setting_loads(saved_with):
    # A run may turn the residual on or off at a resume; turned on, the layer waits for a step's ratio.
    source = _model("right", residual=saved_with)
    target = _model("right", residual=not saved_with)
    target.load_state_dict(source.state_dict())
    ((_, layer),) = galore_layers(target)
    assert not layer._residual_ready


def test_an_optimizer_that_reports_no_update_is_named():
    model = _model("right")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    with pytest.warns(RuntimeWarning, match="has not reported a step of the factor"):
        for batch in _batches("right", 5, 1):
            _train_step(model, optimizer, batch)


@pytest.mark.parametrize("state_bits, tolerance", [(32, 1e-5), (8, 0.05)])
def test_the_reported_update_is_the_step_the_factor_took(state_bits, tolerance):
    # Without weight decay the factor moves by -lr * update; 8-bit moments are reported as stored (dequantized),
    # the step used them before quantization: within their quantization error.
    model = _model("right")
    ((_, layer),) = galore_layers(model)
    factor = layer.galore_factor
    optimizer = AdamW([factor], lr=LR, state_bits=state_bits, min_8bit_numel=0)
    reported = []
    observe = layer.observe_update
    layer.observe_update = lambda grad, update, lr: (reported.append(update.clone()), observe(grad, update, lr))
    for batch in _batches("right", 4, 1):
        before = factor.detach().clone()
        _train_step(model, optimizer, batch)
        if layer.calibrated and reported:
            moved = (before - factor.detach()) / LR
            update = reported[-1]
            assert float((update - moved).norm()) <= tolerance * float(moved.norm())
    assert len(reported) == 4


# ---------------------------------------------------------------------- refusals
_LABELS = {
    "fsdp1": "FSDP1",
    "fsdp2": "FSDP2",
    "zero1": "DeepSpeed ZeRO-1",
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
}


@pytest.mark.parametrize("engine", ENGINES)
def test_refused_by_name_exactly_where_the_table_says(engine):
    check_residual(engine, residual=False)
    if engine in ("single", "ddp"):
        check_residual(engine, residual=True)
        return
    with pytest.raises(UnsupportedByEngine, match=f"residual=True is not supported under {_LABELS[engine]}: "):
        check_residual(engine, residual=True)


def test_optimizer_construction_refuses_an_engine_view_of_the_factor(monkeypatch):
    model = _model("right")
    ((_, layer),) = galore_layers(model)
    factor = layer.galore_factor
    # FSDP1 (use_orig_params) hands the optimizer the factor as a 1-D view of its flat shard
    whole = factor.data
    factor.data = whole.reshape(-1)
    with pytest.raises(UnsupportedByEngine, match="not supported under FSDP1"):
        AdamW([factor], lr=LR)
    factor.data = whole
    # FSDP2: a DTensor
    monkeypatch.setattr("hf_galore_plugin.layers.linear.is_dtensor", lambda t: t is factor)
    with pytest.raises(UnsupportedByEngine, match="not supported under FSDP2"):
        AdamW([factor], lr=LR)
    monkeypatch.undo()
    AdamW([factor], lr=LR)  # the whole factor: taken


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_adapter_refuses_residual(stage):
    from hf_galore_plugin.engines.deepspeed import DeepSpeedGaLoreOptimizer

    model = nn.Linear(4, 4)  # recorded as prepared: the adapter reads the config through state_of
    record_state(model, GaLoreConfig(rank=2, residual=True), report=None)
    engine = SimpleNamespace(zero_optimization_stage=lambda: stage, module=model)
    with pytest.raises(UnsupportedByEngine, match=f"residual=True is not supported under DeepSpeed ZeRO-{stage}"):
        DeepSpeedGaLoreOptimizer(engine)


def test_settings_it_cannot_run_are_refused_by_name():
    with pytest.raises(ValueError, match="GaLoreConfig.proj_type='full' is invalid: residual=True"):
        GaLoreConfig(residual=True, proj_type="full")
    with pytest.raises(ValueError, match="GaLoreConfig.experts=True is invalid: residual=True"):
        GaLoreConfig(residual=True, experts=True)
    with pytest.raises(TypeError, match="residual must be a bool"):
        GaLoreConfig(residual="yes")
    model = _model("right").half()
    x = torch.randn(2, SHAPES["right"][1], dtype=torch.float16)
    with pytest.raises(ValueError, match="does not support float16 compute"):
        model(x)
    with torch.no_grad():
        model(x)  # no backward, no residual: evaluation in float16 runs


# ---------------------------------------------------------------------- data parallel
@pytest.mark.distributed
def test_ddp_two_ranks_match_single_process(tmp_path):
    # tests/distributed/sharded_galore.py with RESIDUAL=1: 30 steps, gradient accumulation 2, refreshes at steps 0,
    # 10 and 20, right- and left-basis layers; each rank's k-th micro-batches together are the one process's k-th.
    from distributed._launch import assert_matches, run_one_process, run_two_ranks, single_process_run

    env = dict(PRESET="galore_adamw", PROJ_TYPE="std", BASIS_METHOD="svd", RESIDUAL="1")
    result = run_one_process(tmp_path / "single.pt", ENGINE="single", **env)
    assert result.returncode == 0, result.stderr[-4000:]
    result = run_two_ranks(tmp_path / "ddp.pt", ENGINE="ddp", **env)
    assert result.returncode == 0, result.stderr[-4000:]
    single = torch.load(tmp_path / "single.pt", weights_only=True)
    assert_matches(single, torch.load(tmp_path / "ddp.pt", weights_only=True))
    # ... and the residual moved the weights away from the run without it
    plain = single_process_run("galore_adamw", "std")
    assert any(
        not torch.allclose(single["weights"][key], plain["weights"][key], rtol=1e-3, atol=1e-4)
        for key in plain["weights"]
    )
