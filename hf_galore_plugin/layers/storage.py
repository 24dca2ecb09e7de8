"""Storage of one tensor of a layer, kept plain or blockwise-quantized, as buffers of the layer.

A :class:`StoredTensor` owns one tensor of a module (the frozen base W0 under a quantized
``weight_storage``, or a basis): it writes it (quantizing when its storage says so), reads it back
(rebuilding the :class:`~hf_galore_plugin.quant.QuantizedTensor` from the buffers, or dequantizing it),
counts its bytes and keeps the quantization error measured when it was written. Its tensors are
buffers registered on the module under fixed names, so the module's ``state_dict`` keys, ``.to()``,
the engines' buffer handling and the checkpoint format are those of the buffers themselves:

- plain: one buffer ``<name>`` (a basis under ``basis_storage='as_computed'``: ``galore_basis_left``);
- quantized: one buffer ``<name>_<part>`` per tensor of ``QuantizedTensor.to_state()``
  (``weight_q_codes``, ``weight_q_scales``, ``galore_basis_right_codes``, ...).

The object reads the buffers from the module by name on every access, never a cached tensor: engines
and ``module.to()`` replace buffer tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ..quant.functional import block_multiplier, dequantize_whole_blocks, whole_blocks
from ..quant.ops import dequantize_stored
from ..utils import use_triton

if TYPE_CHECKING:
    from ..quant import QuantizedTensor

__all__ = ["QUANT_SCHEMES", "QuantizedSpec", "StoredTensor", "assign_buffer", "read_spec", "stochastic_round_to_bf16"]

QUANT_SCHEMES = {
    # storage name -> (scheme, bits) of hf_galore_plugin.quant.quantize
    "int8": ("symmetric", 8),
    "int4": ("symmetric", 4),
    "nf4": ("nf4", 4),
}
PLAIN_STORAGE = ("as_loaded", "as_computed")


def assign_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set `module`'s buffer `name` to `value`: in place when the shape and dtype allow, because engines
    (DDP's buffer broadcast, FSDP) keep references to the buffer tensors they saw at wrap time."""
    current = module._buffers.get(name)
    if current is None:
        module.register_buffer(name, value)
    elif current.shape == value.shape and current.dtype == value.dtype:
        current.copy_(value)
    else:
        module._buffers[name] = value


class QuantizedSpec(NamedTuple):
    """What compiled code needs to read a quantized store (:meth:`StoredTensor.spec`): its buffer names and the
    layout of :func:`~hf_galore_plugin.quant.ops.dequantize_stored`."""

    codes: str
    scales: str
    zero_points: Optional[str]
    scheme: str
    bits: int
    block_size: int
    numel: int
    shape: tuple[int, ...]


# How compiled code reads a store: the plain buffer's name, or a quantized store's spec.
StoreSpec = Union[str, QuantizedSpec]


def read_spec(buffers: dict[str, Any], spec: StoreSpec, dtype: torch.dtype) -> torch.Tensor:
    """The stored tensor in `dtype` from the module's `buffers`, as :meth:`StoredTensor.value` reads it in traced
    code, with every Python value it needs taken from `spec` (a constant of the compiled forward, see
    :meth:`StoredTensor.spec`) instead of the store's own fields, each of which Dynamo would guard per layer."""
    if isinstance(spec, str):
        plain = buffers[spec]
        return plain if plain.dtype == dtype else plain.to(dtype)
    zero_points = None if spec.zero_points is None else buffers[spec.zero_points]
    return dequantize_stored(
        buffers[spec.codes], buffers[spec.scales], zero_points, dtype=dtype, scheme=spec.scheme, bits=spec.bits,
        block_size=spec.block_size, numel=spec.numel,
    ).view(spec.shape)  # fmt: skip


