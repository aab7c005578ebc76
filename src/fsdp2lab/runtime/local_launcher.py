"""Standalone launch: start N local worker processes, as the seed tutorial's ``mp.spawn`` did.

Each worker is ``python -m fsdp2lab <same arguments>`` with torchrun's environment variables, so
workers run exactly the code path they run under torchrun. The first worker to fail ends the rest:
the job never hangs, and its exit code is the failing worker's.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from fsdp2lab.runtime import logs

log = logs.get_logger(__name__)


_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The descriptor of the rendezvous store's listening socket, handed to rank 0 (runtime.distributed).
STORE_FD = "FSDP2LAB_STORE_FD"


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``python -m fsdp2lab *argv`` on ``nproc`` local ranks; return the job's exit code.

    The store's port is bound here and its socket handed to rank 0 (``STORE_FD``), so no other
    process can take the port between choosing it and rank 0's store listening on it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(socket.SOMAXCONN)
    port = str(listener.getsockname()[1])
    # As torchrun does: without this, N ranks each start one thread per core and oversubscribe.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    procs: list[subprocess.Popen] = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            FSDP2LAB_LAUNCHED_BY="fsdp2lab",
            OMP_NUM_THREADS=threads,
        )
        handed = (listener.fileno(),) if rank == 0 else ()
        if handed:
            env[STORE_FD] = str(listener.fileno())
        procs.append(
            subprocess.Popen([sys.executable, "-m", "fsdp2lab", *argv], env=env, pass_fds=handed)
        )
    listener.close()  # rank 0 holds it

    def forward(signum, _frame):  # preemption signals reach every worker
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {
        s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    }
    try:
        return _wait(procs)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(procs)


def _wait(procs: list[subprocess.Popen]) -> int:
    """Return 0 once every worker succeeded, else the exit code of the first worker to fail.

    One thread per worker blocks in ``wait()``, so exits are seen in the order they happen: a rank
    that dies (exit code 43, say) is reported, not the peer that stopped a moment later because its
    collective broke (exit code 1). Polling could see both at once and pick the wrong one.
    """
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for rank, p in enumerate(procs):
        threading.Thread(target=lambda r=rank, p=p: exits.put((r, p.wait())), daemon=True).start()
    for _ in procs:
        while True:
            try:  # a timeout keeps the main thread responsive to forwarded signals
                rank, code = exits.get(timeout=0.2)
                break
            except queue.Empty:
                continue
        if code > 0:
            return code
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else -code
            log.error(f"fsdp2lab: error: rank {rank} was killed by {name}")
            return 1
    return 0


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the workers still running, then kill any that ignore it."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
