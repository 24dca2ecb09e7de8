"""GaLore with Muon on the factor (`galore_muon`, ``inner_optimizer='muon'``).

Oracles: ``torch.optim.Muon`` (its "match_rms_adamw" rate) for the optimizer on plain matrices (bit for bit) and
for a factor B with an orthonormal basis against the dense weight B Q^T; a dense re-implementation written here
(fp64 Newton-Schulz, torch's AdamW) for a model trained through the API; an uninterrupted run for a resume; a
hand computation for the change of basis; one process for DDP.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, galore_layers, prepare_model
from hf_galore_plugin.config import PAPER_REFRESH
from hf_galore_plugin.engines.contract import change_basis
from hf_galore_plugin.optim.muon import Muon, newton_schulz

from test_galore_torch_oracle import _data  # noqa: E402

COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def _torch_muon(params, lr, weight_decay, **options):
    return torch.optim.Muon(params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw", **options)


# ---------------------------------------------------------------------- the optimizer against torch's
@pytest.mark.parametrize("options", [{}, {"nesterov": False, "momentum": 0.9}, {"ns_steps": 3}])
def test_muon_on_plain_matrices_is_torch_optim_muon_bit_for_bit(options):
    torch.manual_seed(0)
    shapes = [(20, 8), (6, 30), (16, 16)]
    ours_params = [nn.Parameter(torch.randn(s)) for s in shapes]
    theirs_params = [nn.Parameter(p.detach().clone()) for p in ours_params]
    ours = Muon([{"params": ours_params, "muon": True}], lr=0.02, weight_decay=0.1, **options)
    theirs = _torch_muon(theirs_params, 0.02, 0.1, **options)
    for step in range(12):
        for p, q in zip(ours_params, theirs_params):
            p.grad = torch.randn(p.shape) * (1 + step % 3)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(ours_params, theirs_params):
        assert torch.equal(p, q)
        assert torch.equal(ours.state[p]["momentum_buffer"], theirs.state[q]["momentum_buffer"])


def test_other_groups_step_by_adamw_as_torch_does():
    torch.manual_seed(0)
    shapes = [(5,), (12, 7)]
    ours_params = [nn.Parameter(torch.randn(s)) for s in shapes]
    theirs_params = [nn.Parameter(p.detach().clone()) for p in ours_params]
    ours = Muon(ours_params, lr=3e-3, weight_decay=0.05, betas=(0.8, 0.95), eps=1e-7)  # no "galore"/"muon": AdamW
    theirs = torch.optim.AdamW(theirs_params, lr=3e-3, weight_decay=0.05, betas=(0.8, 0.95), eps=1e-7, foreach=False)
    for _ in range(10):
        for p, q in zip(ours_params, theirs_params):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(ours_params, theirs_params):
        assert torch.equal(p, q)


def _orthonormal(n, r, seed, dtype=torch.float32):
    """n x r with orthonormal columns, to `dtype`'s rounding (QR in that dtype)."""
    q, _ = torch.linalg.qr(torch.randn(n, r, generator=torch.Generator().manual_seed(seed), dtype=dtype))
    return q


# Right basis (a tall m x n weight, std projects its n columns) and left basis (a wide one): the rate adjustment
# 0.2 sqrt(max) is then the same for the factor and the dense weight.
SIDES = [("right", 48, 20, 6), ("left", 18, 40, 5)]


@pytest.fixture
def torch_muon_in_float64(monkeypatch):
    """torch.optim.Muon's own step with the one bfloat16 cast of its iteration (``grad.bfloat16()``) lifted to
    float64: its algorithm exactly, without bf16 rounding (see the test below for why that is needed)."""
    # A copy, as the cast it stands for makes one: torch normalises the result in place.
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self, *args, **kwargs: self.to(torch.float64, copy=True))


