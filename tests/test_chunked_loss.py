"""The chunked linear cross-entropy (hf_galore_plugin.loss) against the model's own loss, torch's
cross_entropy and the Trainer's LabelSmoother, its peak memory, and its installation on a model."""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import RANK_ARGS, logged_losses, token_data, training_args, use_torch_twins
from hf_galore_plugin import GaLoreConfig, loss, merge_and_unload, prepare_model
from hf_galore_plugin.loss import (
    chunked_loss_settings,
    disable_chunked_loss,
    enable_chunked_loss,
    linear_cross_entropy,
)
from hf_galore_plugin.plan.tracker import LiveBytes

pytest.importorskip("transformers")

VOCAB = 32000  # the setting: a tiny Llama with a 32k vocabulary
# fp32: the chunked sums and the plain reduction add the same fp32 terms in another order; at 48 tokens and
# losses ~10 the difference is a few ulps (measured: 2e-6 on the loss, 4e-7 on gradients).
FP32_TOL = 1e-5


def _llama(tiny_llama, **overrides):
    return tiny_llama(**{"vocab_size": VOCAB, "max_position_embeddings": 128, **overrides}).train()


def _batch(seed=2, batch=2, length=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    labels[1, -3:] = -100  # padding
    return ids, labels


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    worst = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    assert worst <= tol, worst


@pytest.mark.parametrize("chunk", [1, 7, 46, 1000])  # one token; not dividing 46 rows; one chunk; larger than N
def test_loss_and_gradients_equal_the_models_own(tiny_llama, chunk):
    # Oracle: the model's own forward (transformers' ForCausalLMLoss on the full logits), masked labels included.
    reference = _llama(tiny_llama)
    chunked = enable_chunked_loss(copy.deepcopy(reference), chunk_tokens=chunk)
    ids, labels = _batch()
    want = reference(input_ids=ids, labels=labels)
    want.loss.backward()
    got = chunked(input_ids=ids, labels=labels)
    got.loss.backward()
    assert got.logits is None
    assert abs(got.loss.item() - want.loss.item()) <= FP32_TOL
    _assert_close(_grads(chunked), _grads(reference), FP32_TOL)


def test_a_tied_head_sums_both_gradients_of_the_shared_weight(tiny_llama):
    # tie_word_embeddings=True (small Llama 3.2 / Qwen 2.5 models): the head's weight is the embedding's; its
    # gradient is the sum of the embedding's and the head's, as in the model's own backward.
    reference = _llama(tiny_llama, tie_word_embeddings=True)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    chunked = enable_chunked_loss(copy.deepcopy(reference), chunk_tokens=13)
    ids, labels = _batch()
    reference(input_ids=ids, labels=labels).loss.backward()
    chunked(input_ids=ids, labels=labels).loss.backward()
    _assert_close(_grads(chunked), _grads(reference), FP32_TOL)


def test_num_items_in_batch_and_shift_labels_reduce_as_transformers_does(tiny_llama):
    # Oracle: the model's own loss with the same keyword arguments (the Trainer passes num_items_in_batch under
    # gradient accumulation; sequence-parallel collators pass shift_labels).
    reference = _llama(tiny_llama)
    chunked = enable_chunked_loss(copy.deepcopy(reference), chunk_tokens=5)
    ids, labels = _batch()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    for kwargs in ({"num_items_in_batch": torch.tensor(100)}, {"shift_labels": shifted, "num_items_in_batch": 77}):
        reference.zero_grad()
        chunked.zero_grad()
        want = reference(input_ids=ids, labels=labels, **kwargs)
        want.loss.backward()
        got = chunked(input_ids=ids, labels=labels, **kwargs)
        got.loss.backward()
        assert abs(got.loss.item() - want.loss.item()) <= FP32_TOL, kwargs
        _assert_close(_grads(chunked), _grads(reference), FP32_TOL)


@pytest.mark.parametrize("num_items", [None, 60])
def test_label_smoothing_equals_the_trainers_label_smoother(tiny_llama, num_items):
    # Two oracles: transformers' LabelSmoother on the model's full logits (what the Trainer computes with
    # label_smoothing_factor) and torch's cross_entropy(label_smoothing=...).
    from transformers.trainer_pt_utils import LabelSmoother

    reference = _llama(tiny_llama)
    chunked = enable_chunked_loss(copy.deepcopy(reference), chunk_tokens=9, label_smoothing=0.1)
    ids, labels = _batch()
    outputs = reference(input_ids=ids)
    want = LabelSmoother(epsilon=0.1)(outputs, labels, shift_labels=True, num_items_in_batch=num_items)
    want.backward()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    torch_loss = F.cross_entropy(outputs.logits.detach().flatten(0, 1), shifted.flatten(), label_smoothing=0.1,
                                 reduction="mean" if num_items is None else "sum")  # fmt: skip
    torch_loss = torch_loss if num_items is None else torch_loss / num_items
    kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
    got = chunked(input_ids=ids, labels=labels, **kwargs)
    got.loss.backward()
    assert abs(got.loss.item() - want.item()) <= FP32_TOL
    assert abs(got.loss.item() - torch_loss.item()) <= FP32_TOL
    _assert_close(_grads(chunked), _grads(reference), FP32_TOL)


@pytest.mark.parametrize("preset", ["galore_adamw", "qgalore_adamw_8bit"])
def test_a_galore_head_gets_the_gradients_and_the_refresh_record_of_the_unchunked_loss(tiny_llama, preset, monkeypatch):
    # The head is a GaLoreLinear (target_modules selects lm_head; NF4 W0 and an INT4 basis under Q-GaLore):
    # the chunked loss goes through the module. Oracle: the same prepared model without the chunked loss.
    # Step 0 is every layer's calibration under refresh_schedule='aligned' (the default staggered schedule
    # calibrates the head on its own phase step): the backward records the head's gradient sketch (the
    # default basis_method), which the chunked loss must record too (summed over chunks), and the factor
    # gradient of a basis-less step is zero; so a first basis is set and the factor made nonzero, then a
    # second step compares the factor gradients.
    # The quantization kernels run as their torch twins: under Triton's interpreter the NF4 head's dequantization
    # (twice per chunk) takes minutes, and the kernels have tests of their own.
    use_torch_twins(monkeypatch)
    base = _llama(tiny_llama)
    config = GaLoreConfig.preset(preset, rank=8, target_modules=["lm_head", "q_proj"], weight_storage="nf4"
                                 if preset == "qgalore_adamw_8bit" else "as_loaded",
                                 refresh_schedule="aligned")  # fmt: skip
    reference = prepare_model(copy.deepcopy(base), config)
    chunked = prepare_model(copy.deepcopy(base), config.replace(chunked_loss=True, chunked_loss_tokens=11))
    assert type(chunked.lm_head).__name__ == "GaLoreLinear"
    ids, labels = _batch()
    for model in (reference, chunked):
        model(input_ids=ids, labels=labels).loss.backward()
    want, got = reference.lm_head._pending_grad, chunked.lm_head._pending_grad
    assert isinstance(want, dict) and want.keys() == got.keys() == {"right"}
    for side in want:
        assert (got[side] - want[side]).abs().max().item() <= FP32_TOL * want[side].abs().max().item()
    torch.manual_seed(3)
    basis = torch.linalg.qr(torch.randn(64, 8))[0]
    factor = torch.randn_like(reference.lm_head.galore_factor) * 0.1
    for model in (reference, chunked):
        model.zero_grad()
        model.lm_head._pending_grad = None
        with torch.no_grad():
            model.lm_head._set_basis("right", basis)
            model.lm_head.galore_factor.copy_(factor)
        model(input_ids=ids, labels=labels).loss.backward()
    _assert_close(_grads(chunked), _grads(reference), FP32_TOL)
    assert chunked.lm_head.galore_factor.grad.abs().max() > 0


def test_bf16_gradients_stay_within_bf16_rounding_of_the_unchunked(tiny_llama):
    # bf16: both paths round the head's matmuls to bf16; the chunked weight gradient is rounded once per chunk
    # (addmm_ into a bf16 buffer), the plain one once. Bound: a few bf16 ulps (2^-8 relative) of each tensor's
    # largest value.
    reference = _llama(tiny_llama).to(torch.bfloat16)
    chunked = enable_chunked_loss(copy.deepcopy(reference), chunk_tokens=8)
    ids, labels = _batch()
    want = reference(input_ids=ids, labels=labels)
    want.loss.backward()
    got = chunked(input_ids=ids, labels=labels)
    got.loss.backward()
    assert abs(got.loss.item() - want.loss.item()) <= 2**-7 * want.loss.item()
    want_grads, got_grads = _grads(reference), _grads(chunked)
    for name, g in want_grads.items():
        assert (got_grads[name].float() - g.float()).abs().max() <= 4 * 2**-8 * g.float().abs().max(), name


def _step_peak(run, inputs) -> tuple[int, int]:
    """(peak, live at the start) in bytes of `run()` measured by the planner's live-storage tracker; `inputs`
    (made before it) are counted from the start (the tracker counts a storage from the first op that sees it)."""
    with LiveBytes() as tracker:
        for tensor in inputs:
            tracker.track(tensor)
        start = tracker.total
        run()
        return tracker.peak, start


def test_peak_is_at_most_three_chunks_of_fp32_logits_above_the_irreducible_bytes():
    # Oracle: arithmetic. A loss step must hold its inputs (hidden states, head weight) and produce their
    # gradients (N x H, V x H); the chunked loss may add at most 3 x chunk x V x 4 bytes on top (the issue's
    # bound). The plain loss (full fp32 logits, log-softmax, their gradient) exceeds it: the test tells them apart.
    tokens, hidden_size, chunk = 512, 64, 32
    torch.manual_seed(0)
    head = nn.Linear(hidden_size, VOCAB, bias=False)
    targets = torch.randint(0, VOCAB, (tokens,))
    bound = 3 * chunk * VOCAB * 4

    def measure(loss_fn) -> int:
        hidden = torch.randn(tokens, hidden_size, requires_grad=True)
        head.weight.grad = None

        def run():
            loss_fn(hidden).backward()

        peak, start = _step_peak(run, [hidden, targets, head.weight])
        outputs = hidden.numel() * 4 + head.weight.numel() * 4  # hidden.grad, head.weight.grad
        return peak - start - outputs

    chunked = measure(lambda h: linear_cross_entropy(h, head, targets, chunk_tokens=chunk))
    plain = measure(lambda h: F.cross_entropy(head(h).float(), targets))
    assert chunked <= bound, (chunked, bound)
    assert plain > bound


def test_model_step_peak_is_at_most_three_chunks_of_logits_above_the_models_own(tiny_llama):
    # The same bound on a whole training step of the tiny Llama (seq 256, batch 2, 32k vocabulary). The model's
    # own bytes: a step whose loss needs no logits (the final hidden states' mean square) with the head's weight
    # gradient allocated, i.e. parameters, activations and every gradient. The chunked step may add at most
    # 3 x chunk x V x 4 bytes (measured: 0.59 chunk at 64 tokens, 0.90 at 256); the model's own loss far more.
    model = _llama(tiny_llama, max_position_embeddings=512)
    ids = torch.randint(0, VOCAB, (2, 256), generator=torch.Generator().manual_seed(0))
    chunk = 64

    def peak(run) -> int:
        model.zero_grad(set_to_none=True)
        return _step_peak(run, [ids, *model.parameters()])[0]

    def logit_free():
        model.lm_head.weight.grad = torch.zeros_like(model.lm_head.weight)
        model.model(input_ids=ids).last_hidden_state.square().mean().backward()

    def training_step():
        model(input_ids=ids, labels=ids).loss.backward()

    own = peak(logit_free)
    chunked = peak(enable_chunked_loss(model, chunk_tokens=chunk) and training_step)
    plain = peak(disable_chunked_loss(model) and training_step)
    bound = 3 * chunk * VOCAB * 4
    assert chunked - own <= bound, (chunked - own, bound)
    assert plain - own > 2 * bound


def test_calls_without_labels_or_without_autograd_are_the_models_own(tiny_llama):
    model = enable_chunked_loss(_llama(tiny_llama), chunk_tokens=4)
    ids, labels = _batch()
    assert model(input_ids=ids).logits.shape == (2, 24, VOCAB)
    with torch.no_grad():
        evaluated = model(input_ids=ids, labels=labels)
    assert evaluated.logits.shape == (2, 24, VOCAB) and evaluated.loss is not None
    assert model(input_ids=ids, labels=labels, return_dict=False)[0].ndim == 0


def test_enable_disable_and_prepare_model_round_trip(tiny_llama):
    model = _llama(tiny_llama)
    plain_forward = model.forward
    enable_chunked_loss(model, chunk_tokens=16)
    assert chunked_loss_settings(model) == {"chunk_tokens": 16, "label_smoothing": 0.0}
    import inspect

    assert inspect.signature(model.forward) == inspect.signature(plain_forward)  # what the Trainer inspects
    disable_chunked_loss(model)
    assert chunked_loss_settings(model) is None and "forward" not in model.__dict__
    prepare_model(model, GaLoreConfig(rank=8, chunked_loss=True))
    assert chunked_loss_settings(model) == {"chunk_tokens": None, "label_smoothing": 0.0}
    merge_and_unload(model)
    assert chunked_loss_settings(model) is None


def test_models_whose_logits_are_not_the_heads_output_are_refused(tiny_llama):
    model = _llama(tiny_llama)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30\.0.*leave chunked_loss off"):
        enable_chunked_loss(model)
    with pytest.raises(ValueError, match=r"final_logit_softcapping"):
        prepare_model(model, GaLoreConfig(rank=8, chunked_loss=True))
    assert not any(type(m).__name__ == "GaLoreLinear" for m in model.modules())  # refused before replacing


def test_bad_settings_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"chunk_tokens=0 is invalid: use a positive number"):
        linear_cross_entropy(torch.zeros(2, 4), nn.Linear(4, 8), torch.zeros(2, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match=r"label_smoothing=1\.0 is invalid"):
        linear_cross_entropy(torch.zeros(2, 4), nn.Linear(4, 8), torch.zeros(2, dtype=torch.long), label_smoothing=1.0)
    with pytest.raises(ValueError, match=r"chunked_loss_tokens=64 is invalid: it sizes the chunked loss only"):
        GaLoreConfig(chunked_loss_tokens=64)
    with pytest.raises(ValueError, match=r"do not align"):
        linear_cross_entropy(torch.zeros(2, 3, 4), nn.Linear(4, 8), torch.zeros(2, 4, dtype=torch.long))


# ---------------------------------------------------------------------- batches with nothing to predict
NOTHING_TO_PREDICT = "no token to predict"


@pytest.fixture
def fresh_watch(monkeypatch):
    """The once-per-process warning's state, new for this test (another test may have warned already)."""
    watch = loss._NothingToPredictWatch()
    monkeypatch.setattr(loss, "_NOTHING_TO_PREDICT", watch)
    return watch


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == loss.__name__ and r.levelno == logging.WARNING]


