"""Step records that do not stall the device (``--log-every-steps``).

A step record holds values on the device (this step's loss and gradient norm) and every rank's
memory. At a logged step each rank's row of them is gathered over the ranks (one all-gather, queued
behind the step) and sent to the host with ``device_reads.AsyncRead``; the record is written when
the copy has landed: looked for after every step without waiting, and waited for when the trainer
settles (epoch end, checkpoint, end of run). On CPU it is written at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdp2lab.training.device_reads import AsyncRead, to_device

# (every rank's values, key -> list by rank) -> None: writes the record
Finish = Callable[[dict[str, list]], None]


class StepRecords:
    def __init__(self, device: torch.device, world_size: int):
        self.device, self.world_size = device, world_size
        self.pending: list[tuple[list[str], set[str], AsyncRead, Finish]] = []

    def submit(
        self, on_device: dict[str, torch.Tensor], on_host: dict[str, int | float], finish: Finish
    ) -> None:
        """Gather ``on_device`` (0-dim tensors) and ``on_host`` values of every rank (the same keys
        on every rank: a collective) and call ``finish`` with them once they reach the host."""
        keys = [*on_device, *on_host]
        ints = {k for k, v in on_host.items() if isinstance(v, int)}
        row = torch.cat(
            [
                torch.stack(
                    [v.detach().to(self.device, torch.float64) for v in on_device.values()]
                ),
                to_device([float(v) for v in on_host.values()], self.device),
            ]
        )
        if self.world_size > 1:
            rows = [torch.empty_like(row) for _ in range(self.world_size)]
            dist.all_gather(rows, row)
            row = torch.stack(rows)
        self.pending.append((keys, ints, AsyncRead(row.reshape(self.world_size, -1)), finish))

    def poll(self) -> None:
        """Write the records whose values have landed, in order (never waits)."""
        while self.pending and self.pending[0][2].ready():
            self._write_first()

    def flush(self) -> None:
        """Write every pending record (waits for their values)."""
        while self.pending:
            self._write_first()

    def _write_first(self) -> None:
        keys, ints, read, finish = self.pending.pop(0)
        columns = zip(*read.values(), strict=True)  # by key, each a list by rank
        finish(
            {
                key: [int(v) for v in column] if key in ints else list(column)
                for key, column in zip(keys, columns, strict=True)
            }
        )
