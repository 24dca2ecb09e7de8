"""The one place that wraps a model for a data-parallel or sharding engine on CPU and gloo, shared by
the distributed benchmark (benchmarks/_distributed_worker.py) and the distributed tests
(tests/distributed/*.py, which put this folder at the end of sys.path to import it).

Importing this module loads only the standard library; torch is imported inside the function (every
caller has already imported it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

ENGINES = ("single", "ddp", "fsdp1", "fsdp2")


def wrap_for_engine(
    model: Any,
    engine: str,
    *,
    block_class: Optional[type] = None,
    use_orig_params: bool = True,
    comm_hook: Optional[Callable] = None,
) -> tuple[Any, Any]:
    """Wrap ``model`` for ``engine`` and return ``(model_for_optimizer, forward_module)``.

    - ``single``: no engine; both are ``model``.
    - ``ddp``: ``DistributedDataParallel(model)``, with ``comm_hook`` registered when given (a Python
      hook, e.g. DDP's default ``allreduce_hook``, makes each bucket's all-reduce visible to Python);
      the optimizer gets ``model``, the forward runs through the DDP module.
    - ``fsdp2``: ``fully_shard`` on every submodule of class ``block_class`` (in ``model.modules()``
      order), then on ``model``; both are ``model``, now sharded in place.
    - ``fsdp1``: ``FullyShardedDataParallel(model, use_orig_params=..., device_id=cpu,
      auto_wrap_policy=ModuleWrapPolicy({block_class}))``, or the whole model as one unit with
      ``block_class=None``; both are the FSDP module (the optimizer must see its flat or original
      parameters, not the unwrapped model's).

    ``block_class`` is the unit of sharding (a decoder layer): required by fsdp2 (fsdp1: None is one unit),
    and at least one submodule of ``model`` must be one, with no block inside another (fully_shard must
    shard an inner module before its parent). Engines that have no use for an argument refuse it rather than
    ignore it: ``comm_hook`` is DDP's alone, ``use_orig_params=False`` FSDP1's alone.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is not one of {ENGINES}; pass one of those names")
    if comm_hook is not None and engine != "ddp":
        raise ValueError(f"comm_hook={comm_hook!r} is a DDP communication hook; engine={engine!r} has none, pass None")
    if not use_orig_params and engine != "fsdp1":
        raise ValueError(
            f"use_orig_params=False is an FSDP1 option; engine={engine!r} always trains the original "
            "parameters, pass use_orig_params=True"
        )
    if engine == "fsdp2" or (engine == "fsdp1" and block_class is not None):
        blocks = _blocks(model, engine, block_class)

    import torch

    if engine == "single":
        return model, model
    if engine == "ddp":
        forward = torch.nn.parallel.DistributedDataParallel(model)
        if comm_hook is not None:
            forward.register_comm_hook(None, comm_hook)
        return model, forward
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        return model, model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = {} if block_class is None else {"auto_wrap_policy": ModuleWrapPolicy({block_class})}
    wrapped = FullyShardedDataParallel(model, use_orig_params=use_orig_params, device_id=torch.device("cpu"), **policy)
    return wrapped, wrapped


def _blocks(model: Any, engine: str, block_class: Optional[type]) -> list:
    """The submodules of ``model`` that ``engine`` shards one by one; refuses a missing or nested class."""
    if not isinstance(block_class, type):
        raise ValueError(
            f"engine={engine!r} shards block by block: pass block_class=<the model's layer class> (got {block_class!r})"
        )
    blocks = [m for m in model.modules() if m is not model and isinstance(m, block_class)]
    if not blocks:
        raise ValueError(
            f"block_class={block_class.__name__} matches no submodule of {type(model).__name__}; "
            "pass the class of its repeated layers"
        )
    for block in blocks:
        inner = [m for m in block.modules() if m is not block and isinstance(m, block_class)]
        if inner:
            raise ValueError(
                f"block_class={block_class.__name__} nests (a {block_class.__name__} inside another); "
                "pass the class of the innermost repeated layer"
            )
    return blocks
