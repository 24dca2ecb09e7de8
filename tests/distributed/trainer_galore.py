"""Run by tests/test_distributed_trainer.py: ``Trainer`` + GaLore under an engine, on 2 ranks with the environment
torchrun gives its workers (tests/distributed/_launch.py).

ENGINE=single (one process, no engine), zero1 | zero2 | zero3 (``TrainingArguments(deepspeed=
examples/deepspeed/zeroN.json, use_cpu=True)``, 2 gloo ranks), fsdp2 (``fsdp="full_shard"``,
``fsdp_config={"fsdp_version": 2, ...}`` as examples/accelerate/fsdp2.yaml) or fsdp1 (``fsdp_version: 1``,
``use_orig_params: true`` as examples/accelerate/fsdp1.yaml), both with the test-only patch of
accelerate below. Same global batch everywhere: 8 sequences per optimizer step, gradient accumulation 2.

1. trains STEPS steps from the pretrained tiny Llama in argv[2] (``from_pretrained`` after the
   TrainingArguments: under ZeRO-3 the model arrives partitioned), checkpointing at step SAVE_AT in the
   engine's own format, and checks after every refresh that all ranks hold the same bases;
2. a fresh model and Trainer resume from that checkpoint and train to STEPS;
3. writes to argv[1] (rank 0): both loss trajectories, refresh steps, and both merged models as
   ``save_model()`` wrote them (read back from model.safetensors: plain keys, no plugin needed).
With WITHOUT_GALORE_STATE=1 a third run tries to resume from a copy of the checkpoint without
galore_state.pt: the integration's restore must run on the engine's resume path and refuse it.
"""

import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from _teardown import shut_down

import hf_galore_plugin as hgp
from hf_galore_plugin.checkpoint.state import GALORE_STATE_NAME
from hf_galore_plugin.engines.deepspeed import is_zero3_partitioned

ENGINE = os.environ["ENGINE"]
PRESET = os.environ.get("PRESET", "galore_adamw")
STEPS = int(os.environ.get("STEPS", 24))
SAVE_AT = int(os.environ.get("SAVE_AT", 10))
EXTRA_OPTIM_ARGS = os.environ.get("EXTRA_OPTIM_ARGS", "")  # appended to optim_args, e.g. ",state_bits=32"
GAP = 8  # refreshes after steps 0 (calibration), 8, 16
GLOBAL_BATCH, ACCUMULATION = 8, 2
if "refresh_schedule=aligned" not in EXTRA_OPTIM_ARGS:
    # The staggered phases at one rank's tokens of the 2-rank runs (2 x 16 a forward), in every run: measured,
    # the one-process oracle (4 x 16 a forward) would pack other phases and refresh on other steps. The budget
    # packs the 14 layers' sketches and kept inputs into 2 phases (refreshes after steps 0-1, 8-9, 16-17).
    EXTRA_OPTIM_ARGS += ",refresh_tokens=32,refresh_budget_mb=0.1"
REPO = Path(__file__).resolve().parents[2]

if ENGINE.startswith("zero"):
    import deepspeed.comm.torch  # noqa: F401  (loads the module patched below)

    # Test-only: the shared-memory comm op is compiled with g++ on first use (~50 s); gloo does not need
    # it. Through sys.modules: the attribute `deepspeed.comm.torch` is the torch package itself.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

if ENGINE in ("fsdp1", "fsdp2"):
    # Test-only patch of accelerate: AcceleratorState switches to FSDP only on GPU-type devices, so on a
    # CPU the Trainer would silently train with DDP. Re-labelling the multi-CPU state as FSDP (what it
    # is on a GPU machine) makes accelerate apply fully_shard with the Trainer's fsdp_config, on gloo.
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    _original_init = AcceleratorState.__init__

    def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
        _original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # both shared states: every later AcceleratorState() copies PartialState's type again
            PartialState._shared_state["distributed_type"] = self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = _fsdp_on_cpu

if ENGINE == "fsdp1":
    # Test-only, second patch: accelerate hands FSDP1 device_id=cpu:0 while the CPU modules sit on
    # "cpu", which FSDP1 rejects as inconsistent; on a GPU both are cuda:N.
    from torch.distributed.fsdp import FullyShardedDataParallel

    _fsdp1_init = FullyShardedDataParallel.__init__

    def _fsdp1_on_cpu(self, *args, device_id=None, **kwargs):
        if device_id is not None and torch.device(device_id).type == "cpu":
            device_id = torch.device("cpu")
        _fsdp1_init(self, *args, device_id=device_id, **kwargs)

    FullyShardedDataParallel.__init__ = _fsdp1_on_cpu

    # Test-only, third patch: FSDP1's full state dict with offload_to_cpu=True (what accelerate's
    # get_state_dict asks for) segfaults when the parameters already live on the CPU, for a plain Llama
    # without the plugin too (torch 2.13); on a GPU the offload is what users want.
    import torch.distributed.fsdp as _fsdp

    _FullStateDictConfig = _fsdp.FullStateDictConfig
    _fsdp.FullStateDictConfig = lambda offload_to_cpu=False, rank0_only=False: _FullStateDictConfig(
        offload_to_cpu=False, rank0_only=rank0_only
    )

