"""Read the rank layout from the launcher's environment: torchrun, Slurm ``srun``, or none."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_PORT_BASE = 29500


@dataclass(frozen=True)
class LaunchEnv:
    mode: str  # "torchrun" | "slurm" | "standalone"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist such as ``gpu[01-03,7],cpu1`` into host names."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            for i in range(int(lo), int(hi) + 1):
                hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return hosts


def in_srun_step(env: os._Environ | dict) -> bool:
    """True inside an ``srun`` task (not the batch script itself, which also sees SLURM_PROCID)."""
    return "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and "SLURM_NTASKS" in env


def detect(env: os._Environ | dict | None = None) -> LaunchEnv:
    """The launch mode and rank layout of this process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            mode="torchrun",
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_PORT_BASE)),
        )
    if in_srun_step(env):
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        port = env.get("FSDP2LAB_MASTER_PORT") or env.get("MASTER_PORT")
        return LaunchEnv(
            mode="slurm",
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
            master_port=int(port) if port else 20000 + job_id % 20000,
        )
    return LaunchEnv(
        "standalone", rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0
    )


def local_only(launch: LaunchEnv, env: os._Environ | dict | None = None) -> bool:
    """A job of this machine alone, started without a launcher or by fsdp2lab's own (not
    torchrun, not srun): its ranks reach each other over loopback only."""
    env = os.environ if env is None else env
    return launch.mode == "standalone" or env.get("FSDP2LAB_LAUNCHED_BY") == "fsdp2lab"


def export(launch: LaunchEnv) -> None:
    """Set the variables ``init_process_group(init_method='env://')`` reads."""
    os.environ.update(
        RANK=str(launch.rank),
        WORLD_SIZE=str(launch.world_size),
        LOCAL_RANK=str(launch.local_rank),
        MASTER_ADDR=launch.master_addr,
        MASTER_PORT=str(launch.master_port),
    )