def _assert_zero_and_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert torch.isfinite(got[name]).all(), name
        assert torch.equal(got[name], g), name
        assert not g.any(), name  # the oracle's own gradients are zero: nothing to predict, nothing to learn


@pytest.mark.parametrize(
    ("length", "kwargs", "stock_is_nan"),
    [
        (24, {}, True),  # a mean over no tokens: 0 / 0
        (24, {"num_items_in_batch": torch.tensor(0)}, True),  # the Trainer's count for such a batch
        (24, {"num_items_in_batch": 0}, True),
        (24, {"num_items_in_batch": torch.tensor(30)}, False),  # other micro-batches of the step have targets
        (1, {}, True),  # a sequence of length 1: its one label is shifted out
    ],
    ids=["mean", "count-tensor-0", "count-int-0", "count-30", "length-1"],
)
def test_a_batch_with_nothing_to_predict_has_the_stock_loss_and_zero_gradients(
    tiny_llama, fresh_watch, length, kwargs, stock_is_nan
):
    # Oracle: the model's own loss (transformers' ForCausalLMLoss): NaN or 0 as its loss, exactly zero gradients.
    # The chunked loss gave NaN gradients here (0 * 1/0), which made every weight NaN at the optimizer step.
    reference = _llama(tiny_llama)
    chunked = enable_chunked_loss(copy.deepcopy(reference), chunk_tokens=7)
    ids = _batch(length=length)[0]
    labels = torch.full_like(ids, -100) if length > 1 else ids
    want = reference(input_ids=ids, labels=labels, **kwargs)
    want.loss.backward()
    got = chunked(input_ids=ids, labels=labels, **kwargs)
    got.loss.backward()
    assert bool(torch.isnan(want.loss)) == stock_is_nan
    torch.testing.assert_close(got.loss, want.loss, equal_nan=True, rtol=0, atol=0)
    _assert_zero_and_equal(_grads(chunked), _grads(reference))


