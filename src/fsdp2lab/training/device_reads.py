"""Reading device values on the host without stalling the device.

``AsyncRead`` starts a copy of a (small) tensor to pinned host memory behind the work already
queued and records an event after it: ``ready()`` asks the event without waiting, ``values()``
waits for it. The training step then never waits for the device to read a loss, a gradient norm
or the NaN guard's flags; the host reads them a step or more later, when the copy has landed. On
CPU the values are there at once.

``HostWaits`` counts, by kind, the calls that on CUDA make the host wait for the device, on any
device (the proxy a CPU test checks the step with).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class AsyncRead:
    def __init__(self, tensor: torch.Tensor):
        tensor = tensor.detach()
        self.event = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def ready(self) -> bool:
        """Whether the values have landed (never waits)."""
        return self.event is None or self.event.query()

    def values(self) -> list:
        """The values, as Python numbers (waits for the copy where it has not landed)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host numbers as a float64 tensor on ``device``, copied without blocking the host."""
    row = torch.tensor(values, dtype=torch.float64)
    if device.type == "cuda":
        return row.pin_memory().to(device, non_blocking=True)
    return row.to(device)


aten = torch.ops.aten
# Dispatched ops whose result's size or value the host needs: on CUDA, each waits for the device.
WAITING_OPS = {
    aten._local_scalar_dense.default: "item",  # .item(), float(), bool()
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
}
MASK_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten._index_put_impl_.default}
COPIES = {aten._to_copy.default, aten.copy_.default}


class HostWaits(TorchDispatchMode):
    """Counts, by kind, the calls that make the host wait for the device on CUDA (``device``'s
    type: what a run on it would do), on whatever device they run:

    - reads: ``.item()`` (``float()``, ``bool()``), ``.tolist()``, ``.numpy()``, ``.cpu()``;
    - ops sized by device values: ``nonzero``, ``masked_select``, ``index`` and ``index_put_``
      with a boolean mask, ``repeat_interleave`` with tensor repeats and no ``output_size``;
    - copies: a blocking copy between devices (a ``non_blocking`` one waits for nothing, and its
      reader waits on an event, counted), and ``torch.tensor``/``torch.as_tensor`` of host values
      (numbers, lists, arrays) given a device of ``device``'s type (on CUDA a blocking copy);
    - synchronizes: ``torch.cuda.synchronize``, ``torch.accelerator.synchronize``, and a CUDA
      stream's or event's ``synchronize``.

    On a CPU every tensor counts as on the device, so code meant for the host gives no device.
    ``paused`` stops the count (``take`` reads it and starts again).
    """

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device = torch.device(device)
        self.kinds: collections.Counter[str] = collections.Counter()
        self.paused = False
        self._inside = 0  # a counted call's own ops are not counted again
        self._patched: list[tuple[object, str, object]] = []

    def take(self) -> dict[str, int]:
        """The counts by kind so far, which start again from none."""
        kinds, self.kinds = dict(self.kinds), collections.Counter()
        return kinds

    def _count(self, kind: str) -> None:
        if not self.paused and not self._inside:
            self.kinds[kind] += 1

    @contextlib.contextmanager
    def _counted(self, kind: str | None):
        if kind is not None:
            self._count(kind)
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._count_op(func, args, kwargs)
        return func(*args, **kwargs)

    def _count_op(self, func, args, kwargs) -> None:
        if func in WAITING_OPS:
            self._count(WAITING_OPS[func])
        elif func in MASK_INDEXING:
            indices = args[1]
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self._count("mask_index")
        elif func is aten.repeat_interleave.Tensor:
            if kwargs.get("output_size") is None:
                self._count("repeat_interleave")
        elif func in COPIES:
            to_copy = func is aten._to_copy.default
            src = args[0] if to_copy else args[1]
            dst = kwargs.get("device") if to_copy else args[0].device
            non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])
            if dst is not None and torch.device(dst) != src.device and not non_blocking:
                self._count("copy")

    def __enter__(self):
        def reading(original, kind):
            def counted(*args, **kwargs):
                with self._counted(kind):
                    return original(*args, **kwargs)

            return counted

        def from_host(original, kind):
            def counted(data, *args, **kwargs):
                device = kwargs.get("device")  # keyword-only in both
                to_device = (
                    device is not None
                    and not isinstance(data, torch.Tensor)
                    and torch.device(device).type == self.device.type
                )
                with self._counted(kind if to_device else None):
                    return original(data, *args, **kwargs)

            return counted

        patches = [
            *((torch.Tensor, name, reading, "read") for name in ("tolist", "numpy", "cpu")),
            *((torch, name, from_host, "host_value") for name in ("as_tensor", "tensor")),
            (torch.cuda, "synchronize", reading, "synchronize"),
            (torch.accelerator, "synchronize", reading, "synchronize"),
            (torch.cuda.Stream, "synchronize", reading, "synchronize"),
            (torch.cuda.Event, "synchronize", reading, "synchronize"),
        ]
        for owner, name, wrap, how in patches:
            original = getattr(owner, name)
            self._patched.append((owner, name, original))
            setattr(owner, name, wrap(original, how))
        return super().__enter__()

    def __exit__(self, *exc):
        while self._patched:
            owner, name, original = self._patched.pop()
            setattr(owner, name, original)
        return super().__exit__(*exc)