@pytest.mark.parametrize("side, m, n, r", SIDES)
@pytest.mark.parametrize("nesterov", [True, False])
def test_factor_step_is_torch_muon_on_the_dense_weight(torch_muon_in_float64, side, m, n, r, nesterov):
    """Muon on B with an orthonormal basis Q (W = B Q^T; P B on the left) equals torch.optim.Muon on the dense W
    with gradient g_B Q^T, step by step over 8 steps with weight decay.

    torch's iteration runs in bfloat16, which on a dense matrix of rank r is not Muon restricted to the subspace:
    the rounding noise lies in every direction and the iteration's slope at zero (a = 3.4445 per step, ~480
    over 5) lifts it, so about a third of the norm of the dense bf16 update of this test lies outside the
    gradient's row space (measured: 0.34; fp32: 1e-5). Comparing with it tests bf16 noise, so torch's step runs
    in float64 here (fixture). Tolerances on the weights (entries up to ~3): our step in float64 agrees to 1e-10
    (measured 1e-15); in float32 (the factor, its momentum and iteration in fp32: one rounding of an entry of
    size 2 is 2.4e-7) to 2e-6 over the 8 steps (measured 5e-7); the momenta, a linear function of the same
    gradients, to 1e-6 (measured 2e-8).
    """
    lr, wd, steps = 0.01, 0.1, 8
    basis = _orthonormal(n if side == "right" else m, r, seed=3, dtype=torch.float64)
    shape = (m, r) if side == "right" else (r, n)

    def dense(b):
        return b @ basis.mT.to(b.dtype) if side == "right" else basis.to(b.dtype) @ b

    gen = torch.Generator().manual_seed(5)
    factor0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(steps)]

    for dtype, atol in ((torch.float64, 1e-10), (torch.float32, 2e-6)):
        factor = nn.Parameter(factor0.to(dtype))
        weight = nn.Parameter(dense(factor0))
        ours = Muon([{"params": [factor], "galore": True}], lr=lr, weight_decay=wd, nesterov=nesterov, ns_dtype=dtype)
        theirs = _torch_muon([weight], lr, wd, nesterov=nesterov)
        for g in grads:
            factor.grad, weight.grad = g.to(dtype), dense(g)
            ours.step()
            theirs.step()
            torch.testing.assert_close(dense(factor.detach().double()), weight.detach(), rtol=0, atol=atol)
        # The momentum is the dense one restricted to the subspace.
        torch.testing.assert_close(
            dense(ours.state[factor]["momentum_buffer"].double()), theirs.state[weight]["momentum_buffer"],
            rtol=0, atol=1e-6,
        )  # fmt: skip


def test_torch_bf16_muon_on_a_low_rank_gradient_leaves_the_subspace():
    """The measurement behind the fixture above: torch's bf16 iteration of a rank-r dense matrix puts a large
    part of its output outside the matrix's row space; the factor's iteration cannot (its output is B-shaped)."""
    m, n, r = 48, 20, 6
    basis = _orthonormal(n, r, seed=3)
    x = torch.randn(m, r, generator=torch.Generator().manual_seed(5)) @ basis.T
    for dtype, low, high in ((torch.bfloat16, 0.1, 1.0), (torch.float32, 0.0, 1e-4)):
        update = newton_schulz(x, dtype=dtype).float()
        outside = (update - update @ basis @ basis.T).norm() / update.norm()
        assert low <= outside <= high, (dtype, outside)