def test_a_galore_head_with_nothing_to_predict_gets_zero_gradients_and_a_finite_record(tiny_llama, fresh_watch):
    # The module path (the head's own backward runs inside the loss's forward, and records the refresh input):
    # oracle, the same prepared model with the model's own loss. Step 0 calibrates every layer ('aligned').
    base = _llama(tiny_llama)
    config = GaLoreConfig(rank=8, target_modules=["lm_head", "q_proj"], refresh_schedule="aligned")
    reference = prepare_model(copy.deepcopy(base), config)
    chunked = prepare_model(copy.deepcopy(base), config.replace(chunked_loss=True, chunked_loss_tokens=11))
    ids = _batch()[0]
    labels = torch.full_like(ids, -100)
    for model in (reference, chunked):
        model(input_ids=ids, labels=labels).loss.backward()
    _assert_zero_and_equal(_grads(chunked), _grads(reference))
    want, got = reference.lm_head._pending_grad, chunked.lm_head._pending_grad
    assert isinstance(want, dict) and want.keys() == got.keys()
    for side in want:
        assert torch.isfinite(got[side]).all(), side
        assert torch.equal(got[side], want[side]), side


@pytest.mark.parametrize("count_items", [False, True], ids=["mean-per-micro-batch", "num_items_in_batch"])
def test_accumulating_a_masked_and_an_unmasked_micro_batch_equals_the_stock_gradients(
    tiny_llama, fresh_watch, count_items
):
    # Gradient accumulation over two micro-batches, the first with nothing to predict, as the Trainer runs it:
    # each micro-batch's mean loss divided by the number of micro-batches (a model without loss kwargs), or
    # every loss divided by the step's target count (num_items_in_batch). Oracle: the model's own loss.
    reference = _llama(tiny_llama)
    chunked = enable_chunked_loss(copy.deepcopy(reference), chunk_tokens=7)
    ids, labels = _batch()
    micro_batches = [(ids.flip(0), torch.full_like(labels, -100)), (ids, labels)]
    count = sum(int((F.pad(lab, (0, 1), value=-100)[..., 1:] != -100).sum()) for _, lab in micro_batches)
    for model in (reference, chunked):
        for micro_ids, micro_labels in micro_batches:
            if count_items:
                step_loss = model(input_ids=micro_ids, labels=micro_labels, num_items_in_batch=count).loss
            else:
                step_loss = model(input_ids=micro_ids, labels=micro_labels).loss / len(micro_batches)
            step_loss.backward()
    got = _grads(chunked)
    assert all(torch.isfinite(g).all() for g in got.values())
    _assert_close(got, _grads(reference), FP32_TOL)


