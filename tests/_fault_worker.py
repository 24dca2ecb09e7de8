"""Fault injection for GaLore checkpoints: SIGKILL a Trainer run at chosen instants, then resume.

Run as ``python tests/_fault_worker.py WORKDIR``; writes WORKDIR/rows.json: {"rows": [...]} with, per
kill point, how the killed run ended, what the output_dir held, and the outcome of
``train(resume_from_checkpoint=True)``: "exact" (final tensors bit-identical to an uninterrupted
run), "refused" (raised before any step; the message), or anything else (a failure).

One interpreter imports torch/transformers once; every run is a forked child (single-threaded torch,
so no thread pool crosses the fork). A killed child dies by ``os.kill(os.getpid(), SIGKILL)`` from
inside the write it interrupts: the file being written is first cut to half its size, which is what
a kill during the write leaves on disk. A checkpoint is complete once its manifest exists.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sys
import traceback

os.environ.setdefault("HF_GALORE_DISABLE_TRITON", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

torch.set_num_threads(1)

import transformers  # noqa: E402  (after the thread count is set)
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402
from transformers import modeling_utils, trainer_callback  # noqa: E402
from transformers import trainer as trainer_module  # noqa: E402

import hf_galore_plugin as hgp  # noqa: E402,F401  registers the optimizer names
from hf_galore_plugin.checkpoint import manifest  # noqa: E402
from hf_galore_plugin.integrations import saving  # noqa: E402

transformers.logging.set_verbosity_error()

MAX_STEPS, SAVE_STEPS = 6, 2

# (name, what is interrupted, checkpoint step whose save it hits)
KILL_POINTS = [
    ("step 3 (between saves)", "step", 3),
    ("checkpoint-2 model.safetensors (first save)", "model.safetensors", 2),
    ("checkpoint-4 model.safetensors", "model.safetensors", 4),
    ("checkpoint-4 optimizer.pt", "optimizer.pt", 4),
    ("checkpoint-4 scheduler.pt", "scheduler.pt", 4),
    ("checkpoint-4 rng_state.pth", "rng_state.pth", 4),
    ("checkpoint-4 trainer_state.json", "trainer_state.json", 4),
    ("checkpoint-4 galore_state.pt", "galore_state.pt", 4),
    ("checkpoint-4 between galore_state.pt and the manifest", "before manifest", 4),
    ("checkpoint-4 galore_manifest.json", "galore_manifest.json", 4),
    ("checkpoint-4 complete, before rotation", "rotate", 4),
    ("rotation: checkpoint-2 half deleted", "rmtree", 4),
    ("step 5 (after rotation)", "step", 5),
    ("checkpoint-6 optimizer.pt (last save)", "optimizer.pt", 6),
]


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=128,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def data() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 128, (32, 8), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def make_trainer(output_dir: str) -> Trainer:
    args = TrainingArguments(
        output_dir=output_dir,
        optim="galore_adamw",
        optim_args="rank=4,update_proj_gap=2",
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        save_total_limit=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return Trainer(model=tiny_llama(), args=args, train_dataset=data())


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _cut(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)


def install_kill(what: str, step: int) -> None:
    """Patch the writer of `what` (in checkpoint-`step`) to leave a half-written file and SIGKILL."""
    tag = f"checkpoint-{step}"

    def hit(path) -> bool:
        path = str(path)
        return tag in path and os.path.basename(path).startswith(what)

    if what == "step":
        from transformers import TrainerCallback

        class Kill(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == step:
                    _die()

        install_kill.callback = Kill()
        return
    if what == "model.safetensors":
        original = modeling_utils.safe_save_file

        def safe_save_file(tensors, filename, *args, **kwargs):
            original(tensors, filename, *args, **kwargs)
            if hit(filename):
                _cut(filename)
                _die()

        modeling_utils.safe_save_file = safe_save_file
    elif what == "trainer_state.json":
        original_json = trainer_callback.TrainerState.save_to_json

        def save_to_json(self, json_path):
            original_json(self, json_path)
            if hit(json_path):
                _cut(json_path)
                _die()

        trainer_callback.TrainerState.save_to_json = save_to_json
    elif what == "rotate":
        original_rotate = trainer_module.rotate_checkpoints

        def rotate_checkpoints(*args, **kwargs):
            # the Trainer's own call inside _save_checkpoint runs with the limit held back (None)
            if kwargs.get("save_total_limit") and os.path.isdir(
                os.path.join(kwargs.get("output_dir", args[0] if args else ""), tag)
            ):
                _die()
            return original_rotate(*args, **kwargs)

        trainer_module.rotate_checkpoints = rotate_checkpoints
    elif what == "before manifest":
        original_manifest = manifest.write_manifest

        def write_manifest(folder, *args, **kwargs):
            if tag in str(folder):
                _die()
            return original_manifest(folder, *args, **kwargs)

        saving.write_manifest = write_manifest  # where the integration calls it
    elif what == "galore_manifest.json":
        original_write = manifest.write_atomically

        def write_atomically(path, write):
            if hit(path):
                whole = io.BytesIO()
                write(whole)
                with open(f"{path}.tmp-{os.getpid()}", "wb") as handle:
                    handle.write(whole.getvalue()[: len(whole.getvalue()) // 2])
                _die()
            return original_write(path, write)

        manifest.write_atomically = write_atomically
    elif what == "rmtree":

        def rmtree(path, *args, **kwargs):
            files = sorted(os.listdir(path))
            for name in files[: len(files) // 2]:
                os.remove(os.path.join(path, name))
            _die()

        shutil.rmtree = rmtree
    else:  # torch.save targets: optimizer.pt, scheduler.pt, rng_state.pth, galore_state.pt (a temporary name)
        original_save = torch.save

        def save(obj, f, *args, **kwargs):
            original_save(obj, f, *args, **kwargs)
            name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "")
            if hit(name):
                if not isinstance(f, (str, os.PathLike)):
                    f.flush()
                _cut(name)
                _die()

        torch.save = save


def final_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in trainer.model.state_dict().items()}


def child(run) -> int:
    """Fork; the child runs `run()` and exits with its return code (SIGKILL shows as a signal)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = run()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main(workdir: str) -> None:
    os.makedirs(workdir, exist_ok=True)

    # The uninterrupted run, in this process: it also imports what the Trainer imports lazily (accelerate's
    # and DeepSpeed's modules), once for every forked run.
    trainer = make_trainer(os.path.join(workdir, "reference"))
    trainer.train()
    expected = final_tensors(trainer)
    del trainer
    rows = []
    for index, (name, what, step) in enumerate(KILL_POINTS):
        output_dir = os.path.join(workdir, f"run{index}")
        result_file = os.path.join(workdir, f"result{index}.pt")

        def killed(what=what, step=step, output_dir=output_dir) -> int:
            install_kill.callback = None
            install_kill(what, step)
            trainer = make_trainer(output_dir)
            if install_kill.callback is not None:
                trainer.add_callback(install_kill.callback)
            trainer.train()
            return 0

        def resumed(output_dir=output_dir, result_file=result_file) -> int:
            trainer = make_trainer(output_dir)
            steps = []
            trainer.add_callback(
                type(
                    "Count",
                    (transformers.TrainerCallback,),
                    {"on_step_end": lambda self, args, state, control, **kw: steps.append(state.global_step)},
                )()
            )
            try:
                trainer.train(resume_from_checkpoint=True)
            except Exception as exc:  # noqa: BLE001
                torch.save({"refused": f"{type(exc).__name__}: {exc}", "steps": steps}, result_file)
                return 0
            torch.save({"tensors": final_tensors(trainer), "steps": steps}, result_file)
            return 0

        killed_status = child(killed)
        held = (
            sorted(
                f"{entry}{'' if os.path.isfile(os.path.join(output_dir, entry, manifest.MANIFEST_NAME)) else ' (incomplete)'}"
                for entry in os.listdir(output_dir)
                if entry.startswith("checkpoint-")
            )
            if os.path.isdir(output_dir)
            else []
        )
        resume_status = child(resumed)
        row = {"point": name, "killed": killed_status == -signal.SIGKILL, "held": held}
        # a killed writer's temporary (galore_state.pt.tmp-<pid>) must not outlive the next run's start
        row["temporaries"] = [
            os.path.join(root, entry)
            for root, _, entries in os.walk(output_dir)
            for entry in entries
            if manifest.is_own_temporary(entry)
        ]
        if resume_status != 0 or not os.path.isfile(result_file):
            row["outcome"] = f"resume crashed (exit {resume_status})"
        else:
            result = torch.load(result_file, weights_only=True)
            if "refused" in result:
                row["outcome"] = "refused" if not result["steps"] else "refused after steps"
                row["message"] = result["refused"]
            else:
                tensors = result["tensors"]
                same = tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in expected)
                row["outcome"] = "exact" if same else "different"
                row["resumed_steps"] = result["steps"]
        rows.append(row)
    with open(os.path.join(workdir, "rows.json"), "w") as handle:
        json.dump({"rows": rows}, handle)


if __name__ == "__main__":
    main(sys.argv[1])
