"""Our `galore_adamw` against the upstream galore-torch GaLoreAdamW on a tiny Llama.

What differs by design: galore-torch computes the basis of step t from G_t and uses it at step t;
ours uses it from step t+1 (the refresh happens after the optimizer step, so it works unchanged
under every engine), and step 0 is a calibration step for GaLore layers (they apply weight decay
only). Both only delay the subspace by one step; the loss curves agree to well under 2%.
galore-torch also adds eps after sqrt(v) without bias correction; ours is torch AdamW's form.
"""

from __future__ import annotations

import torch

import galore_torch  # noqa: E402  (the oracle: scripts/env.sh installs it)

from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, galore_layers, prepare_model  # noqa: E402
from hf_galore_plugin.config import PAPER_REFRESH  # noqa: E402

STEPS, LOG_EVERY, WARMUP = 200, 10, 20


def _data():
    # A sparse random Markov chain over 96 tokens: learnable structure, deterministic.
    gen = torch.Generator().manual_seed(1)
    transition = torch.softmax(torch.randn(96, 96, generator=gen) * 3, dim=-1)
    batches = []
    for _ in range(STEPS):
        seq = [torch.randint(0, 96, (8,), generator=gen)]
        for _ in range(31):
            seq.append(torch.multinomial(transition[seq[-1]], 1, generator=gen).squeeze(-1))
        batches.append(torch.stack(seq, dim=1))
    return batches


def _curve(run_step):
    losses = [run_step(ids) for ids in _data()]
    return [sum(losses[i : i + LOG_EVERY]) / LOG_EVERY for i in range(0, STEPS, LOG_EVERY)]


def test_galore_adamw_tracks_galore_torch_within_2_percent(tiny_llama):
    rank, gap, scale, lr = 16, 50, 0.25, 1e-2

    theirs_model = tiny_llama(vocab_size=96, intermediate_size=176)
    targets = [
        m.weight for n, m in theirs_model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    ]
    others = [p for p in theirs_model.parameters() if all(p is not t for t in targets)]
    theirs_opt = galore_torch.GaLoreAdamW(
        [
            {"params": others},
            {"params": targets, "rank": rank, "update_proj_gap": gap, "scale": scale, "proj_type": "std"},
        ],
        lr=lr,
        weight_decay=0.0,
    )

    def their_step(ids):
        loss = theirs_model(input_ids=ids, labels=ids).loss
        loss.backward()
        theirs_opt.step()
        theirs_opt.zero_grad()
        return loss.item()

    ours_model = prepare_model(
        tiny_llama(vocab_size=96, intermediate_size=176),
        # galore-torch's refresh: every layer on the same steps, an exact SVD of the gradient
        GaLoreConfig.preset("galore_adamw", rank=rank, update_proj_gap=gap, scale=scale, **PAPER_REFRESH),
    )
    assert len(galore_layers(ours_model)) == len(targets) == 14
    ours_opt = create_optimizer(ours_model, lr=lr, weight_decay=0.0)

    def our_step(ids):
        loss = ours_model(input_ids=ids, labels=ids).loss
        loss.backward()
        ours_opt.step()
        after_step(ours_model, ours_opt)
        ours_opt.zero_grad()
        return loss.item()

    theirs, ours = _curve(their_step), _curve(our_step)
    assert theirs[-1] < 0.8 * theirs[0]  # both actually learned something
    deviations = [abs(o - t) / t for o, t in zip(ours[WARMUP // LOG_EVERY :], theirs[WARMUP // LOG_EVERY :])]
    assert max(deviations) < 0.02, f"max relative loss deviation {max(deviations):.4f}; ours {ours} theirs {theirs}"