def test_nothing_to_predict_is_logged_once_per_process(fresh_watch, caplog):
    head = nn.Linear(8, 16)
    hidden = torch.randn(6, 8, requires_grad=True)
    masked = torch.full((6,), -100)
    kept = torch.tensor([1, -100, 3, 4, -100, 15])
    with caplog.at_level(logging.WARNING, logger=loss.__name__):
        linear_cross_entropy(hidden, head, kept).backward()
        assert _warnings(caplog) == []  # a batch with a target is not reported
        for _ in range(3):
            linear_cross_entropy(hidden, head, masked).backward()
    (message,) = _warnings(caplog)
    assert NOTHING_TO_PREDICT in message and "ignore_index=-100" in message


def test_checks_of_the_targets_make_no_dispatched_device_read(tiny_llama, fresh_watch):
    # The range check and the nothing-to-predict watch read host memory only (CPU targets, pinned copies):
    # no aten op that reads a tensor's value to the host (what is a device sync on a GPU) runs in a step.
    sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from step_overhead import OpCount

    model = enable_chunked_loss(_llama(tiny_llama), chunk_tokens=7)
    ids, labels = _batch()
    with OpCount() as count:
        model(input_ids=ids, labels=labels).loss.backward()
        model(input_ids=ids, labels=torch.full_like(labels, -100)).loss.backward()
    assert count.syncs == 0, count.names
    assert fresh_watch.warned  # the watch did run, and saw the second batch


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -5])
def test_label_ids_outside_the_vocabulary_are_refused_naming_the_labels(tiny_llama, bad):
    # Oracle: the model's own loss refuses the same labels (torch's "Target ... is out of bounds", which names
    # neither the labels nor the fix).
    model = _llama(tiny_llama)
    ids, labels = _batch()
    labels[1, 4] = bad
    with pytest.raises(IndexError, match="out of bounds"):
        model(input_ids=ids, labels=labels)
    enable_chunked_loss(model, chunk_tokens=7)
    pattern = rf"labels hold ids outside .* \[0, {VOCAB}\): {bad} at 1 positions.*ignore_index=-100"
    with pytest.raises(ValueError, match=pattern):
        model(input_ids=ids, labels=labels)
    head = nn.Linear(8, VOCAB)
    with pytest.raises(ValueError, match=rf"labels hold ids .*: {bad} at 2 positions.*resize_token_embeddings"):
        linear_cross_entropy(torch.randn(4, 8), head, torch.tensor([bad, 3, -100, bad]))


