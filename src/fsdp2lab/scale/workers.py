"""Simulations side by side, for ``plan --search``: each in a worker process of its own.

A simulation is Python-bound (every op dispatched through three modes) and needs a process without
a process group, so the search's independent simulations (a layout's shallow copies and pipeline
stages) run in spawned workers, one a CPU. A worker gets the layout's config, resolves the plan
itself (the same plan: ``resolve`` is deterministic), takes the shallow copy and simulates the
rank, and sends back the :class:`~fsdp2lab.scale.simulate.RoleRun`. Spawned, not forked: a fork
of a process that has run autograd's or OpenMP's threads can hang in the child.
``tests/test_plan_search.py`` checks a search with workers against one without.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import multiprocessing
import os
import time
from typing import TYPE_CHECKING

from fsdp2lab import consent

if TYPE_CHECKING:
    from fsdp2lab.config import TrainConfig
    from fsdp2lab.plan import RunPlan
    from fsdp2lab.scale.simulate import RoleRun


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Simulated in this process first, seconds: a worker takes seconds to start (it imports torch and
# the model's library), more than a small search takes.
INLINE_S = 10.0


class Simulations:
    """Simulates rank roles in ``workers`` spawned processes, started once this process has
    simulated for ``INLINE_S``; in this process where ``workers`` is 1. A context manager: the
    workers end with it."""

    def __init__(self, workers: int):
        self.workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._inline_s = 0.0

    @property
    def at_once(self) -> int:
        """How many simulations run side by side from now on."""
        return self.workers if self.workers > 1 and self._inline_s >= INLINE_S else 1

    def roles(self, plans: list[RunPlan], depths: list[int | None]) -> list[list[RoleRun]]:
        """Every rank role (``stage_ranks`` order) of each of ``plans`` at ``depths[i]`` layers a
        role (:func:`fsdp2lab.scale.layers.shallow`; None: all)."""
        from fsdp2lab.scale import layers
        from fsdp2lab.scale.simulate import simulate, stage_ranks

        jobs = [(i, rank) for i, plan in enumerate(plans) for rank in stage_ranks(plan)]
        if self.at_once == 1 or len(jobs) <= 1:
            start = time.perf_counter()
            plans = [
                p if d is None else layers.shallow(p, d) for p, d in zip(plans, depths, strict=True)
            ]
            runs = [simulate(plans[i], rank=rank) for i, rank in jobs]
            self._inline_s += time.perf_counter() - start
        else:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start, initargs=(consent.current(),),
                )  # fmt: skip
            args = [(plans[i].cfg, plans[i].world_size, depths[i], rank) for i, rank in jobs]
            runs = list(self._pool.map(_simulate, *zip(*args, strict=True)))
        out: list[list[RoleRun]] = [[] for _ in plans]
        for (i, _), run in zip(jobs, runs, strict=True):
            out[i].append(run)
        return out

    def __enter__(self) -> Simulations:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


def _start(given: consent.Consent) -> None:
    """A worker: the consent this command's line gave (it imports the same model), and torch on
    one thread (the CPUs are the workers')."""
    import torch

    consent.restore(given)
    torch.set_num_threads(1)


_plans: dict[tuple, RunPlan] = {}  # a worker's latest plans, by (config, world size, depth)
_heap = contextlib.ExitStack()  # the worker's heap, frozen once its first plan is made


def _simulate(cfg: TrainConfig, world_size: int, depth: int | None, rank: int) -> RoleRun:
    from fsdp2lab.plan import resolve
    from fsdp2lab.scale import layers
    from fsdp2lab.scale.simulate import frozen_heap, simulate

    key = (repr(cfg), world_size, depth)
    if key not in _plans:
        plan = resolve(cfg, world_size, "cuda")
        if not _plans:  # torch and the model's library imported: out of the collector's way
            _heap.enter_context(frozen_heap())
            # thawed at exit, so that the interpreter's last collection frees it (else
            # libraries that check for leaks at exit, as triton's bindings do, report them)
            atexit.register(_heap.close)
        if len(_plans) >= 4:
            del _plans[next(iter(_plans))]
        _plans[key] = plan if depth is None else layers.shallow(plan, depth)
    return simulate(_plans[key], rank=rank)
