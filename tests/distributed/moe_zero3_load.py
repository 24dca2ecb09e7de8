"""Run by tests/test_zero3_partitioned_experts.py: ``Trainer`` + galore_adamw with ``experts=true`` on the tiny
pretrained Qwen3-MoE in argv[2], loaded with ``from_pretrained`` after the TrainingArguments.

ENGINE=zero3: ``TrainingArguments(deepspeed=examples/deepspeed/zero3.json, use_cpu=True)`` on 2 gloo ranks, so
``from_pretrained`` partitions the model under ``zero.Init`` (what accelerate's ``zero3_init_flag: true`` does) and
the Trainer prepares the partitioned model (``prepare_zero3_model``). ENGINE=single: the same Trainer run in one
process, no engine (``prepare_model``). Same global batch: 4 sequences per optimizer step, each rank takes half.

Writes to argv[1] (rank 0): the loss of every step, the prepared model's summary line, the names of its GaLore
expert stacks, whether the model arrived partitioned, and the folder ``save_model()`` wrote the merged model to.
"""

import os
import sys
from pathlib import Path

import torch

from _teardown import shut_down

import hf_galore_plugin as hgp
from hf_galore_plugin.engines.deepspeed import is_zero3_partitioned
from hf_galore_plugin.layers.experts import GaLoreExpertStack

ENGINE = os.environ["ENGINE"]
STEPS, GLOBAL_BATCH, SEQ = 8, 4, 16
REPO = Path(__file__).resolve().parents[2]

if ENGINE == "zero3":
    import deepspeed.comm.torch  # noqa: F401  (loads the module patched below)

    # Test-only: the shared-memory comm op is compiled with g++ on first use (~50 s); gloo does not need it.
    # Through sys.modules: the attribute `deepspeed.comm.torch` is the torch package itself.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

from transformers import Qwen3MoeForCausalLM, Trainer, TrainingArguments  # noqa: E402


def token_data(n: int = GLOBAL_BATCH * STEPS) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 128, (n, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def main(out: str, model_dir: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    work = Path(out).parent / f"work_{ENGINE}"
    kwargs: dict = {}
    if ENGINE == "zero3":
        kwargs["deepspeed"] = str(REPO / "examples" / "deepspeed" / "zero3.json")
    # Aligned refresh: every layer refreshes on steps 0, 3 and 6, and under ZeRO, whose parameter groups share
    # one Adam step counter, only the aligned schedule equals one process exactly. Bases by the default
    # sketch: with exact SVD bases (basis_method=svd) two ranks part from one process by 1e-4 relative in the
    # losses after the refresh of step 3, under DDP as under ZeRO-3 (measured), a refresh of this tiny model
    # that fp32 rounding turns; with the sketch they agree within 2e-7. Adam's eps 1e-2: see
    # tests/distributed/moe_engines.py (the factors' gradients are ~1e-3 here).
    args = TrainingArguments(
        output_dir=str(work),
        optim="galore_adamw",
        optim_args="rank=8,expert_rank=4,experts=true,update_proj_gap=3,refresh_schedule=aligned",
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        learning_rate=1e-2,
        adam_epsilon=1e-2,
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **kwargs,
    )  # first: under ZeRO-3 from_pretrained partitions the model
    if ENGINE == "zero3":
        import deepspeed

        # On a GPU accelerate initializes deepspeed.comm; with use_cpu it only sets up torch.distributed,
        # and zero.Init inside from_pretrained would then see a world of 1 and reject the batch sizes.
        deepspeed.init_distributed(dist_backend="gloo")
    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    partitioned_at_load = is_zero3_partitioned(model)
    trainer = Trainer(model=model, args=args, train_dataset=token_data())
    stacks = [name for name, module in model.named_modules() if isinstance(module, GaLoreExpertStack)]
    summary = hgp.state_of(model).report.summary()
    trainer.train()
    final = work / "final"
    trainer.save_model(str(final))
    if int(os.environ.get("RANK", 0)) == 0:
        losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
        result = dict(
            losses=losses, summary=summary, stacks=stacks, partitioned_at_load=partitioned_at_load, final=str(final)
        )
        torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    shut_down()