# ---------------------------------------------------------------------- the Trainer
def _trainer(tiny_llama, tmp_path, optim_args, **overrides):
    from transformers import Trainer

    model = tiny_llama().train()
    args = training_args(tmp_path, optim_args=optim_args, max_steps=3, **overrides)
    return Trainer(model=model, args=args, train_dataset=token_data(12))


def test_trainer_label_smoothing_moves_into_the_chunked_loss(tiny_llama, tmp_path):
    # Oracle: the same run with the Trainer's own LabelSmoother on full logits. Equal per-step losses (fp32; the
    # chunked and plain gradients differ by fp32 rounding, which three Adam steps keep at ~1e-6).
    plain = _trainer(tiny_llama, tmp_path / "plain", RANK_ARGS, label_smoothing_factor=0.1)
    chunked = _trainer(tiny_llama, tmp_path / "chunked", RANK_ARGS + ",chunked_loss=true,chunked_loss_tokens=8",
                       label_smoothing_factor=0.1)  # fmt: skip
    assert plain.label_smoother is not None and chunked.label_smoother is None
    assert chunked_loss_settings(chunked.model) == {"chunk_tokens": 8, "label_smoothing": 0.1}
    plain.train()
    chunked.train()
    want, got = logged_losses(plain), logged_losses(chunked)
    assert want.keys() == got.keys() == {1, 2, 3}
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-4, (step, got[step], want[step])


