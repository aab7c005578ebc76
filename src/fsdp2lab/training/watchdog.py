"""Find a rank that stopped responding (hung, SIGSTOPped, dead, cut off) and end the job with one line.

On every rank a daemon thread beats: it writes ``"<count>:<step>"`` to its key in the c10d store
(its own client connection to ``MASTER_ADDR:MASTER_PORT``) and reads the beats it watches: rank 0
watches every rank, rank 1 watches rank 0. A second thread, which never blocks on I/O, judges: a
rank whose beat has not changed for half of ``--collective-timeout`` (by the watcher's own clock,
so clocks need not agree) is reported by that one watcher, ``rank 1 stopped responding at step 412
(no heartbeat for 60 s)``, and the watcher exits with ``EXIT_CODE``; the launcher (ours, torchrun,
srun) ends the others. A store that stops answering (it lives in rank 0's process when rank 0
hosts it) freezes every beat read through it, so rank 1 reports rank 0. Half the timeout: the
report comes before any collective waiting on that rank times out.

A rank blocked in a collective, waiting on a slow peer, still beats: only the peer is reported.
``Watchdog`` is also the hook that tells the beats the step, and that shortens the process groups'
timeouts from the start-up one to ``--collective-timeout`` when the first epoch starts."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from fsdp2lab.runtime import distributed, logs
from fsdp2lab.runtime.distributed import Runtime
from fsdp2lab.training.hooks import Hooks

if TYPE_CHECKING:
    from fsdp2lab.training.trainer import Trainer

log = logs.get_logger(__name__)


EXIT_CODE = 3
DONE = "done"


class Watchdog(Hooks):
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.limit = runtime.collective_timeout_s / 2
        self.interval = min(max(self.limit / 10, 0.1), 5.0)
        self.step = 0
        self.beats = 0
        self.timeouts_shortened = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # rank -> (its last beat, when that changed by this clock)
        self.seen: dict[int, tuple[bytes | None, float]] = {}
        rank, world = runtime.rank, runtime.world_size
        self.watched = list(range(1, world)) if rank == 0 else [0] if rank == 1 else []

    @classmethod
    def start(cls, runtime: Runtime) -> Watchdog:
        """Beat (and watch) from a daemon thread; a no-op for a single rank."""
        dog = cls(runtime)
        if runtime.world_size > 1:
            try:
                store = dist.TCPStore(
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    is_master=False,
                    timeout=timedelta(seconds=max(dog.interval * 2, 1.0)),
                    wait_for_workers=False,
                )
                dog.store = dist.PrefixStore("fsdp2lab-heartbeat", store)
                dog._beat()
            except Exception as e:  # training works without it; only hangs are found later
                if runtime.is_main:
                    log.warning(
                        f"fsdp2lab: warning: no watchdog, the c10d store is unreachable: {e}"
                    )
                return dog
            now = time.monotonic()
            dog.seen = {r: (None, now) for r in dog.watched}
            dog._threads = [
                threading.Thread(
                    target=target, name=f"fsdp2lab-watchdog{target.__name__}", daemon=True
                )
                for target in (dog._exchange, dog._judge)
            ]
            for thread in dog._threads:
                thread.start()
        return dog

    def stop(self) -> None:
        """This rank is done: say so (watchers then ignore it) and stop the thread."""
        if not self._threads:
            return
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)  # the exchange may be blocked on a stopped store
        self._threads = []
        with contextlib.suppress(Exception):  # rank 0's store may be gone: nobody watches then
            self.store.set(str(self.runtime.rank), DONE)

    # ------------------------------------------------------------------ hooks
    def epoch_started(self, trainer: Trainer) -> None:
        if not self.timeouts_shortened and self.runtime.world_size > 1:
            distributed.shorten_timeouts(self.runtime)
        self.timeouts_shortened = True

    def after_step(self, trainer: Trainer) -> None:
        self.step = trainer.state.step

    # ------------------------------------------------------------------ thread
    def _beat(self) -> None:
        self.beats += 1
        self.store.set(str(self.runtime.rank), f"{self.beats}:{self.step}")

    def _exchange(self) -> None:
        """Beat, and read the watched ranks' beats (a call may block while the store is stopped)."""
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # the judge notices when nothing changes
                self._beat()
                for r in self.watched:
                    value = self.store.get(str(r)) if self.store.check([str(r)]) else None
                    if value != self.seen[r][0]:
                        self.seen[r] = (value, time.monotonic())

    def _judge(self) -> None:
        """Report a watched rank whose beat has not changed for ``limit`` (never blocks)."""
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            for r, (value, since) in list(self.seen.items()):
                if value != DONE.encode() and now - since > self.limit:
                    self._report(r, value, now - since)

    def _report(self, rank: int, value: bytes | None, silent_s: float) -> None:
        if self._stop.is_set():
            return
        step = value.decode().split(":")[1] if value else "?"
        log.error(
            f"fsdp2lab: error: rank {rank} stopped responding at step {step} "
            f"(no heartbeat for {silent_s:.0f} s); ending the job"
        )
        os._exit(EXIT_CODE)