class StoredTensor:
    """One tensor of `module` in `storage` ('as_loaded'/'as_computed': plain in `dtype`; 'int8', 'int4',
    'nf4': blockwise-quantized in groups of `group_size`), held in buffers named after `name`."""

    def __init__(
        self,
        module: nn.Module,
        name: str,
        storage: str,
        *,
        group_size: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        if storage not in QUANT_SCHEMES and storage not in PLAIN_STORAGE:
            raise ValueError(
                f"storage {storage!r} of {name!r} is unknown; use one of {sorted(PLAIN_STORAGE + tuple(QUANT_SCHEMES))}"
            )
        if storage in QUANT_SCHEMES and group_size is None:
            raise ValueError(f"quantized storage {storage!r} of {name!r} needs a group_size")
        self.module = module
        self.name = name
        self.storage = storage
        self.quantized = storage in QUANT_SCHEMES
        self.group_size = group_size
        self.dtype = dtype  # plain storage casts to it (None: keep the value's dtype)
        # Metadata of the quantized tensor (shape, dtype, scheme, ...: QuantizedTensor.to_state()); not in
        # the state dict, the layer's config and shape determine it.
        self.meta: Optional[dict[str, Any]] = None
        # Relative RMS error of the last quantization, measured against the exact value when it was stored.
        self.error: Optional[float] = None
        self._reader: Optional[_Reader] = None  # set by store() with the metadata
        # Called after every store() (the owner keeps what its compiled forward reads, see spec()).
        self.on_store: Optional[Callable[[], None]] = None

    def buffer_names(self) -> list[str]:
        """The names of the module's buffers that hold this tensor now."""
        if not self.quantized:
            return [self.name] if self.name in self.module._buffers else []
        start = self.name + "_"
        return [name for name in self.module._buffers if name.startswith(start)]

    def _quantize(self, value: torch.Tensor, generator: Optional[torch.Generator]) -> "QuantizedTensor":
        """`value` quantized in this store's scheme and group size, stochastically rounded with `generator`."""
        from ..quant import quantize

        scheme, bits = QUANT_SCHEMES[self.storage]
        return quantize(
            value,
            scheme=scheme,
            bits=bits,
            block_size=self.group_size,
            stochastic=generator is not None,
            generator=generator,
        )

    def store(self, value: torch.Tensor, *, generator: Optional[torch.Generator] = None, measure: bool = True) -> None:
        """Write `value`: as is (cast to the storage dtype), or quantized, stochastically rounded with
        `generator` when one is given. Measures the quantization error unless `value` is on the meta device or
        `measure` is False (the measure reads a value to the host: a device sync)."""
        if not self.quantized:
            assign_buffer(self.module, self.name, value if self.dtype is None else value.to(self.dtype))
            return
        qt = self._quantize(value, generator)
        # Measured here, where the exact value is at hand, so logging it costs nothing later.
        if measure and not value.is_meta:
            self.error = _relative_rms(qt.dequantize(torch.float32), value.to(torch.float32))
        tensors, self.meta = qt.to_state()
        for part, tensor in tensors.items():
            assign_buffer(self.module, f"{self.name}_{part}", tensor)
        self._reader = None if self.meta["double_quant"] else _Reader(self.name, self.meta, "zero_points" in tensors)
        if self.on_store is not None:
            self.on_store()

    def spec(self) -> Optional[StoreSpec]:
        """What :func:`read_spec` needs to read this tensor as :meth:`value` does in traced code (None: it cannot,
        double-quantized scales go through ``QuantizedTensor``). Fixed until the next :meth:`store`."""
        if not self.quantized:
            return self.name
        reader = self._reader
        if reader is None:
            return None
        kwargs = reader.kwargs
        return QuantizedSpec(
            reader.codes, reader.scales, reader.zero_points, kwargs["scheme"], kwargs["bits"], kwargs["block_size"],
            kwargs["numel"], reader.shape,
        )  # fmt: skip

    def load(self) -> QuantizedTensor:
        """The quantized tensor rebuilt from the buffers (a ``QuantizedTensor`` sharing their storage)."""
        from ..quant import QuantizedTensor

        if not self.quantized:
            raise TypeError(f"{self.name!r} is stored plain ({self.storage!r}), not quantized: read it with value()")
        meta = self.meta
        assert meta is not None, "a quantized store has its metadata from the store() that wrote its buffers"
        start, prefix = len(self.name) + 1, self.name + "_"
        buffers = self.module._buffers.items()
        tensors = {name[start:]: t for name, t in buffers if name.startswith(prefix) and t is not None}
        return QuantizedTensor.from_state(tensors, meta)

    def value(self, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in `dtype`: the buffer itself when it has that dtype, else a (dequantized) copy.

        Called for W0 in every forward and backward and for each basis in every forward: the buffers are
        read by name (engines and ``module.to()`` replace them) and dequantized without rebuilding a
        ``QuantizedTensor`` or checking what :meth:`store` wrote."""
        buffers = self.module._buffers
        if not self.quantized:
            # A plain store always has its buffer once stored (the layer stores at construction).
            plain = buffers[self.name]
            assert plain is not None
            return plain if plain.dtype == dtype else plain.to(dtype)
        reader = self._reader
        if reader is None:  # double-quantized scales: rebuilt through QuantizedTensor
            return self.load().dequantize(dtype)
        return reader.read(buffers, dtype)

    def store_slice(
        self, index: int, value: torch.Tensor, *, generator: Optional[torch.Generator] = None
    ) -> tuple[float, float]:
        """Write slice `index` along the first dimension (an expert's W0 in a stack of experts), quantizing
        only that slice's blocks when it is a whole number of them (otherwise the whole tensor is read,
        changed and stored). Returns (squared error, squared norm) of the slice's quantization (0, 0 for a
        plain store), from which the caller forms the tensor's relative error."""
        if not self.quantized:
            buffer = self.module._buffers[self.name]
            assert buffer is not None
            buffer[index].copy_(value)
            return 0.0, 0.0
        reader = self._reader
        per = value.numel()
        if reader is None or per % reader.kwargs["block_size"] or per * reader.shape[0] != reader.kwargs["numel"]:
            whole = self.value(torch.float32)
            whole[index] = value
            self.store(whole, generator=generator)
            return 0.0, 0.0
        qt = self._quantize(value, generator)
        tensors, _ = qt.to_state()
        buffers: dict[str, Any] = self.module._buffers
        for part, tensor in tensors.items():
            target = buffers[f"{self.name}_{part}"]
            count = tensor.numel()
            target[index * count : (index + 1) * count].copy_(tensor.reshape(-1))
        if value.is_meta:
            return 0.0, 0.0
        exact = value.to(torch.float32)
        error = (qt.dequantize(torch.float32) - exact).square().sum()
        return float(error), float(exact.square().sum())

    def value_slice(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Slice `index` along the first dimension in `dtype` (an expert's W0 in a stack of experts).

        Quantized: only that slice's blocks are dequantized when the slice is a whole number of blocks
        (codes and scales are flat, in row-major order, so slice `index` is one contiguous run of each);
        otherwise the whole tensor is dequantized and indexed."""
        if not self.quantized:
            return self.value(dtype)[index]
        reader = self._reader
        if reader is None:
            return self.value(dtype)[index]
        per = reader.kwargs["numel"] // reader.shape[0]
        block, bits = reader.kwargs["block_size"], reader.kwargs["bits"]
        if per % block or (per * bits) % 8:
            return self.value(dtype)[index]
        buffers: dict[str, Any] = self.module._buffers
        if reader.direct(buffers[reader.codes]):
            return reader.read_rows(buffers, index, dtype)
        codes, scales = buffers[reader.codes], buffers[reader.scales]
        codes_per = codes.numel() // reader.shape[0]
        blocks = per // block
        zero_points = None if reader.zero_points is None else buffers[reader.zero_points]
        if zero_points is not None:
            zero_points = zero_points[index * blocks : (index + 1) * blocks]
        flat = dequantize_stored(
            codes[index * codes_per : (index + 1) * codes_per],
            scales[index * blocks : (index + 1) * blocks],
            zero_points,
            dtype=dtype,
            scheme=reader.kwargs["scheme"],
            bits=bits,
            block_size=block,
            numel=per,
        )
        return flat.view(reader.shape[1:])

    def nbytes(self) -> int:
        """Bytes of the buffers that hold it."""
        tensors = [self.module._buffers[name] for name in self.buffer_names()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _Reader:
    """The buffer names and static arguments of one quantized tensor's dequantization, fixed when it is
    stored (the metadata does not change between stores).

    In eager mode a tensor of whole blocks (every W0 and basis the presets store) is decoded directly, with
    the per-block multiplier kept between reads: it is recomputed only when the scales buffer is replaced
    (``module.to()``, an engine) or written in place (``load_state_dict``, a refresh), as its version
    counter shows. Traced code, Triton and other layouts go through :func:`dequantize_stored`."""

    __slots__ = (
        "codes", "scales", "zero_points", "kwargs", "shape", "whole", "_layout", "_source", "_version", "_multiplier",
    )  # fmt: skip

    def __init__(self, name: str, meta: dict[str, Any], has_zero_points: bool) -> None:
        self.codes, self.scales = f"{name}_codes", f"{name}_scales"
        self.zero_points = f"{name}_zero_points" if has_zero_points else None
        self.shape = tuple(meta["shape"])
        numel = 1
        for size in self.shape:
            numel *= size
        self.kwargs = dict(scheme=meta["scheme"], bits=meta["bits"], block_size=meta["block_size"], numel=numel)
        self.whole = not has_zero_points and whole_blocks(**self.kwargs)
        self._layout = {key: value for key, value in self.kwargs.items() if key != "numel"}  # the decoder's
        # Kept between reads: the per-block multiplier as a column (blocks x 1), for the scales tensor it was
        # made from (by identity and version counter).
        self._source: Optional[torch.Tensor] = None
        self._version = -1
        self._multiplier: Optional[torch.Tensor] = None

    def read(self, buffers: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
        # Every forward and backward of a layer comes here: the direct decode is one call with the kept
        # multiplier.
        codes: torch.Tensor = buffers[self.codes]
        scales: torch.Tensor = buffers[self.scales]
        if not self.direct(codes):
            zero_points = None if self.zero_points is None else buffers[self.zero_points]
            return dequantize_stored(codes, scales, zero_points, dtype=dtype, **self.kwargs).view(self.shape)
        return dequantize_whole_blocks(
            codes, self._multiplier_of(scales), dtype=dtype, shape=self.shape, **self._layout
        )

    def direct(self, codes: torch.Tensor) -> bool:
        """Whether :meth:`read` and :meth:`read_rows` decode `codes` directly (eager, plain tensors, whole blocks)."""
        # `type(...) is torch.Tensor` rules out fake and other subclass tensors without a call.
        return (
            self.whole and type(codes) is torch.Tensor and not torch.compiler.is_compiling() and not use_triton(codes)
        )

    def read_rows(self, buffers: dict[str, Any], index: int, dtype: torch.dtype) -> torch.Tensor:
        """Slice `index` along the first dimension, decoded directly (call only where :meth:`direct` holds and a
        slice is a whole number of blocks and bytes): that slice's codes times its rows of the kept multiplier."""
        codes: torch.Tensor = buffers[self.codes]
        rows = self.shape[0]
        per_codes, per_blocks = codes.numel() // rows, self.kwargs["numel"] // rows // self.kwargs["block_size"]
        multiplier = self._multiplier_of(buffers[self.scales])[index * per_blocks : (index + 1) * per_blocks]
        return dequantize_whole_blocks(
            codes[index * per_codes : (index + 1) * per_codes], multiplier, dtype=dtype, shape=self.shape[1:],
            **self._layout,
        )  # fmt: skip

    def _multiplier_of(self, scales: torch.Tensor) -> torch.Tensor:
        kwargs = self.kwargs
        multiplier = self._multiplier
        if scales.is_inference():  # no version counter to tell a write by: not kept
            multiplier = block_multiplier(scales, scheme=kwargs["scheme"], bits=kwargs["bits"])[:, None]
        elif multiplier is None or self._source is not scales or self._version != scales._version:
            multiplier = block_multiplier(scales, scheme=kwargs["scheme"], bits=kwargs["bits"])[:, None]
            self._multiplier, self._source, self._version = multiplier, scales, scales._version
        return multiplier


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # bf16 is the top 16 bits of fp32: adding uniform noise to the 16 discarded bits and truncating
    # rounds up with probability equal to the discarded fraction, which makes the rounding unbiased
    # (Gupta et al. 2015). Without it, folds smaller than half a bf16 ulp of W0 would be lost.
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, device=generator.device, dtype=torch.int32)
    rounded = (bits + noise.to(x.device)) & ~0xFFFF
    return rounded.view(torch.float32).to(torch.bfloat16)


def _relative_rms(
    approx: torch.Tensor, exact: torch.Tensor, chunk: int = 1 << 22, *, every_chunk: bool = False
) -> float:
    """rms(approx - exact) / rms(exact), summed over chunks of `chunk` values so that measuring the
    quantization error of a large weight adds no full-size temporaries to a refresh step.

    Fake tensors (the memory planner's trace) hold no values to measure: unless `every_chunk`, only the first
    two chunks run, which allocate and free what every later one does (the peak is the same; tests compare
    with the full loop), where a 70B MLP weight's 56 chunks would dominate a Q-GaLore trace."""
    a, e = approx.reshape(-1), exact.reshape(-1)
    if not every_chunk and is_fake(e):
        a, e = a[: 2 * chunk], e[: 2 * chunk]
    err = ref = torch.zeros((), dtype=torch.float64, device=e.device)
    for start in range(0, e.numel(), chunk):
        ec = e[start : start + chunk].to(torch.float32)
        ref = ref + ec.square().sum(dtype=torch.float64)
        err = err + (a[start : start + chunk].to(torch.float32) - ec).square().sum(dtype=torch.float64)
    if e.numel() == 0:
        return 0.0
    return float(err.sqrt() / ref.sqrt().clamp_min(1e-30))
