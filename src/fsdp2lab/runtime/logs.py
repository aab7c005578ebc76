"""fsdp2lab's log lines: the ``fsdp2lab`` logger and its one handler.

Every module logs with ``log = get_logger(__name__)``. Rank 0 logs at ``--log-level`` (default
info); the other ranks log warnings and errors only, each line prefixed ``[rank N] ``. A line is
the message itself (no level, time or logger name), so ``Train Epoch: ...``, ``Test set: ...`` and
``fsdp2lab: ...`` lines read as they always have, and go where they always went: info and
warnings to stdout (the training log), errors to stderr. The streams are looked up per line, so a
redirected ``sys.stdout`` (pytest's capture, a notebook) gets them.

``setup(level, rank)`` is called where a process starts (``fsdp2lab train``, and ``run_rank`` once
the rank is known). Before it, or in a program that never calls it, the level is info and the
rank is the process group's, else ``$RANK``, else 0.
"""

from __future__ import annotations

import logging
import os
import sys

LEVELS = ("debug", "info", "warning", "error")
NAME = "fsdp2lab"
# ``log.error(..., extra=EVERY_RANK)``: prefix ``[rank N] `` on rank 0 too, for a line about what
# happened to this rank itself (its traceback, its crash), where rank 0's number matters as well.
EVERY_RANK = {"rank_prefix": True}


def _guess_rank() -> int:
    dist = sys.modules.get("torch.distributed")  # never import torch just to log
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _Output(logging.Handler):
    """The rank rule, the ``[rank N] `` prefix, and the stream by level."""

    def __init__(self) -> None:
        super().__init__()
        self.chosen = logging.INFO  # rank 0's level
        self.rank: int | None = None  # None: guess it per line
        self.setFormatter(logging.Formatter("%(message)s"))

    def current_rank(self) -> int:
        return self.rank if self.rank is not None else _guess_rank()

    def filter(self, record: logging.LogRecord) -> bool:
        rank = self.current_rank()
        lowest = self.chosen if rank == 0 else max(self.chosen, logging.WARNING)
        return record.levelno >= lowest and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            rank = self.current_rank()
            if rank != 0 or getattr(record, "rank_prefix", False):
                text = f"[rank {rank}] {text}"
            stream = sys.stderr if record.levelno >= logging.ERROR else sys.stdout
            stream.write(text + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


_output = _Output()
_logger = logging.getLogger(NAME)
_logger.addHandler(_output)
_logger.setLevel(logging.DEBUG)  # the handler decides, by rank
_logger.propagate = False  # the lines are the program's output: not twice under a root handler


def get_logger(name: str = NAME) -> logging.Logger:
    """The logger for module ``name`` (a child of ``fsdp2lab``, which holds the handler)."""
    return logging.getLogger(name)


def setup(level: str | None = None, rank: int | None = None) -> None:
    """Log at ``level`` (one of LEVELS) on rank 0, warnings and up on the other ranks.

    ``None`` keeps what an earlier call chose (at first: info, and the rank guessed per line).
    """
    if level is not None:
        if level.lower() not in LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
        _output.chosen = getattr(logging, level.upper())
    if rank is not None:
        _output.rank = rank