def test_trainer_steps_on_batches_with_nothing_to_predict_as_with_the_models_own_loss(
    tiny_llama, tmp_path, fresh_watch, caplog
):
    # Six steps of one row each, two rows with every label -100 (a prompt longer than max_length in SFT): the
    # Trainer passes num_items_in_batch=0 for those steps. Oracle: the same run with the model's own loss, whose
    # zero gradients leave the weights finite (the chunked loss's NaN gradients made every weight NaN). Equal
    # weights within fp32 rounding carried through six Adam steps: Adam's normalisation turns last-bit
    # differences of the gradient (another summation order) into visible ones where the second moment is tiny;
    # measured 1.2e-7 to 1.9e-5 (by the staggered phases and the layers' scales), a fiftieth of one Adam step
    # at lr 1e-3; the bound is a tenth of one step, far below a NaN or a missed update.
    from transformers import Trainer

    data = token_data(6)
    for row in (1, 4):
        data[row] = {"input_ids": data[row]["input_ids"], "labels": torch.full_like(data[row]["labels"], -100)}
    trained = {}
    with caplog.at_level(logging.WARNING, logger=loss.__name__):
        for name, extra in (("plain", ""), ("chunked", ",chunked_loss=true,chunked_loss_tokens=5")):
            args = training_args(tmp_path / name, optim_args=RANK_ARGS + extra, max_steps=6,
                                 per_device_train_batch_size=1)  # fmt: skip
            trainer = Trainer(model=tiny_llama().train(), args=args, train_dataset=data)
            trainer.train()
            trained[name] = trainer
    plain, chunked = trained["plain"], trained["chunked"]
    assert chunked_loss_settings(chunked.model) is not None
    want = dict(plain.model.named_parameters())
    for name, weight in chunked.model.named_parameters():
        assert torch.isfinite(weight).all(), name
        assert (weight - want[name]).abs().max() <= 1e-4, name
    want_losses, got_losses = logged_losses(plain), logged_losses(chunked)
    assert want_losses.keys() == got_losses.keys() == set(range(1, 7))
    for step in want_losses:
        assert abs(got_losses[step] - want_losses[step]) <= 1e-4, (step, got_losses[step], want_losses[step])
    (message,) = _warnings(caplog)  # two such batches, one warning
    assert NOTHING_TO_PREDICT in message


