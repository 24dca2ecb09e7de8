"""One rank of benchmarks/distributed.py (launched by torchrun): a tiny Llama trained under one engine
with one optimizer, counting what every collective moves.

Counting: every Python-level collective of ``torch.distributed`` (all_reduce, all_gather*,
reduce_scatter*, broadcast, _broadcast_coalesced, ...) is wrapped before any engine is built, so
FSDP1, FSDP2, DeepSpeed and our refresh are all seen; DDP's gradient all-reduce runs in its C++
reducer, so DDP gets its default all-reduce as a Python communication hook (the same reduction).
Bytes are the logical payload of a collective: the reduced tensor (all-reduce), the gathered output
(all-gather) or the input to reduce (reduce-scatter), per rank; ring algorithms send about
2 (world - 1) / world of an all-reduce's payload over the wire. Bytes moved inside ``after_step``
(the basis refresh) are also counted on their own.

Memory per rank: bytes of every distinct tensor storage alive in Python after the optimizer step
(parameters, gradients, optimizer state, the engine's flat buffers and fp32 masters, bases), found
through the garbage collector; plus peak RSS. DDP's C++ gradient buckets are not visible to Python
(they hold the same bytes as the gradients).

Writes one JSON object to argv[1] from rank 0.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from _engines import wrap_for_engine
from _models import build_llama, scaled_shape

ENGINE = os.environ["ENGINE"]  # ddp | fsdp1 | fsdp2 | zero1 | zero2 | zero3
METHOD = os.environ["METHOD"]  # adamw_torch | galore_adamw | galore_adamw_8bit | qgalore_adamw_8bit
BASIS = os.environ.get("BASIS", "svd")
# The measured tables (docs/benchmarks/distributed.md) refresh every layer on the same step, the paper's
# schedule: the bytes of one refresh step are what they count.
SCHEDULE = os.environ.get("REFRESH_SCHEDULE", "aligned")
STEPS, GAP = int(os.environ.get("STEPS", 12)), int(os.environ.get("GAP", 5))
HIDDEN, LAYERS, RANK = (
    int(os.environ.get("HIDDEN", 256)),
    int(os.environ.get("LAYERS", 4)),
    int(os.environ.get("RANK_R", 64)),
)
SEQ, MICRO_BATCH, LR, VOCAB = 64, 4, 1e-3, 1024

# ------------------------------------------------------------------------------------ collective counting
_BYTES = {"step": {}, "refresh": {}}
_PHASE = ["idle"]


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.numel() * local.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


# per collective: the argument that holds the payload (the reduced / gathered / to-be-scattered tensor)
# and the kind it is reported under
_PAYLOAD = {
    "all_reduce": ("tensor", "all_reduce"),
    "all_reduce_coalesced": ("tensors", "all_reduce"),
    "reduce": ("tensor", "all_reduce"),
    "broadcast": ("tensor", "broadcast/other"),
    "_broadcast_coalesced": ("tensors", "broadcast/other"),
    "all_gather": ("tensor_list", "all_gather"),
    "all_gather_into_tensor": ("output_tensor", "all_gather"),
    "_all_gather_base": ("output_tensor", "all_gather"),
    "all_gather_single": ("output_tensor", "all_gather"),
    "all_gather_coalesced": ("output_tensor_lists", "all_gather"),
    "reduce_scatter": ("input_list", "reduce_scatter"),
    "reduce_scatter_tensor": ("input", "reduce_scatter"),
    "_reduce_scatter_base": ("input", "reduce_scatter"),
    "reduce_scatter_single": ("input", "reduce_scatter"),
    "all_to_all_single": ("input", "broadcast/other"),
    "all_to_all": ("input_tensor_list", "broadcast/other"),
}


def _record(kind: str, nbytes: int) -> None:
    if _PHASE[0] == "idle":
        return
    table = _BYTES["refresh" if _PHASE[0] == "refresh" else "step"]
    table[kind] = table.get(kind, 0) + nbytes


def _wrap(name: str) -> None:
    original = getattr(dist, name)
    key, kind = _PAYLOAD[name]

    def counted(*args, **kwargs):
        if name == "_broadcast_coalesced":  # a C++ binding without a signature: (process_group, tensors, ...)
            _record(kind, _nbytes(args[1] if len(args) > 1 else kwargs.get("tensors")))
        else:
            _record(kind, _nbytes(signature.bind_partial(*args, **kwargs).arguments.get(key)))
        return original(*args, **kwargs)

    signature = None if name == "_broadcast_coalesced" else inspect.signature(original)
    setattr(dist, name, counted)
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None and getattr(c10d, name, None) is original:
        setattr(c10d, name, counted)


for _name in _PAYLOAD:
    if hasattr(dist, _name):
        _wrap(_name)


# ------------------------------------------------------------------------------------------- memory
def live_tensor_bytes() -> int:
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.is_meta:
                continue
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            storage = local.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
        except Exception:  # tensors of exotic subclasses without storage
            continue
    return total


# -------------------------------------------------------------------------------------------- model
_DENSE_PARAMETERS = [0]


def build_model() -> nn.Module:
    model = build_llama(scaled_shape(HIDDEN, LAYERS, vocab_size=VOCAB), seed=0, max_position_embeddings=SEQ)
    _DENSE_PARAMETERS[0] = sum(p.numel() for p in model.parameters())
    if METHOD != "adamw_torch":
        import hf_galore_plugin as hgp

        galore_config = hgp.GaLoreConfig.preset(
            METHOD, rank=RANK, update_proj_gap=GAP, basis_method=BASIS, refresh_schedule=SCHEDULE,
            target_modules=None,
        )  # fmt: skip
        model = hgp.prepare_model(model, galore_config)
    return model


def make_optimizer(model: nn.Module):
    if METHOD == "adamw_torch":
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    import hf_galore_plugin as hgp

    return hgp.create_optimizer(model, lr=LR, weight_decay=0.0)


def batches(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
        yield ids


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = build_model()
    galore = METHOD != "adamw_torch"
    step_fn = None

    if ENGINE.startswith("zero"):
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401

        # gloo does not need the shared-memory op that DeepSpeed compiles with g++ on first use
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        config = {
            "train_batch_size": MICRO_BATCH * world,
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(ENGINE[-1])},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=config)
        refresh_optimizer = None
        if galore:
            from hf_galore_plugin.engines.deepspeed import DeepSpeedGaLoreOptimizer

            refresh_optimizer = DeepSpeedGaLoreOptimizer(engine)

        def step_fn(ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss

        optimizer_for_refresh, forward_model = refresh_optimizer, engine
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        # DDP: its default reduction, run from Python so the wrapped dist.all_reduce sees each bucket
        model, forward_model = wrap_for_engine(
            model, ENGINE, block_class=LlamaDecoderLayer, comm_hook=allreduce_hook if ENGINE == "ddp" else None
        )
        optimizer = make_optimizer(model)

        def step_fn(ids):
            loss = forward_model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            return loss

        optimizer_for_refresh = optimizer

    import hf_galore_plugin as hgp

    records = []
    for step, ids in enumerate(batches(rank)):
        dist.barrier()
        _BYTES["step"], _BYTES["refresh"] = {}, {}
        _PHASE[0] = "step"
        start = time.perf_counter()
        step_fn(ids)
        compute_end = time.perf_counter()
        refreshed = False
        if galore:
            _PHASE[0] = "refresh"
            event = hgp.after_step(model, optimizer_for_refresh)
            refreshed = bool(event["refreshed"])
        end = time.perf_counter()
        _PHASE[0] = "idle"
        if step == 1:
            # after a normal optimizer step, gradients not yet released: parameters, gradients, optimizer
            # state and engine buffers are all allocated
            memory_after_step = live_tensor_bytes()
        if not ENGINE.startswith("zero"):
            optimizer.zero_grad(set_to_none=True)
        times = torch.tensor([end - start, end - compute_end])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
        records.append(
            {
                "step": step,
                "refreshed": refreshed,
                "seconds": float(times[0]),
                "refresh_seconds": float(times[1]),
                "step_bytes": dict(_BYTES["step"]),
                "refresh_bytes": dict(_BYTES["refresh"]),
            }
        )

    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    per_rank = torch.tensor([float(memory_after_step), float(peak_rss)])
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, per_rank)
    if rank == 0:
        result = {
            "engine": ENGINE,
            "method": METHOD,
            "basis": BASIS if galore else "",
            "world": world,
            "steps": STEPS,
            "gap": GAP,
            "hidden": HIDDEN,
            "layers": LAYERS,
            "rank": RANK if galore else None,
            "model_parameters": _DENSE_PARAMETERS[0],
            "records": records,
            "live_tensor_bytes_per_rank": [float(g[0]) for g in gathered],
            "peak_rss_bytes_per_rank": [float(g[1]) for g in gathered],
        }
        with open(out, "w") as handle:
            json.dump(result, handle)
    dist.barrier()
    if ENGINE == "ddp":
        del forward_model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # Leave without interpreter finalization: a gloo worker thread releasing a finished work object while
    # the interpreter finalizes aborts the rank after a passing run (pytorch/pytorch#179291; the same
    # teardown as tests/distributed/_teardown.py). The results file is written and closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
