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
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary


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
        row = row.pin_memory()
    return row.to(device, non_blocking=True)


aten = torch.ops.aten
# Dispatched ops whose result's size or value the host needs: on CUDA, each waits for the device.
WAITING_OPS = {
    aten._local_scalar_dense.default: "item",  # .item(), float(), bool()
    aten.nonzero.default: "nonzero",  # also torch.where(mask), argwhere
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.bincount.default: "bincount",  # sized by the largest value
    aten.equal.default: "equal",  # a Python bool
    aten.allclose.default: "equal",
}
MASK_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten._index_put_impl_.default}
HOST = "host"


class HostWaits(TorchDispatchMode):
    """Counts, by kind, the calls that make the host wait for the device on CUDA (``device``'s
    type: what a run on it would do), on whatever device they run:

    - reads of a device tensor: ``.item()`` (``float()``, ``bool()``), ``.tolist()``,
      ``.numpy()``, and a blocking copy to the host (``.cpu()``, ``.to("cpu")``,
      ``host.copy_(x)``);
    - ops sized or decided by device values: ``nonzero`` (``torch.where(mask)``, ``argwhere``),
      ``masked_select``, ``index`` and ``index_put_`` with a boolean mask, ``repeat_interleave``
      with tensor repeats and no ``output_size``, ``unique``, ``bincount``, ``equal``/``allclose``;
    - copies: any other blocking copy between places (a ``non_blocking`` one waits for nothing,
      and its reader waits on an event, counted), and ``torch.tensor``/``torch.as_tensor`` of host
      values (numbers, lists, arrays) given a device of ``device``'s type;
    - synchronizes: ``torch.cuda.synchronize``, ``torch.accelerator.synchronize``, and a CUDA
      stream's or event's ``synchronize`` (not the generic ``torch.Stream``/``torch.Event``'s,
      which cannot be wrapped).

    On a CPU the host and the device are one: a tensor counts as on the device unless the code
    made it for the host: ``torch.tensor``/``torch.as_tensor`` of host values without a device,
    ``torch.from_numpy``, ``.cpu()``, ``.to`` the device named by the string ``"cpu"`` (code for
    the run's device passes a ``torch.device``), and the results of ops on such tensors alone
    (there ``.cpu()`` and ``.to("cpu")`` of a device tensor return a view of it, the host's).
    Ops on host tensors wait for nothing; a copy between a host and a device tensor counts as on
    CUDA. A factory without a device (``torch.zeros(n)``) is the device's on a CPU: its dispatch
    names the CPU as the run's own device does. On CUDA the host is the CPU. ``paused`` stops
    the count (``take`` reads it and starts again).
    """

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device = torch.device(device)
        self.kinds: collections.Counter[str] = collections.Counter()
        self.paused = False
        self._inside = 0  # a counted call's own ops are not counted again
        self._patched: list[tuple[object, str, object]] = []
        self._made_for_host = WeakIdKeyDictionary()  # on a CPU, the tensors the code made there

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

    def _place(self, tensor: torch.Tensor) -> torch.device | str:
        """``HOST`` or the device ``tensor`` is on, as a run on ``device`` sees it."""
        if tensor.device.type == "cpu" and (
            self.device.type != "cpu" or tensor in self._made_for_host
        ):
            return HOST
        return tensor.device

    def _for_host(self, value):
        """``value``, its tensors marked as made for the host (on a CPU)."""
        if self.device.type == "cpu":
            for leaf in pytree.tree_leaves(value):
                if isinstance(leaf, torch.Tensor):
                    self._made_for_host[leaf] = True
        return value

    def _count_copy(self, source: torch.Tensor, target, non_blocking: bool) -> None:
        if target != self._place(source) and not non_blocking:
            self._count("read" if target == HOST else "copy")

    def _moved(self, out: torch.Tensor, source: torch.Tensor, target) -> torch.Tensor:
        """A copy's (or a move's) result ``out`` of ``source``, marked as made for the host where
        ``target`` is the host (on a CPU a move there returns ``source``: a view of it is)."""
        if target != HOST or self.device.type != "cpu":
            return out
        if out is source:
            with self._counted(None):
                out = out.view_as(out)
        return self._for_host(out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default:
            device = kwargs.get("device")
            target = self._place(args[0]) if device is None else self._device_place(device, False)
            self._count_copy(args[0], target, kwargs.get("non_blocking", False))
            return self._moved(func(*args, **kwargs), args[0], target)
        if func is aten.copy_.default:
            non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])
            self._count_copy(args[1], self._place(args[0]), non_blocking)
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = bool(tensors) and all(self._place(t) == HOST for t in tensors)
        if not on_host:
            self._count_op(func, args, kwargs)
        out = func(*args, **kwargs)
        return self._for_host(out) if on_host else out

    def _count_op(self, func, args, kwargs) -> None:
        if func in WAITING_OPS:
            self._count(WAITING_OPS[func])
        elif func in MASK_INDEXING:
            indices = args[1]
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self._count("mask_index")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self._count("repeat_interleave")

    def _device_place(self, named, by_name: bool) -> torch.device | str:
        """The place a device argument names (``by_name``: given as a string)."""
        device = torch.device(named)
        if device.type == "cpu" and (self.device.type != "cpu" or by_name):
            return HOST
        return device

    def _target(self, tensor: torch.Tensor, args, kwargs):
        """Where ``tensor.to(*args, **kwargs)`` sends ``tensor``: ``HOST`` or a device."""
        named = args[0] if args else kwargs.get("device", kwargs.get("other"))
        if isinstance(named, torch.Tensor):
            return self._place(named)
        if isinstance(named, (str, int, torch.device)):
            return self._device_place(named, isinstance(named, str))
        return self._place(tensor)  # a dtype alone: it stays

    def __enter__(self):
        def reading(original, kind):
            def counted(*args, **kwargs):
                with self._counted(kind):
                    return original(*args, **kwargs)

            return counted

        def read_of(original, kind):
            def counted(tensor, *args, **kwargs):
                with self._counted(kind if self._place(tensor) != HOST else None):
                    return self._moved(original(tensor, *args, **kwargs), tensor, HOST)

            return counted

        def moved(original, kind):
            def counted(tensor, *args, **kwargs):
                target = self._target(tensor, args, kwargs)
                # the first bool given by position is non_blocking (copy comes after it)
                bools = (a for a in args if isinstance(a, bool))
                non_blocking = kwargs.get("non_blocking", next(bools, False))
                self._count_copy(tensor, target, non_blocking)
                with self._counted(None):
                    out = original(tensor, *args, **kwargs)
                return self._moved(out, tensor, target)

            return counted

        def from_host(original, kind):
            def counted(data, *args, **kwargs):
                device = kwargs.get("device")  # keyword-only in both
                if isinstance(data, torch.Tensor):
                    return original(data, *args, **kwargs)
                if device is None:
                    with self._counted(None):
                        return self._for_host(original(data, *args, **kwargs))
                to_device = torch.device(device).type == self.device.type
                with self._counted(kind if to_device else None):
                    return original(data, *args, **kwargs)

            return counted

        patches = [
            *((torch.Tensor, name, read_of, "read") for name in ("tolist", "numpy", "cpu")),
            (torch.Tensor, "to", moved, None),
            *((torch, name, from_host, "host_value") for name in ("as_tensor", "tensor")),
            (torch, "from_numpy", from_host, None),
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