@pytest.mark.triton  # may import Liger's kernels: under the interpreter (conftest), as the oracle test below
def test_trainer_refuses_liger_fused_cross_entropy_with_a_galore_head(tiny_llama, tmp_path):
    # Liger's fused linear cross-entropy reads lm_head.weight: with a GaLore head that is W0 without the factor.
    with pytest.raises(ValueError, match=r"use_liger_kernel=True .*lm_head\.weight.*fused_linear_cross_entropy"):
        _trainer(tiny_llama, tmp_path, RANK_ARGS + ",target_modules=lm_head+q_proj", use_liger_kernel=True)
    # With Liger's fused loss off, the plugin's chunked loss serves the GaLore head.
    trainer = _trainer(tiny_llama, tmp_path, RANK_ARGS + ",target_modules=lm_head+q_proj,chunked_loss=true",
                       use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": False})  # fmt: skip
    assert chunked_loss_settings(trainer.model) is not None


@pytest.mark.triton  # may import Liger's kernels: under the interpreter (conftest), as the oracle test below
def test_trainer_leaves_a_plain_head_to_liger(tiny_llama, tmp_path):
    trainer = _trainer(tiny_llama, tmp_path, RANK_ARGS + ",chunked_loss=true", use_liger_kernel=True)
    assert chunked_loss_settings(trainer.model) is None


# ---------------------------------------------------------------------- the planner
def test_planner_traces_the_chunked_loss_as_a_real_cpu_step_measures_it():
    # Oracle: the same steps on real tensors, measured by the same accounting (tests/test_plan.py's rule: within
    # 5%). The chunked plan must also be below the plain one by at least two fp32 copies of the N x V logits
    # (measured: 38.0 MB -> 17.3 MB; the plain loss holds the fp32 logits, their log-softmax and its gradient).
    from transformers import LlamaConfig

    from hf_galore_plugin.plan.trace import Settings, trace_method

    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=8000, tie_word_embeddings=False)  # fmt: skip
    base = dict(seq_len=128, batch_size=2, dtype=torch.float32, gradient_checkpointing=True, device="cpu", rank=16,
                lora_rank=8)  # fmt: skip
    chunked = Settings(**base, optim_args={"chunked_loss": True, "chunked_loss_tokens": 16})
    plan = trace_method(config, "galore_adamw", chunked)
    real = trace_method(config, "galore_adamw", chunked, fake=False)
    plain = trace_method(config, "galore_adamw", Settings(**base, optim_args={}))
    for which in ("normal", "refresh"):
        planned, measured = getattr(plan, which).peak_bytes, getattr(real, which).peak_bytes
        assert abs(planned - measured) <= 0.05 * measured, which
        assert planned <= getattr(plain, which).peak_bytes - 2 * 256 * 8000 * 4, which
    assert any("chunked loss (16-token chunks)" in note for note in plan.notes)


