"""Reading device values on the host without stalling the device.

``AsyncRead`` starts a copy of a (small) tensor to pinned host memory behind the work already
queued and records an event after it: ``ready()`` asks the event without waiting, ``values()``
waits for it. The training step then never waits for the device to read a loss, a gradient norm
or the NaN guard's flags; the host reads them a step or more later, when the copy has landed. On
CPU the values are there at once.
"""

from __future__ import annotations

import torch


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