from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402


class BasisCheck(TrainerCallback):
    """After every step with a refresh (GaLoreCallback runs first): all ranks hold identical bases."""

    def __init__(self) -> None:
        self.refresh_steps: list[int] = []
        self._seen = 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        layers = hgp.galore_layers(model)
        refreshes = sum(int(layer.galore_num_refreshes) for _, layer in layers)
        if refreshes == self._seen:
            return
        self._seen = refreshes
        self.refresh_steps.append(state.global_step)
        if not dist.is_initialized():
            return
        for name, layer in layers:
            for side in ("left", "right"):
                basis = layer.basis(side)
                if basis is not None:
                    gathered = [torch.empty_like(basis) for _ in range(dist.get_world_size())]
                    dist.all_gather(gathered, basis.contiguous())
                    assert all(torch.equal(gathered[0], g) for g in gathered), f"{name} {side} basis differs"


def token_data(n: int = 96, length: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def training_args(output_dir: Path, **overrides) -> TrainingArguments:
    world = int(os.environ.get("WORLD_SIZE", 1))
    kwargs = dict(
        output_dir=str(output_dir),
        optim=PRESET,
        optim_args=f"rank=8,update_proj_gap={GAP}{EXTRA_OPTIM_ARGS}",
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_BATCH // ACCUMULATION // world,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=3e-3,
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if ENGINE.startswith("zero"):
        kwargs["deepspeed"] = str(REPO / "examples" / "deepspeed" / f"{ENGINE}.json")
    elif ENGINE in ("fsdp1", "fsdp2"):
        # The fsdp_config block of the shipped accelerate config, as TrainingArguments take it.
        shipped = yaml.safe_load((REPO / "examples" / "accelerate" / f"{ENGINE}.yaml").read_text())["fsdp_config"]
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = {key.removeprefix("fsdp_"): value for key, value in shipped.items()}
        # Test-only: sync_module_states broadcasts from a GPU device (accelerate raises "no available
        # devices" on a CPU); every rank loads the same checkpoint here, so there is nothing to sync.
        kwargs["fsdp_config"]["sync_module_states"] = False
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def train(model_dir: str, output_dir: Path, resume_from=None, **overrides):
    args = training_args(output_dir, **overrides)  # first: under ZeRO-3 from_pretrained partitions the model
    if ENGINE.startswith("zero"):
        import deepspeed

        # On a GPU accelerate initializes deepspeed.comm; with use_cpu it only sets up torch.distributed,
        # and zero.Init inside from_pretrained would then see a world of 1 and reject the batch sizes.
        deepspeed.init_distributed(dist_backend="gloo")
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    partitioned_at_load = is_zero3_partitioned(model)
    check = BasisCheck()
    trainer = Trainer(model=model, args=args, train_dataset=token_data(), callbacks=[check])
    assert is_zero3_partitioned(model) == partitioned_at_load  # prepared and partitioned again, layer by layer
    trainer.train(resume_from_checkpoint=resume_from)
    final = output_dir / "final"
    if trainer.is_fsdp_enabled:
        # Checkpoints stay sharded (distributed checkpoint); the final model is gathered, as the
        # transformers FSDP guide tells users to do before save_model().
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(str(final))
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    return losses, check.refresh_steps, final, partitioned_at_load


def main(out: str, model_dir: str) -> None:
    from safetensors.torch import load_file

    work = Path(out).parent / f"work_{ENGINE}_{PRESET}"
    losses, refresh_steps, final, partitioned_at_load = train(model_dir, work / "run")
    checkpoint = work / "run" / f"checkpoint-{SAVE_AT}"
    resumed_losses, _, resumed_final, _ = train(
        model_dir, work / "resumed", resume_from=str(checkpoint), save_strategy="no"
    )
    result = {
        "losses": losses,
        "resumed_losses": resumed_losses,
        "refresh_steps": refresh_steps,
        "partitioned_at_load": partitioned_at_load,
    }
    if os.environ.get("WITHOUT_GALORE_STATE") == "1":
        incomplete = work / "incomplete"
        if int(os.environ.get("RANK", 0)) == 0:
            shutil.copytree(checkpoint, incomplete)
            (incomplete / GALORE_STATE_NAME).unlink()
        if dist.is_initialized():
            dist.barrier()
        try:
            train(model_dir, work / "refused", resume_from=str(incomplete), save_strategy="no")
            result["refused"] = None
        except ValueError as exc:
            result["refused"] = str(exc)
    if int(os.environ.get("RANK", 0)) == 0:  # the rank that wrote the models
        result["weights"] = load_file(str(final / "model.safetensors"))
        result["resumed_weights"] = load_file(str(resumed_final / "model.safetensors"))
        result["checkpoint_files"] = sorted(p.name for p in checkpoint.iterdir())
        torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    shut_down()