def test_planner_models_liger_and_refuses_it_with_a_galore_head(tmp_path):
    from hf_galore_plugin.plan import PlanError, estimate
    from hf_galore_plugin.plan.trace import liger_chunk_tokens

    # Liger's rule (liger_kernel.ops.fused_linear_cross_entropy): next power of two of N / ceil(V / H), at most N.
    assert liger_chunk_tokens(2048, 128256, 4096) == 64
    assert liger_chunk_tokens(4096, 152064, 3584) == 128
    assert liger_chunk_tokens(8, 100, 64) == 4
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, '
                      '"num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 8000, '
                      '"tie_word_embeddings": false}')  # fmt: skip
    kw = dict(config=str(config), methods=["adamw_torch"], seq_len=128, rank=16)
    plain, liger = estimate(**kw), estimate(liger=True, **kw)
    saved = plain["methods"]["adamw_torch"]["peak_bytes"] - liger["methods"]["adamw_torch"]["peak_bytes"]
    assert saved >= 128 * 8000 * 4  # at least one fp32 copy of the logits
    with pytest.raises(PlanError, match=r"galore_adamw: use_liger_kernel: .*lm_head\.weight.*chunked_loss=true"):
        estimate(**{**kw, "methods": ["galore_adamw"]}, liger=True, optim_args="target_modules=.*(_proj|lm_head)")


@pytest.mark.triton  # Liger's kernels on CPU: Triton's interpreter (conftest: triton_kernels_on_cpu)
def test_liger_fused_loss_equals_the_chunked_loss_through_galore_decoder_layers(tiny_llama):
    # Third oracle: Liger-Kernel's fused linear cross-entropy (what use_liger_kernel=True swaps in), run by
    # Triton's interpreter on CPU, on a model whose decoder layers are GaLore layers (the plain head left to
    # Liger, as the Trainer integration does). Liger's RMSNorm, RoPE and SwiGLU kernels are left off: under
    # Triton 3.9's interpreter they fail on a float scalar's .to() (a limitation of the interpreter, not of
    # the composition: Liger's SwiGLU module calls the GaLore projections as submodules).
    pytest.importorskip("liger_kernel.transformers")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    base = tiny_llama(vocab_size=512).train()
    config = GaLoreConfig(rank=8)
    ours = prepare_model(copy.deepcopy(base), config.replace(chunked_loss=True, chunked_loss_tokens=5))
    liger = prepare_model(copy.deepcopy(base), config)
    _apply_liger_kernel_to_instance(model=liger, rms_norm=False, rope=False, swiglu=False)
    assert chunked_loss_settings(liger) is None
    ids, labels = _batch()
    ids, labels = ids % 512, torch.where(labels < 0, labels, labels % 512)
    want = liger(input_ids=ids, labels=labels)
    want.loss.backward()
    got = ours(input_ids=ids, labels=labels)
    got.loss.backward()
    assert abs(got.loss.item() - want.loss.item()) <= FP32_TOL
    _assert_close(_grads(ours), _grads(liger), FP32_TOL)
