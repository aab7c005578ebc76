"""Run one rank's work: start the process group, report errors once, always destroy the group.

Bad input (UsageError) is detected identically on every rank, so only rank 0 prints it and every
rank exits with code 2; so with a TrainingFailed that all ranks agree on (exit code 1). Any other exception is printed by the rank that raised it. A rank that fails
only because a peer died (its collective broke) prints one line, not a second traceback.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from fsdp2lab.errors import USAGE_EXIT_CODE, TrainingFailed, UsageError
from fsdp2lab.runtime import distributed, logs
from fsdp2lab.runtime.distributed import Runtime
from fsdp2lab.runtime.launch_env import LaunchEnv

log = logs.get_logger(__name__)

_PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
)


def _is_peer_failure(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        marker in text for marker in _PEER_FAILURE_MARKERS
    )


def run_rank(
    launch: LaunchEnv,
    device: str,
    work: Callable[[Runtime], None],
    collective_timeout_s: float = 120.0,
) -> int:
    """Run ``work`` on this rank; return the process exit code."""
    logs.setup(rank=launch.rank)
    try:
        runtime = distributed.init(launch, device, collective_timeout_s)
        work(runtime)
        return 0
    except (UsageError, TrainingFailed) as e:
        if launch.rank == 0:
            log.error(f"fsdp2lab: error: {e}")
        return USAGE_EXIT_CODE if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if _is_peer_failure(e) and launch.world_size > 1:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            why = "another rank failed"
            if "Timed out" in first_line:
                why = (
                    f"a collective waited longer than --collective-timeout {collective_timeout_s:g}"
                )
            log.error(f"stopped: {why} ({first_line[:200]})", extra=logs.EVERY_RANK)
        else:
            log.error("failed:", exc_info=True, extra=logs.EVERY_RANK)
        return 1
    finally:
        distributed.destroy()
