"""FSDP2 on 2 gloo ranks: hf_galore_plugin.optim.AdamW on DTensor shards against one process, and a DCP
save/load round trip of its state (run by tests/test_optim.py on two ranks, distributed/_launch.py).

Arguments: checkpoint directory, state bits (32 or 8). Rank 0 prints one line `RESULT {json}`.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from _teardown import shut_down

from hf_galore_plugin.optim import AdamW

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # appended: shadows nothing
from _engines import wrap_for_engine  # noqa: E402

checkpoint_dir, state_bits = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
# Row shards over 2 ranks: (75, 96) -> 38 + 37 rows, (40, 75) -> 20 + 20 rows whose 1500 values
# cut 64-value blocks differently from the unsharded run, (1, 40) -> 1 + 0 rows (an empty shard).
# min_8bit_numel=40 puts every tensor but the last bias on 8-bit state.
config = dict(
    lr=1e-2, weight_decay=0.1, state_bits=state_bits, error_feedback=state_bits == 8, min_8bit_numel=40, block_size=64
)


def build(shard):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 75), torch.nn.Linear(75, 40), torch.nn.Linear(40, 1))
    if shard:
        wrap_for_engine(model, "fsdp2", block_class=torch.nn.Linear)
    return model, AdamW(model.parameters(), **config)


def local(v):
    return v.to_local() if hasattr(v, "to_local") else v


reference, reference_opt = build(False)
model, opt = build(True)
g = torch.Generator().manual_seed(1)
batches = [torch.randn(16, 96, generator=g) for _ in range(6)]
snapshot = None
for i, x in enumerate(batches):
    for m, o in ((reference, reference_opt), (model, opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    if i == 2:
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=checkpoint_dir)
        snapshot = [
            {k: local(v).clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
            for p in model.parameters()
        ]
restored_model, restored_opt = build(True)
loaded = get_optimizer_state_dict(restored_model, restored_opt)
dcp.load({"optim": loaded}, checkpoint_id=checkpoint_dir)
set_optimizer_state_dict(restored_model, restored_opt, loaded)
reload_exact = all(
    all(
        torch.equal(local(restored_opt.state[p][k]), v) if torch.is_tensor(v) else restored_opt.state[p][k] == v
        for k, v in saved.items()
    )
    for p, saved in zip(restored_model.parameters(), snapshot)
)
deviation = max(
    ((p.full_tensor() - r.detach()).norm() / r.detach().norm()).item()
    for p, r in zip(model.parameters(), reference.parameters())
)
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({"reload_exact": reload_exact, "deviation": deviation}))
del model, opt, restored_model, restored_opt, reference, reference_opt, loaded
shut_down()
