"""The ops of a simulated training step, in the order a rank issues them, with what a GPU's time
depends on: FLOPs, bytes read and written, a matmul's shape, an attention's direction, mask,
head dimension and key length, a collective's bytes on the wire, and which tensors (storages)
each op reads and writes.

:class:`OpTrace` is filled by the plan's dispatch mode (``scale.simulate.StepCounter``) over the
tracked step; ``scale.timing`` turns it into a step time. Ops that launch no kernel (views,
allocations, metadata) are left out.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten

MATMULS = {aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm}  # addmm_: fused LoRA
# Collectives are recorded by :meth:`OpTrace.collective`; the others launch no GPU kernel.
SKIPPED_NAMESPACES = ("c10d", "_c10d_functional", "prim", "profiler")
# FSDP2's copies into its all-gather and reduce-scatter buffers, run on their side streams.
COPY_IN = ("all_gather_copy_in", "chunk_cat")
# Softmax kernels read a row from memory once per pass where the row is too long to stay on chip
# (torch's SoftMax.cu keeps up to 10 registers x 16 bytes for each of a block's 1,024 threads, or a
# row in its 48 KiB of shared memory; past that its kernels read the row again for each pass):
# forward a max, a sum of exponentials and the output (the input read 3 times); backward a sum and
# the gradient (log-softmax: the incoming gradient twice and the output once; softmax: both twice).
# Each op's passes over its tensors read, in argument order.
ROW_PASSES = {
    aten._softmax: (3,),
    aten._log_softmax: (3,),
    aten._softmax_backward_data: (2, 2),
    aten._log_softmax_backward_data: (2, 1),
}
ON_CHIP_ROW_BYTES = 10 * 16 * 1024
# Ops that make or reinterpret a tensor without a kernel reading or writing its data.
NO_KERNEL = {
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten._unsafe_view,
    aten.lift_fresh,
    aten.resize_,
    aten.set_,
    aten.record_stream,
    aten.is_same_size,
    aten._local_scalar_dense,
}


# True while ops run that ``--compile`` leaves eager (:func:`uncompiled`)
_UNCOMPILED = contextvars.ContextVar("uncompiled", default=False)


@contextlib.contextmanager
def uncompiled():
    """Ops recorded inside run eager under ``--compile``: it compiles the sharding units, not
    what runs between them (the loss)."""
    token = _UNCOMPILED.set(True)
    try:
        yield
    finally:
        _UNCOMPILED.reset(token)


def uncompiled_backward(result: torch.Tensor, source: torch.Tensor) -> None:
    """Record the backward from ``result`` to ``source`` (a loss to its logits) as eager ops:
    from the gradient of ``result`` until that of ``source`` is made."""
    if result.requires_grad and source.requires_grad:
        result.register_hook(_uncompiled_from_here(True))
        source.register_hook(_uncompiled_from_here(False))


def _uncompiled_from_here(on: bool):
    def hook(grad: torch.Tensor) -> None:
        _UNCOMPILED.set(on)

    return hook


@dataclass(slots=True)
class Op:
    # "matmul", "attention", "memory" (bound by bytes), "collective", and "copy_in": FSDP2's
    # copies into a collective's buffer, which it runs on the collective's side stream
    kind: str
    flops: int
    bytes: int  # read + written
    reads: tuple[int, ...]  # storages read
    writes: tuple[int, ...]  # storages written
    read_bytes: tuple[int, ...] = ()  # of each tensor read (``reads``' order)
    write_bytes: tuple[int, ...] = ()  # of each tensor written
    mnk: tuple[int, int, int] = (0, 0, 0)  # a matmul's output rows, columns and inner size
    causal: bool = False  # an attention's mask: the kernel computes about half its FLOPs
    attention_shape: tuple[int, int] = (0, 0)  # an attention's head dimension and key length
    backward: bool = False  # an attention's backward kernel
    dim: str = ""  # a collective's mesh dimension
    wire_bytes: int = 0  # what a rank sends (= receives) for a collective
    optimizer: bool = False  # run by the optimizer step
    fusable: bool = True  # an aten op of a compiled unit: a compiler may fuse it with neighbours
    fsdp: str = ""  # FSDP2's own op (``torch.ops.fsdp``): its name
    collective: str = ""  # a collective's kind: all_gather, reduce_scatter, all_reduce, ...


def tensors(value) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or lists and tuples of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


def nbytes(value) -> int:
    """The bytes of the tensors in ``value``."""
    return sum(t.numel() * t.element_size() for t in tensors(value))


def _mnk(func, args) -> tuple[int, int, int]:
    a, b = (
        (args[1], args[2])
        if func._overloadpacket in (aten.addmm, aten.addmm_, aten.baddbmm)
        else args[:2]
    )
    batch = a.shape[0] if a.dim() == 3 else 1
    return batch * a.shape[-2], b.shape[-1], a.shape[-1]


def _row_bytes(t: torch.Tensor, dim: int) -> int:
    """The bytes of one row of ``t`` along ``dim``."""
    return t.shape[dim] * t.element_size()


def _argument(func, args, kwargs, name: str, default=None):
    """The argument of ``func`` called ``name`` in its schema, as given or defaulted."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return kwargs.get(name, args[i] if i < len(args) else default)
    return default


