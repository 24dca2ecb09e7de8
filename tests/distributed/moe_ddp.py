"""Run by tests/test_experts.py: a tiny Qwen3-MoE with GaLore experts (galore_adamw, experts=True) under DDP
on 2 gloo ranks (ENGINE=ddp) or in one process (ENGINE=single), over the same global batch: each rank
takes half of it. Writes the losses and the merged weights of rank 0 to argv[1].

The loss is the mean over tokens of equal-length sequences, so the mean of the two ranks' losses (what
DDP's gradient averaging computes) is the single process's loss. A refresh averages each expert's
recorded gradient over the ranks; an expert counts as routed to when any rank sent it tokens.
"""

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from _teardown import shut_down

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # appended: shadows nothing
from _engines import wrap_for_engine  # noqa: E402
from hf_galore_plugin import GaLoreConfig, after_step, create_optimizer, merged_state_dict, prepare_model  # noqa: E402
from hf_galore_plugin.config import PAPER_REFRESH  # noqa: E402

# Refreshes at steps 0, 3 and 6. The two runs sum in another order, so an SVD may return a singular vector
# with the other sign; with moment_handling='reset' (moments restart at each refresh) the trajectory does
# not depend on the signs (Adam is elementwise: a column's sign flips its factor gradient, moment and
# update together), so the runs stay comparable after a refresh. (With 'keep', the old moments meet the
# flipped column and the runs part: 4e-4 in loss here, the attention layers' bases alike.)
STEPS, GLOBAL_BATCH, SEQ = 8, 4, 16


def build():
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    return prepare_model(
        # The paper's refresh (every layer at the same steps, exact SVD): the refresh counts the test checks.
        model,
        GaLoreConfig(rank=8, expert_rank=4, experts=True, update_proj_gap=3, moment_handling="reset", **PAPER_REFRESH),
    )


def main(out: str) -> None:
    distributed = os.environ["ENGINE"] == "ddp"
    warnings.filterwarnings("error", message=".*written without sync_counters")
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    model = build()
    _, forward = wrap_for_engine(model, "ddp" if distributed else "single")
    optimizer = create_optimizer(model, lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        part = ids.chunk(world)[rank]
        loss = forward(input_ids=part, labels=part).loss
        loss.backward()
        optimizer.step()
        after_step(model, optimizer)
        optimizer.zero_grad()
        total = loss.detach().clone()
        if distributed:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
    weights = {k: v.detach().clone() for k, v in merged_state_dict(model).items()}
    # The experts' own state: the bases of the refresh at step 6, the per-expert refresh counts.
    experts = {k: v.detach().clone() for k, v in model.state_dict().items() if ".experts." in k}
    del forward
    if rank == 0:
        torch.save({"losses": losses, "weights": weights, "experts": experts}, out)
    shut_down()


if __name__ == "__main__":
    main(sys.argv[1])