def test_newton_schulz_of_an_expert_stack_is_per_expert():
    x = torch.randn(3, 10, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batched = newton_schulz(x, dtype=torch.float64)
    for e in range(3):
        torch.testing.assert_close(batched[e], newton_schulz(x[e], dtype=torch.float64), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------- through the API, against dense
def _reference_ns(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic iteration written out in fp64: X <- a X + b (X X^T) X + c (X X^T)^2 X on the wide side."""
    a, b, c = COEFFICIENTS
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / max(x.norm().item(), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return (x.T if tall else x).float()


def _mlp(seed=0):
    torch.manual_seed(seed)
    # 40 x 24 (std: right basis), 40 x 40 (right), 16 x 40 (left basis); biases train by AdamW.
    return nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 16))


def _batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(24, 16, generator=gen)
    xs = [torch.randn(32, 24, generator=gen) for _ in range(n)]
    return [(x, torch.tanh(x @ teacher)) for x in xs]


def test_api_run_trains_and_matches_a_dense_reimplementation():
    """prepare_model / create_optimizer / after_step with galore_muon: the loss falls, and after the calibration
    (aligned, exact SVD at step 0; no refresh after it) each step equals, on the merged weights, a dense step
    written here: momentum of the projected gradient G Q Q^T (P P^T G on the left), Newton-Schulz of the
    Nesterov blend in fp64, W <- W (1 - lr wd) - lr s 0.2 sqrt(max(m, n)) NS(.), the biases by torch's AdamW.
    Tolerance: our iteration runs in fp32 (set on the groups) on the factor, the reference in fp64 on the dense
    matrix: 5e-6 absolute on weights of size ~0.2 over 6 steps (measured below 1e-6)."""
    lr, wd, mu, rank, steps = 2e-2, 0.05, 0.95, 8, 6
    config = GaLoreConfig.preset("galore_muon", rank=rank, update_proj_gap=1000, **PAPER_REFRESH)
    model = prepare_model(_mlp(), config)
    opt = create_optimizer(model, lr=lr, weight_decay=wd)
    assert isinstance(opt, Muon)
    for group in opt.param_groups:
        group["ns_dtype"] = torch.float32
    data = _batches(40)
    loss_fn = nn.MSELoss()

    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        after_step(model, opt)
        opt.zero_grad()
        return loss.item()

    first = train_step(*data[0])  # calibration: the bases are set after this step
    layers = dict(galore_layers(model))
    assert len(layers) == 3 and all(layer.calibrated for layer in layers.values())

    # The dense twin, from the merged weights after calibration.
    dense = _mlp()
    with torch.no_grad():
        for name, module in dense.named_modules():
            if name in layers:
                module.weight.copy_(layers[name].effective_weight())
                module.bias.copy_(layers[name].bias)
    projectors = {}
    for name, layer in layers.items():
        q, p = layer.basis("right", torch.float32), layer.basis("left", torch.float32)
        projectors[name] = (q, p, layer.scale)
        assert (q is None) != (p is None)
    biases = [m.bias for m in dense.modules() if isinstance(m, nn.Linear)]
    adamw = torch.optim.AdamW(biases, lr=lr, weight_decay=wd, foreach=False)
    for bias, ours in zip(biases, [layer.bias for layer in layers.values()]):  # the biases' AdamW took step 0
        state = opt.state[ours]
        adamw.state[bias] = {"step": torch.tensor(float(state["step"])), "exp_avg": state["exp_avg"].clone(),
                             "exp_avg_sq": state["exp_avg_sq"].clone()}  # fmt: skip
    momenta = {name: torch.zeros_like(dense.get_submodule(name).weight) for name in layers}
    deviation = 0.0

    for x, y in data[1 : 1 + steps]:
        train_step(x, y)
        loss_fn(dense(x), y).backward()
        with torch.no_grad():
            for name, (q, p, scale) in projectors.items():
                w = dense.get_submodule(name).weight
                g = w.grad @ q @ q.T if q is not None else p @ p.T @ w.grad
                momenta[name].lerp_(g, 1 - mu)
                update = _reference_ns(g.lerp(momenta[name], mu))
                w.mul_(1 - lr * wd).sub_(update * (lr * scale * 0.2 * math.sqrt(max(w.shape))))
                w.grad = None
        adamw.step()
        adamw.zero_grad()
        for name, layer in layers.items():
            ours, theirs = layer.effective_weight(), dense.get_submodule(name).weight.detach()
            deviation = max(deviation, (ours - theirs).abs().max().item())
            torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-6)
    print(f"galore_muon against the dense re-implementation: max weight deviation {deviation:.2e}")
    for x, y in data[1 + steps :]:
        last = train_step(x, y)
    assert last < 0.7 * first, (first, last)


def test_factor_state_is_half_of_galore_adamw(tiny_llama):
    def factor_state_bytes(preset):
        model = prepare_model(tiny_llama(vocab_size=96), GaLoreConfig.preset(preset, rank=16, update_proj_gap=5))
        opt = create_optimizer(model, lr=1e-3)
        for ids in _data()[:8]:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            after_step(model, opt)
            opt.zero_grad()
        factors = [layer.galore_factor for _, layer in galore_layers(model)]
        assert all(opt.state.get(f) for f in factors)
        return sum(
            v.numel() * v.element_size() for f in factors for v in opt.state[f].values() if isinstance(v, torch.Tensor)
        )

    muon, adamw = factor_state_bytes("galore_muon"), factor_state_bytes("galore_adamw")
    # AdamW also keeps a step tensor per factor: Muon's one m x r momentum is a little under half.
    assert 0.45 * adamw <= muon <= 0.5 * adamw, (muon, adamw)


# ---------------------------------------------------------------------- resume
def test_optimizer_state_round_trip_resumes_exactly(tiny_llama):
    config = GaLoreConfig.preset("galore_muon", rank=16, update_proj_gap=4, moment_handling="project")
    data = _data()[:12]

    def run(model, opt, batches):
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            after_step(model, opt)
            opt.zero_grad()

    straight = prepare_model(tiny_llama(vocab_size=96), config)
    straight_opt = create_optimizer(straight, lr=1e-3, weight_decay=0.01)
    run(straight, straight_opt, data)

    first = prepare_model(tiny_llama(vocab_size=96), config)
    first_opt = create_optimizer(first, lr=1e-3, weight_decay=0.01)
    run(first, first_opt, data[:6])
    buffer = io.BytesIO()
    torch.save(first_opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = prepare_model(tiny_llama(vocab_size=96, seed=7), config)
    resumed.load_state_dict(first.state_dict())
    resumed_opt = create_optimizer(resumed, lr=1e-3, weight_decay=0.01)
    resumed_opt.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed_opt.param_groups[0]["ns_dtype"] is torch.bfloat16
    run(resumed, resumed_opt, data[6:])
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_bf16_parameters_keep_an_fp32_momentum_through_a_round_trip():
    p = nn.Parameter(torch.randn(12, 4, dtype=torch.bfloat16))
    opt = Muon([{"params": [p], "galore": True}], lr=1e-2)
    p.grad = torch.randn(12, 4, dtype=torch.bfloat16)
    opt.step()
    fresh = Muon([{"params": [p], "galore": True}], lr=1e-2)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.state[p]["momentum_buffer"].dtype == torch.float32


# ---------------------------------------------------------------------- the change of basis
def _stepped(shape, steps=3):
    p = nn.Parameter(torch.zeros(shape))
    opt = Muon([{"params": [p], "galore": True}], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
    return p, opt


def _rotation(r, seed=1):
    return _orthonormal(r, r, seed)


def test_change_basis_keep_reset_project():
    p, opt = _stepped((6, 4))
    before = opt.state[p]["momentum_buffer"].clone()
    change_basis(opt, p, policy="keep")
    assert torch.equal(opt.state[p]["momentum_buffer"], before)

    right = _rotation(4) * 0.9  # a transport between subspaces that do not coincide: it loses mass
    change_basis(opt, p, right=right, policy="project")
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], before @ right)
    left = _rotation(6, seed=2)
    change_basis(opt, p, left=left, policy="project")
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], left.T @ before @ right)
    both = change_basis(opt, p, left=left.T, right=right.T, policy="project")
    assert both is None
    torch.testing.assert_close(
        opt.state[p]["momentum_buffer"], left @ left.T @ before @ right @ right.T, rtol=1e-5, atol=1e-6
    )

    change_basis(opt, p, policy="reset")
    assert p not in opt.state or not opt.state[p]
    fresh = nn.Parameter(torch.zeros(6, 4))
    idle = Muon([{"params": [fresh], "galore": True}], lr=1e-2)
    change_basis(idle, fresh, right=right, policy="project")  # no state yet: nothing to move
    assert not idle.state.get(fresh)


def test_change_basis_per_expert():
    mask = torch.tensor([True, False, True])
    p, opt = _stepped((3, 5, 4))
    before = opt.state[p]["momentum_buffer"].clone()
    change_basis(opt, p, policy="reset", experts=mask)
    buf = opt.state[p]["momentum_buffer"]
    assert not buf[0].any() and not buf[2].any() and torch.equal(buf[1], before[1])

    p, opt = _stepped((3, 5, 4))
    before = opt.state[p]["momentum_buffer"].clone()
    t = torch.stack([_rotation(4, seed=s) for s in range(3)])
    t[1] = torch.eye(4)
    change_basis(opt, p, right=t, policy="project", experts=mask)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], before @ t)


@pytest.mark.parametrize("policy", ["keep", "reset", "project"])
def test_refresh_hands_muon_the_change(tiny_llama, monkeypatch, policy):
    """A refresh of a GaLore layer calls Muon.change_basis with the policy, and the momentum afterwards is what
    the rule says (kept, gone, or moved by the transport matrix the refresh handed over)."""
    model = prepare_model(
        tiny_llama(vocab_size=96),
        GaLoreConfig.preset("galore_muon", rank=16, update_proj_gap=3, moment_handling=policy),
    )
    opt = create_optimizer(model, lr=1e-3)
    calls = []
    original = Muon.change_basis

    def spy(self, param, **kwargs):
        before = {k: v.clone() for k, v in self.state.get(param, {}).items()}
        original(self, param, **kwargs)
        after = {k: v.clone() for k, v in self.state.get(param, {}).items()}
        calls.append((kwargs["policy"], kwargs.get("right"), kwargs.get("left"), before, after))

    monkeypatch.setattr(Muon, "change_basis", spy)
    for ids in _data()[:7]:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        after_step(model, opt)
        opt.zero_grad()
    assert {c[0] for c in calls} <= {policy, "reset"}  # a first calibration is a reset
    later = [c for c in calls if c[0] == policy and c[3]]
    assert later
    for _, right, left, before, after in later:
        if policy == "keep":
            assert torch.equal(after["momentum_buffer"], before["momentum_buffer"])
        elif policy == "reset":
            assert not after
        else:
            m = before["momentum_buffer"]
            expected = m @ right if right is not None else left.mT @ m
            torch.testing.assert_close(after["momentum_buffer"], expected)


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"state_bits": 8}, "state_bits"),
        ({"state_offload": "cpu"}, "state_offload"),
        ({"residual": True}, "residual"),
        ({"muon_momentum": 1.0}, "muon_momentum"),
        ({"muon_momentum": True}, "muon_momentum"),
        ({"muon_ns_steps": 0}, "muon_ns_steps"),
        ({"muon_ns_steps": 2.5}, "muon_ns_steps"),
        ({"muon_nesterov": "yes"}, "muon_nesterov"),
    ],
)
def test_bad_muon_configs_are_refused_by_field(overrides, field):
    with pytest.raises(ValueError, match=rf"GaLoreConfig\.{field}=.* is invalid: .*"):
        GaLoreConfig.preset("galore_muon", **overrides)


def test_muon_options_without_muon_and_error_feedback_are_refused():
    with pytest.raises(ValueError, match=r"muon_momentum=0\.9 is invalid: it is an option of Muon: set "
                                         r"inner_optimizer='muon'"):  # fmt: skip
        GaLoreConfig(muon_momentum=0.9)
    with pytest.raises(ValueError, match="muon_ns_steps"):
        GaLoreConfig.preset("galore_adafactor", muon_ns_steps=3)
    with pytest.raises(ValueError, match="error_feedback"):
        GaLoreConfig.preset("galore_muon", error_feedback=True)
    GaLoreConfig.preset("galore_muon", muon_momentum=0.9, muon_nesterov=False, muon_ns_steps=6)


def test_muon_refuses_what_it_cannot_step():
    p = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="momentum=1.0 is invalid"):
        Muon([p], momentum=1.0)
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([p], ns_dtype=torch.int8)
    with pytest.raises(RuntimeError, match="flat partition.*Newton-Schulz needs the whole matrix"):
        Muon([{"params": [nn.Parameter(torch.zeros(16))], "galore": True}])


def test_every_engine_runs_it_and_fsdp1_checkpoints_must_be_sharded(tiny_llama):
    """Muon runs under every engine (whole factors, FSDP2's rows, FSDP1's and ZeRO's registered fragments); under
    FSDP1 the Trainer refuses a FULL_STATE_DICT checkpoint (transformers' FSDP1 default) before the first step,
    naming the fix; a ZeRO-3-partitioned factor is accepted when the optimizer is built (ZeRO hands the step
    registered flat partitions); a 1-D flat slice nobody registered is refused, naming what registers."""
    from hf_galore_plugin.integrations.construction import check_training_args

    class ZeRO:
        deepspeed = {"zero_optimization": {"stage": 3}}
        fsdp = None

    class FSDP:
        deepspeed = None
        fsdp = ["full_shard"]

        def __init__(self, **config):
            self.fsdp_config = {"version": 1, **config}  # TrainingArguments strip the fsdp_ prefix of its keys

    class FSDP2:
        deepspeed = None
        fsdp = ["full_shard"]
        fsdp_config = {"version": 2}

    muon = GaLoreConfig.preset("galore_muon")
    check_training_args(ZeRO(), "galore_muon", muon)
    check_training_args(FSDP(state_dict_type="SHARDED_STATE_DICT"), "galore_muon", muon)
    with pytest.raises(ValueError, match="FSDP1.*SHARDED_STATE_DICT only.*'FULL_STATE_DICT'.*fsdp_state_dict_type"):
        check_training_args(FSDP(), "galore_muon", muon)
    check_training_args(FSDP2(), "galore_muon", muon)
    model = prepare_model(tiny_llama(vocab_size=96), GaLoreConfig.preset("galore_muon", rank=16))
    factor = galore_layers(model)[0][1].galore_factor
    factor.ds_id, factor.ds_shape = 0, factor.shape  # as ZeRO-3 marks a partitioned parameter
    assert isinstance(create_optimizer(model, lr=1e-3), Muon)
    flat = nn.Parameter(torch.zeros(40))
    with pytest.raises(RuntimeError, match="flat partition of shape \\(40,\\).*DeepSpeedGaLoreOptimizer"):
        Muon([{"params": [flat], "galore": True}], lr=1e-3)


# ---------------------------------------------------------------------- DDP
@pytest.mark.distributed
def test_ddp_two_ranks_match_single_process(tmp_path):
    from distributed._launch import assert_matches, run_two_ranks, single_process_run

    out = tmp_path / "ddp.pt"
    result = run_two_ranks(out, ENGINE="ddp", PRESET="galore_muon", PROJ_TYPE="std", BASIS_METHOD="svd")
    assert result.returncode == 0, result.stderr[-4000:]
    assert_matches(single_process_run("galore_muon", "std"), torch.load(out, weights_only=True))


# ---------------------------------------------------------------------- FSDP2
@pytest.mark.distributed
@pytest.mark.parametrize(
    "proj_type, moment_handling, reference",
    [
        ("std", "keep", "single"),  # right-basis factors 33 x 4 (17 + 16 rows), left-basis factors 4 x 33 (2 + 2)
        ("full", "keep", "single"),  # two-sided bases
        # The momentum moved into each new basis on the local rows. Against DDP: with right bases only, the last
        # bits in which two ranks' averaged gradients differ from one process's flip bfloat16 roundings of the
        # iteration, and DDP itself is then 3.7e-5 from one process (measured); FSDP2 must compute DDP's update.
        ("right", "project", "ddp"),
    ],
)
def test_fsdp2_row_shards_orthogonalise_the_whole_factor_as_one_process(
    tmp_path, proj_type, moment_handling, reference
):
    """Under FSDP2 (fully_shard) each factor and its momentum are DTensors sharded on rows: every rank gathers
    the matrix to orthogonalise, runs the same Newton-Schulz, keeps its rows, so 2 ranks train as one process
    (or DDP) does within the engines' tolerances; rank 0 keeps only its shards of the state."""
    from distributed._launch import assert_matches, engine_and_reference

    expected, multi = engine_and_reference(
        tmp_path, "fsdp2", "galore_muon", proj_type, reference, BASIS_METHOD="svd", MOMENT_HANDLING=moment_handling
    )
    assert_matches(expected, multi)
    # Momentum (Muon) and moments (AdamW on the other parameters) sharded: rank 0 holds about half of one
    # process's (or DDP's) state (the larger shard of each odd number of rows); measured 0.51.
    assert multi["state_numel"] < 0.6 * expected["state_numel"], (multi["state_numel"], expected["state_numel"])


@pytest.mark.distributed
def test_fsdp2_expert_stacks_orthogonalise_on_their_rank_as_ddp(tmp_path):
    """FSDP2 shards an expert stack (E x m x r factors) on its expert dimension: each rank orthogonalises its
    experts' whole matrices, the linear layers' row shards are gathered, and the run is DDP's (measured: bit for
    bit). Against DDP, not one process: on this MoE the last bits in which two ranks' averaged gradients differ
    from one process's flip bfloat16 roundings of the iteration, and DDP is 2.9e-3 from one process (measured)."""
    from distributed._launch import SCRIPT, run_two_ranks
    from test_experts import _assert_moe_runs_match

    runs = {}
    for engine in ("ddp", "fsdp2"):
        out = tmp_path / f"{engine}.pt"
        result = run_two_ranks(out, script=SCRIPT.with_name("moe_engines.py"), ENGINE=engine, PRESET="galore_muon",
                               SCHEDULE="paper", MOMENT_HANDLING="keep", PROJ_TYPE="std", SPARSE="0")  # fmt: skip
        assert result.returncode == 0, result.stderr[-4000:]
        runs[engine] = torch.load(out, weights_only=True)
    _assert_moe_runs_match(runs["fsdp2"], runs["ddp"], sparse=False)


# ---------------------------------------------------------------------- FSDP1
@pytest.mark.distributed
@pytest.mark.parametrize(
    "model, checkpoint, reference",
    [
        # One unit: rank 1 holds none of the first factor, the second is cut inside a row. Against DDP: the last
        # bits in which two ranks' averaged gradients differ from one process's flip bfloat16 roundings of the
        # iteration here, and FSDP1 is then 5e-6 from one process (measured); it must compute DDP's update.
        ("one_unit", "plain", "ddp"),
        ("one_unit", "sharded", "ddp"),  # FSDP.optim_state_dict, SHARDED_STATE_DICT (accelerate's FSDP1 default)
        ("one_unit", "full", "ddp"),
        ("blocks", "plain", "single"),  # one unit per Block: rank 0 holds every factor whole, rank 1 none
    ],
)
def test_fsdp1_views_orthogonalise_the_whole_factor_as_one_process(tmp_path, model, checkpoint, reference):
    """Under FSDP1 (use_orig_params=True) each factor reaches Muon as 1-D views of its unit's flat shard, cut at any
    element: every rank all-reduces the matrix to orthogonalise (zeros outside its elements), runs the same
    Newton-Schulz and keeps its elements, so 2 ranks train as one process (or DDP) does within the engines'
    tolerances; rank 0 keeps only its elements of the momenta; and a checkpoint of the optimizer (per rank, or
    FSDP1's optimizer state dict) resumes bit for bit."""
    from distributed._fsdp1 import assert_fsdp1_trains_as_reference

    # Measured: losses within 1.3e-7 relative, weights within 2.4e-7 absolute. State: momentum (Muon) and moments
    # (AdamW on the biases and the last layer) sharded: measured 0.40 (one_unit), 0.85 (blocks: rank 0 holds the
    # factors and biases of every Block, rank 1 W0's rest and the last layer's half).
    bound = 0.6 if model == "one_unit" else 0.9
    assert_fsdp1_trains_as_reference(tmp_path, "galore_muon", model, checkpoint, reference, bound)


# ---------------------------------------------------------------------- the Trainer
def test_trainer_name_galore_muon_trains_and_resumes_bit_exact(tmp_path):
    """``optim="galore_muon"``: the Trainer's optimizer is the plugin's Muon; the loss falls; a resume from a
    checkpoint is bit-exact (the Trainer test of the other names, run for this one)."""
    import test_integration_trainer as trainer_tests
    from transformers import Trainer

    from conftest import build_tiny_llama, logged_losses, training_args
    from hf_galore_plugin.engines.contract import unwrap_optimizer

    rows = [{"input_ids": row, "labels": row} for batch in _data()[:8] for row in batch]  # a Markov chain
    args = training_args(tmp_path / "plain", optim="galore_muon", max_steps=16, learning_rate=3e-3,
                         per_device_train_batch_size=8)  # fmt: skip
    trainer = Trainer(model=build_tiny_llama(vocab_size=96), args=args, train_dataset=rows)
    trainer.train()
    assert isinstance(unwrap_optimizer(trainer.optimizer), Muon)
    losses = logged_losses(trainer)
    assert sum(losses[s] for s in range(13, 17)) < 0.9 * sum(losses[s] for s in range(1, 5)), losses
    trainer_tests.test_resume_from_checkpoint_is_bit_exact(tmp_path / "resume", "galore_muon")
