"""``--memory-snapshot FILE`` (CUDA): record every allocation from the start of training and
write torch's memory snapshot at the end (open it at https://pytorch.org/memory_viz). Rank 0
writes FILE, rank r > 0 writes FILE.rank<r>."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fsdp2lab.runtime import logs
from fsdp2lab.runtime.torch_compat import cuda_memory_history
from fsdp2lab.training.hooks import Hooks

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer


log = logs.get_logger(__name__)


class MemorySnapshot(Hooks):
    def __init__(self, path: str, rank: int):
        self.path = Path(path if rank == 0 else f"{path}.rank{rank}")

    def before_fit(self, trainer: Trainer) -> None:
        record, _ = cuda_memory_history()
        record(max_entries=100_000)

    def after_fit(self, trainer: Trainer) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record, dump = cuda_memory_history()
        dump(str(self.path))
        record(enabled=None)
        log.info(f"fsdp2lab: memory snapshot written to {self.path}")