def _attention(func, args, kwargs) -> dict:
    """An attention kernel's mask, direction, head dimension and key length (query and key are
    laid out batch, heads, sequence, head dimension)."""
    key = _argument(func, args, kwargs, "key")
    shape = (key.shape[-1], key.shape[-2]) if isinstance(key, torch.Tensor) else (0, 0)
    return {
        "causal": bool(_argument(func, args, kwargs, "is_causal", False)),
        "attention_shape": shape,
        "backward": "backward" in func._overloadpacket.__name__,
    }


class OpTrace:
    """The ops of one step, appended by :meth:`record` and :meth:`collective`."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.optimizer = False  # set while the optimizer steps
        # storage address -> a weak reference to the storage there, which keeps the address from
        # being reused by another storage while the trace lives (however that one is made)
        self._seen: dict[int, StorageWeakRef] = {}

    def storage(self, t: torch.Tensor) -> int:
        """A key for ``t``'s storage: its address, which no other storage takes while the trace
        lives."""
        storage = t.untyped_storage()
        address = storage._cdata
        if address not in self._seen:
            self._seen[address] = StorageWeakRef(storage)
        return address

    def mark_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Mark the ops ``optimizer.step`` runs (from its hooks)."""

        def mark(value: bool):
            return lambda *args: setattr(self, "optimizer", value)

        optimizer.register_step_pre_hook(mark(True))
        optimizer.register_step_post_hook(mark(False))

    def record(self, func, args, kwargs, out, flops: int) -> None:
        packet = func._overloadpacket
        namespace = func.namespace
        if func.is_view or packet in NO_KERNEL or namespace in SKIPPED_NAMESPACES:
            return
        ins = tensors(args) + tensors(list(kwargs.values()))
        outs = tensors(out)
        if namespace == "fsdp":
            copy_in = packet.__name__.startswith(COPY_IN)
            kind, extra = ("copy_in" if copy_in else "memory"), {"fsdp": packet.__name__}
        elif packet in MATMULS:
            kind, extra = "matmul", {"mnk": _mnk(func, args)}
        elif "attention" in packet.__name__:
            kind, extra = "attention", _attention(func, args, kwargs)
        else:
            kind, extra = "memory", {}
        read, written = tuple(map(nbytes, ins)), tuple(map(nbytes, outs))
        passes = ROW_PASSES.get(packet, ())
        # the reduced dimension follows the tensors: (input, dim, ...), (grad, output, dim, ...)
        if passes and _row_bytes(ins[0], args[len(passes)]) > ON_CHIP_ROW_BYTES:
            multi = zip(read[: len(passes)], passes, strict=True)
            read = tuple(b * n for b, n in multi) + read[len(passes) :]
        self.ops.append(
            Op(
                kind,
                flops,
                sum(read) + sum(written),
                tuple(self.storage(t) for t in ins),
                tuple(self.storage(t) for t in outs),
                read,
                written,
                optimizer=self.optimizer,
                fusable=namespace == "aten" and not _UNCOMPILED.get(),
                **extra,
            )
        )

    def collective(self, kind: str, dim: str, reads, writes, wire_bytes: int) -> None:
        """A collective on mesh dimension ``dim`` that reads the tensors in ``reads`` and writes
        those in ``writes``."""
        ins, outs = tensors(reads), tensors(writes)
        self.ops.append(
            Op(
                "collective",
                0,
                nbytes(ins) + nbytes(outs),
                tuple(self.storage(t) for t in ins),
                tuple(self.storage(t) for t in outs),
                dim=dim,
                wire_bytes=wire_bytes,
                optimizer=self.optimizer,
                collective=kind,
            )
        )
