"""Per-rank device and process group: ``cuda:LOCAL_RANK`` + nccl where GPUs exist, else cpu + gloo."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from fsdp2lab.errors import UsageError
from fsdp2lab.runtime.launch_env import LaunchEnv, export, local_only
from fsdp2lab.runtime.local_launcher import STORE_FD
from fsdp2lab.runtime.torch_compat import loopback_store, process_groups, set_group_timeout


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    collective_timeout_s: float = 120.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for, but no CUDA device is available")
    if local_rank >= torch.cuda.device_count():
        raise UsageError(
            f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}"
        )
    return torch.device("cuda", local_rank)


# Start-up (rendezvous, data download, checkpoint load) and checkpoint I/O wait at least this long.
IO_TIMEOUT_S = 600.0
_io_groups: list = []


def io_timeout(collective_timeout_s: float) -> timedelta:
    return timedelta(seconds=max(collective_timeout_s, IO_TIMEOUT_S))


def new_io_group(runtime: Runtime) -> dist.ProcessGroup:
    """A gloo group for slow work (checkpoint saves) that keeps the long timeout."""
    group = dist.new_group(backend="gloo", timeout=io_timeout(runtime.collective_timeout_s))
    _io_groups.append(group)
    return group


def shorten_timeouts(runtime: Runtime) -> None:
    """Once training starts: every group but the I/O ones waits at most --collective-timeout."""
    timeout = timedelta(seconds=runtime.collective_timeout_s)
    for group in process_groups():
        if group not in _io_groups and dist.get_rank(group) >= 0:
            set_group_timeout(group, timeout)


def init(
    launch: LaunchEnv, device_preference: str = "auto", collective_timeout_s: float = 120.0
) -> Runtime:
    """Start the process group for this rank (a one-rank group for a single process), with the
    long start-up timeout; ``shorten_timeouts`` applies ``collective_timeout_s`` later."""
    export(launch)
    device = pick_device(device_preference, launch.local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = io_timeout(collective_timeout_s)
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    if local_only(launch):
        kwargs["store"] = _loopback_only(launch, timeout)
    dist.init_process_group(
        backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout, **kwargs
    )
    return Runtime(
        launch.rank, launch.world_size, launch.local_rank, device, backend, collective_timeout_s
    )


def _loopback_only(launch: LaunchEnv, timeout: timedelta) -> dist.Store:
    """A single-node job listens on loopback only: its rendezvous store (unauthenticated, and
    ranks exchange pickles through the process group), gloo's sockets and NCCL's bootstrap."""
    names = [name for _, name in socket.if_nameindex()]
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if loopback is not None:  # gloo binds the address of this interface (of the host name if unset)
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
        os.environ["NCCL_SOCKET_IFNAME"] = loopback  # NCCL's bootstrap (data: NVLink, PCIe)
    handed = os.environ.pop(STORE_FD, None)  # the socket fsdp2lab's launcher bound for rank 0
    listen_fd = int(handed) if handed is not None and launch.rank == 0 else None
    store = loopback_store(
        launch.master_port, launch.world_size, launch.rank == 0, timeout, listen_fd
    )
    os.environ["MASTER_PORT"] = str(store.port)  # the watchdog's client connects there
    return store


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this rank's process now, without interpreter teardown.

    A gloo worker thread releases each collective's work object after the caller has seen it
    complete, and that release takes the GIL. Where a process group outlives
    ``destroy_process_group`` (a model, mesh or optimizer still holds it) and the interpreter
    starts to finalize first, the thread cannot take the GIL and the process aborts
    ("terminate called without an active exception", exit -6) after the job has succeeded.
    Every rank's entry point (the CLI, the test and benchmark scripts) ends here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def on_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 while the others wait; every rank gets its result, or its UsageError.

    For decisions that must be taken once (download a dataset, pick a checkpoint) and that every
    rank must then act on identically, failures included.
    """
    box: list = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            box[0] = fn()
        except UsageError as e:
            box[0] = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UsageError):
        raise box[0]
    return box[0]
