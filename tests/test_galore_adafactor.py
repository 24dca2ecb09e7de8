"""GaLore with Adafactor on the factor (`galore_adafactor`, ``inner_optimizer='adafactor'``).

Oracles: transformers' own ``Adafactor`` for the optimizer on plain parameters (every option), galore-torch's
``GaLoreAdafactor`` for GaLore on a tiny Llama (the same-step-basis caveat of tests/test_galore_torch_oracle.py:
galore-torch computes the basis of step t from G_t and uses it at step t, ours from step t+1, and step 0 is our
calibration step). The seam: Adafactor's ``change_basis`` is what a refresh calls, and does what its rule says.
"""

from __future__ import annotations

import pytest
import torch

import galore_torch  # noqa: E402  (the oracle: scripts/env.sh installs it)

from hf_galore_plugin import (  # noqa: E402
    Adafactor,
    AdamW,
    GaLoreConfig,
    after_step,
    create_optimizer,
    galore_layers,
    prepare_model,
)
from hf_galore_plugin.config import PAPER_REFRESH  # noqa: E402
from hf_galore_plugin.engines.contract import change_basis  # noqa: E402
from hf_galore_plugin.optim.adafactor import _second_moment  # noqa: E402

from test_galore_torch_oracle import LOG_EVERY, STEPS, WARMUP, _data  # noqa: E402

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------------- the optimizer against transformers'
@pytest.mark.parametrize(
    "options",
    [
        dict(lr=1e-2, scale_parameter=False, relative_step=False),
        dict(lr=None),  # Adafactor's defaults: relative step, parameter scale
        dict(lr=None, warmup_init=True, beta1=0.9, weight_decay=0.01),
        dict(lr=3e-3, scale_parameter=True, relative_step=False, beta1=0.8, clip_threshold=0.5, decay_rate=-0.6),
    ],
)
def test_adafactor_matches_transformers(options):
    torch.manual_seed(0)
    shapes = [(12, 7), (5,), (3, 4, 6)]
    ours_params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    ours = Adafactor(ours_params, **options)
    theirs = transformers.optimization.Adafactor(theirs_params, **options)
    for step in range(30):
        grads = [torch.randn(s) * (1 + step % 3) for s in shapes]
        for params, opt in ((ours_params, ours), (theirs_params, theirs)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(ours_params, theirs_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_adafactor_refuses_what_transformers_refuses_and_galore_groups_cannot_do():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="relative_step"):
        Adafactor([p], lr=1e-3)
    with pytest.raises(ValueError, match="warmup_init"):
        Adafactor([p], lr=1e-3, relative_step=False, warmup_init=True)
    with pytest.raises(ValueError, match="scale_parameter=True is not supported on a GaLore group"):
        Adafactor([{"params": [p], "galore": True}], lr=1e-3, relative_step=False)
    with pytest.raises(ValueError, match="relative_step=True with weight_decay"):
        Adafactor([{"params": [p], "galore": True}], scale_parameter=False, weight_decay=0.1)
    with pytest.raises(RuntimeError, match="flat partition"):
        Adafactor([{"params": [torch.nn.Parameter(torch.zeros(16))], "galore": True}], lr=1e-3,
                  relative_step=False, scale_parameter=False)  # fmt: skip


# ---------------------------------------------------------------------- GaLore against galore-torch
def _llama_step(model, opt, model_driver=None):
    def run(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        if model_driver is not None:
            after_step(model, opt)
        opt.zero_grad()
        return loss.item()

    return run


def test_galore_adafactor_tracks_galore_torch_within_2_percent(tiny_llama):
    rank, gap, scale, lr = 16, 50, 0.25, 1e-2
    theirs_model = tiny_llama(vocab_size=96, intermediate_size=176)
    targets = [
        m.weight for n, m in theirs_model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    ]
    others = [p for p in theirs_model.parameters() if all(p is not t for t in targets)]
    # transformers' galore_adafactor: Adafactor's defaults except scale_parameter / relative_step off, lr given.
    theirs_opt = galore_torch.GaLoreAdafactor(
        [
            {"params": others},
            {"params": targets, "rank": rank, "update_proj_gap": gap, "scale": scale, "proj_type": "std"},
        ],
        lr=lr,
        scale_parameter=False,
        relative_step=False,
    )
    ours_model = prepare_model(
        tiny_llama(vocab_size=96, intermediate_size=176),
        GaLoreConfig.preset("galore_adafactor", rank=rank, update_proj_gap=gap, scale=scale, **PAPER_REFRESH),
    )
    assert len(galore_layers(ours_model)) == len(targets) == 14
    ours_opt = create_optimizer(ours_model, lr=lr)
    assert isinstance(ours_opt, Adafactor)

    theirs_losses = [_llama_step(theirs_model, theirs_opt)(ids) for ids in _data()]
    ours_losses = [_llama_step(ours_model, ours_opt, True)(ids) for ids in _data()]

    def curve(losses):
        return [sum(losses[i : i + LOG_EVERY]) / LOG_EVERY for i in range(0, STEPS, LOG_EVERY)]

    theirs, ours = curve(theirs_losses), curve(ours_losses)
    assert theirs[-1] < 0.8 * theirs[0]  # both actually learned something
    deviations = [abs(o - t) / t for o, t in zip(ours[WARMUP // LOG_EVERY :], theirs[WARMUP // LOG_EVERY :])]
    per_step = [abs(o - t) / t for o, t in zip(ours_losses[WARMUP:], theirs_losses[WARMUP:])]
    print(f"adafactor oracle: max window deviation {max(deviations):.4f}, max per-step {max(per_step):.4f}")
    assert max(deviations) < 0.02, f"max relative loss deviation {max(deviations):.4f}; ours {ours} theirs {theirs}"


def test_factor_state_is_a_tenth_of_galore_adamw(tiny_llama):
    """The optimizer state of the factors (bytes of their state tensors) after a refresh and some steps."""

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

    adafactor, adamw = factor_state_bytes("galore_adafactor"), factor_state_bytes("galore_adamw")
    print(f"factor state bytes: adafactor {adafactor}, adamw {adamw}, ratio {adafactor / adamw:.4f}")
    assert adafactor <= 0.1 * adamw


# ---------------------------------------------------------------------- the change of basis
def _stepped(shape, beta1=0.9, steps=3):
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = Adafactor([{"params": [p], "galore": True}], lr=1e-2, beta1=beta1, scale_parameter=False, relative_step=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
    return p, opt


def _rotation(r, seed=1):
    q, _ = torch.linalg.qr(torch.randn(r, r, generator=torch.Generator().manual_seed(seed)))
    return q


def test_change_basis_keep_reset_project():
    p, opt = _stepped((6, 4))
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
    change_basis(opt, p, policy="keep")
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items() if isinstance(v, torch.Tensor))

    t = _rotation(4) * 0.9  # a transport of subspaces that do not coincide: loses mass
    change_basis(opt, p, right=t, policy="project")
    state = opt.state[p]
    assert state["step"] == before["step"]
    torch.testing.assert_close(state["exp_avg"], before["exp_avg"] @ t)  # the momentum: exactly
    # The factored second moment: Adam's SQUARED rule on the matrix the factors stand for, refactored; the new
    # factors reconstruct the transported matrix exactly (it stays rank one).
    moved = _second_moment(before["exp_avg_sq_row"], before["exp_avg_sq_col"]) @ t.square()
    torch.testing.assert_close(_second_moment(state["exp_avg_sq_row"], state["exp_avg_sq_col"]), moved)
    torch.testing.assert_close(state["exp_avg_sq_col"], before["exp_avg_sq_col"] @ t.square())

    left = _rotation(6, seed=2)
    change_basis(opt, p, left=left, policy="project")
    assert opt.state[p]["exp_avg_sq_row"].shape == (6,)
    torch.testing.assert_close(
        _second_moment(opt.state[p]["exp_avg_sq_row"], opt.state[p]["exp_avg_sq_col"]),
        left.square().mT @ moved,
    )

    change_basis(opt, p, policy="reset")
    assert p not in opt.state or not opt.state[p]


def test_change_basis_per_expert():
    p, opt = _stepped((3, 5, 4))
    before = {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    mask = torch.tensor([True, False, True])
    change_basis(opt, p, policy="reset", experts=mask)
    for key, value in before.items():
        assert not opt.state[p][key][0].any() and not opt.state[p][key][2].any()
        assert torch.equal(opt.state[p][key][1], value[1])
    p, opt = _stepped((3, 5, 4))
    before = {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    t = torch.stack([_rotation(4, seed=s) for s in range(3)])
    t[1] = torch.eye(4)
    change_basis(opt, p, right=t, policy="project", experts=mask)
    torch.testing.assert_close(opt.state[p]["exp_avg"], before["exp_avg"] @ t)
    moved = _second_moment(before["exp_avg_sq_row"], before["exp_avg_sq_col"]) @ t.square()
    torch.testing.assert_close(_second_moment(opt.state[p]["exp_avg_sq_row"], opt.state[p]["exp_avg_sq_col"]), moved)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq_col"][1], before["exp_avg_sq_col"][1])


@pytest.mark.parametrize("policy", ["keep", "reset", "project"])
def test_refresh_hands_adafactor_the_change(tiny_llama, monkeypatch, policy):
    """The seam: a refresh of a GaLore layer calls Adafactor.change_basis with the policy, and the state
    afterwards is what the rule says (kept, gone, or moved)."""
    model = prepare_model(
        tiny_llama(vocab_size=96),
        GaLoreConfig.preset(
            "galore_adafactor", rank=16, update_proj_gap=3, moment_handling=policy, adafactor_beta1=0.9
        ),
    )
    opt = create_optimizer(model, lr=1e-3)
    calls = []
    original = Adafactor.change_basis

    def spy(self, param, **kwargs):
        before = {k: v.clone() for k, v in self.state.get(param, {}).items() if isinstance(v, torch.Tensor)}
        original(self, param, **kwargs)
        after = {k: v.clone() for k, v in self.state.get(param, {}).items() if isinstance(v, torch.Tensor)}
        calls.append((kwargs["policy"], kwargs.get("right"), kwargs.get("left"), before, after))

    monkeypatch.setattr(Adafactor, "change_basis", spy)
    for ids in _data()[:7]:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        after_step(model, opt)
        opt.zero_grad()
    # Every call has the policy asked for, but a first calibration's, which is 'reset' (the layer's rule).
    assert {c[0] for c in calls} <= {policy, "reset"}
    later = [c for c in calls if c[0] == policy and c[3]]  # refreshes of a factor that had state
    assert later
    for _, right, left, before, after in later:
        if policy == "keep":
            assert all(torch.equal(after[k], v) for k, v in before.items())
        elif policy == "reset":
            assert not after
        else:
            t = right if right is not None else left
            expected = before["exp_avg"] @ right if right is not None else left.mT @ before["exp_avg"]
            assert t is not None
            torch.testing.assert_close(after["exp_avg"], expected)


def test_optimizer_state_round_trip_resumes_exactly(tiny_llama):
    config = GaLoreConfig.preset("galore_adafactor", rank=16, update_proj_gap=4, adafactor_beta1=0.9)
    data = _data()[:12]

    def run(model, opt, batches):
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            after_step(model, opt)
            opt.zero_grad()

    straight = prepare_model(tiny_llama(vocab_size=96), config)
    straight_opt = create_optimizer(straight, lr=1e-3)
    run(straight, straight_opt, data)

    first = prepare_model(tiny_llama(vocab_size=96), config)
    first_opt = create_optimizer(first, lr=1e-3)
    run(first, first_opt, data[:6])
    saved_model, saved_opt = first.state_dict(), first_opt.state_dict()
    import io

    buffer = io.BytesIO()
    torch.save(saved_opt, buffer)
    buffer.seek(0)
    resumed = prepare_model(tiny_llama(vocab_size=96, seed=7), config)
    resumed.load_state_dict(saved_model)
    resumed_opt = create_optimizer(resumed, lr=1e-3)
    resumed_opt.load_state_dict(torch.load(buffer, weights_only=True))
    run(resumed, resumed_opt, data[6:])
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_adamw_is_still_the_default(tiny_llama):
    model = prepare_model(tiny_llama(vocab_size=96), GaLoreConfig(rank=16))
    assert isinstance(create_optimizer(model, lr=1e-3), AdamW)


def test_every_engine_runs_it_and_fsdp1_checkpoints_must_be_sharded(tiny_llama):
    """Adafactor runs under every engine (whole factors, FSDP2's rows, FSDP1's and ZeRO's registered fragments);
    under FSDP1 the Trainer refuses a FULL_STATE_DICT checkpoint (transformers' FSDP1 default) before the first
    step, naming the fix; a ZeRO-3-partitioned factor is accepted when the optimizer is built (ZeRO hands the
    step registered flat partitions); a 1-D flat slice nobody registered is refused, naming what registers."""
    from hf_galore_plugin.integrations.construction import check_training_args

    adafactor = GaLoreConfig.preset("galore_adafactor")

    class ZeRO:
        deepspeed = {"zero_optimization": {"stage": 2}}
        fsdp = None

    class FSDP:
        deepspeed = None
        fsdp = ["full_shard"]

        def __init__(self, **config):
            self.fsdp_config = {"version": 1, **config}  # TrainingArguments strip the fsdp_ prefix of its keys

    class FSDP2:
        deepspeed = None
        fsdp = ["full_shard"]
        fsdp_plugin_args = {"fsdp_version": 2}  # what TrainingArguments resolved (FSDP2 is their default)
        fsdp_config: dict = {}

    check_training_args(ZeRO(), "galore_adafactor", adafactor)
    check_training_args(FSDP(state_dict_type="SHARDED_STATE_DICT"), "galore_adafactor", adafactor)
    with pytest.raises(ValueError, match="FSDP1.*SHARDED_STATE_DICT only.*'FULL_STATE_DICT'.*fsdp_state_dict_type"):
        check_training_args(FSDP(), "galore_adafactor", adafactor)
    check_training_args(FSDP(), "galore_adamw", GaLoreConfig())  # AdamW's state is tensors only
    check_training_args(FSDP2(), "galore_adafactor", adafactor)
    model = prepare_model(tiny_llama(vocab_size=96), GaLoreConfig.preset("galore_adafactor", rank=16))
    factor = galore_layers(model)[0][1].galore_factor
    factor.ds_id, factor.ds_shape = 0, factor.shape  # as ZeRO-3 marks a partitioned parameter
    assert isinstance(create_optimizer(model, lr=1e-3), Adafactor)
    flat = torch.nn.Parameter(torch.zeros(40))
    with pytest.raises(RuntimeError, match="flat partition of shape \\(40,\\).*DeepSpeedGaLoreOptimizer"):
        Adafactor([{"params": [flat], "galore": True}], lr=1e-3, scale_parameter=False, relative_step=False)


# ---------------------------------------------------------------------- FSDP2
@pytest.mark.distributed
@pytest.mark.parametrize(
    "proj_type, moment_handling",
    [
        ("std", "keep"),  # right-basis factors 33 x 4 (17 + 16 rows), left-basis factors 4 x 33 (2 + 2 rows)
        ("full", "keep"),  # two-sided bases
        ("right", "project"),  # the factored moment moved into each new basis: its column mean over all rows
    ],
)
def test_fsdp2_row_shards_sum_the_column_statistics_as_one_process(tmp_path, proj_type, moment_handling):
    """Under FSDP2 (fully_shard) each factor is a DTensor sharded on rows: the row statistics stay on their
    rank, the column statistic, the mean of the row statistic and the update's RMS are summed over the shards,
    so 2 ranks train as one process does within the engines' tolerances (every other parameter, also sharded,
    steps by Adafactor too); rank 0 keeps only its rows of the state."""
    from distributed._launch import assert_matches, engine_and_reference

    single, multi = engine_and_reference(
        tmp_path, "fsdp2", "galore_adafactor", proj_type, BASIS_METHOD="svd", MOMENT_HANDLING=moment_handling
    )
    assert_matches(single, multi)
    # Row statistics (and the other parameters' elementwise ones) sharded, column statistics whole on every rank:
    # rank 0 holds 0.58-0.69 of one process's state values (measured).
    assert multi["state_numel"] < 0.75 * single["state_numel"], (multi["state_numel"], single["state_numel"])


# ---------------------------------------------------------------------- FSDP1
@pytest.mark.distributed
@pytest.mark.parametrize(
    "model, checkpoint",
    [
        ("one_unit", "plain"),  # rank 1 holds none of the first factor, the second is cut inside a row
        ("one_unit", "sharded"),  # FSDP.optim_state_dict, SHARDED_STATE_DICT (accelerate's FSDP1 default)
        ("one_unit", "full"),
        ("blocks", "plain"),  # one unit per Block: rank 0 holds every factor whole, rank 1 none
    ],
)
def test_fsdp1_views_sum_the_row_and_column_statistics_as_one_process(tmp_path, model, checkpoint):
    """Under FSDP1 (use_orig_params=True) every parameter reaches Adafactor as 1-D views of its unit's flat shard,
    cut at any element: the partial row and column sums of the squared gradient and the update's sum of squares
    are all-reduced over the unit, the row and column statistics are whole on every rank holding elements of
    the matrix, so 2 ranks train as one process does within the engines' tolerances (the last layer's 8 x 16
    weight, cut inside a row in one_unit, factored as one process factors it); rank 0 keeps less state than one
    process; and a checkpoint of the optimizer (per rank, or FSDP1's optimizer state dict, whose statistics are
    lists of numbers) resumes bit for bit."""
    from distributed._fsdp1 import assert_fsdp1_trains_as_reference

    # Measured: losses within 1.3e-7 relative, weights within 9e-8 absolute. State: statistics of the matrices
    # whole on rank 0, elementwise ones sharded: measured 0.69 (one_unit), 0.96 (blocks: rank 0 holds the factors
    # and biases of every Block, rank 1 only the last layer's half).
    bound = 0.8 if model == "one_unit" else 1.0
    assert_fsdp1_trains_as_reference(tmp_path, "galore_adafactor", model, checkpoint, "single", bound)


def _moe_run(tmp_path, engine: str, **env: str) -> dict:
    """tests/distributed/moe_engines.py (a tiny Qwen3-MoE with GaLore expert stacks, PAPER_REFRESH) under
    `engine`: in one process for 'single', else on 2 ranks."""
    from distributed._launch import SCRIPT, run_one_process, run_two_ranks

    run = run_one_process if engine == "single" else run_two_ranks
    out = tmp_path / f"{engine}.pt"
    result = run(out, script=SCRIPT.with_name("moe_engines.py"), ENGINE=engine, SCHEDULE="paper", **env)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=True)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "moment_handling, proj_type, sparse",
    [
        ("keep", "std", False),
        ("project", "right", True),  # 7 experts cut 4 + 3, some without tokens; the state moved per local expert
    ],
)
def test_fsdp2_expert_stacks_keep_their_statistics_on_their_rank_as_one_process(
    tmp_path, moment_handling, proj_type, sparse
):
    """FSDP2 shards an expert stack (E x m x r factors) on its expert dimension: each rank holds whole matrices,
    whose row and column statistics are its own (only the update's RMS sums over the shards), and the 2-rank run
    matches one process as the AdamW runs of tests/test_experts.py do."""
    from test_experts import _assert_moe_runs_match

    env = dict(PRESET="galore_adafactor", MOMENT_HANDLING=moment_handling, PROJ_TYPE=proj_type,
               SPARSE="1" if sparse else "0")  # fmt: skip
    _assert_moe_runs_match(_moe_run(tmp_path, "fsdp2", **env), _moe_run(tmp_path, "single", **env), sparse=sparse)
