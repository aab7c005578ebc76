"""What every command shares: one line for bad input, exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from fsdp2lab.errors import USAGE_EXIT_CODE, UsageError


def error(message: str) -> int:
    print(f"fsdp2lab: error: {message}", file=sys.stderr, flush=True)
    return USAGE_EXIT_CODE


def guarded(command: Callable[[argparse.Namespace], int | None]):
    """A command whose UsageError is one line on stderr and exit code 2 (else its code, or 0)."""

    def run(args: argparse.Namespace, argv: list[str]) -> int:
        try:
            return command(args) or 0
        except UsageError as e:
            return error(str(e))

    return run
