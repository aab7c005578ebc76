"""A standalone run listens on loopback only: its rendezvous store and gloo's sockets."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import TINY, cli_env
from fsdp2lab.runtime import torch_compat
from fsdp2lab.runtime.launch_env import LaunchEnv, detect, local_only

LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc writes them


def _children(pid: int) -> set[int]:
    """``pid`` and its descendants."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    tree, grown = {pid}, True
    while grown:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grown = bool(more)
    return tree


def _outward_interface() -> str | None:
    """An interface with an IPv4 address other than loopback, or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if not socket.inet_ntoa(raw[20:24]).startswith("127."):
            return name
    return None


def _listening(pids: set[int]) -> set[str]:
    """``address:port`` (hex, as /proc/net/tcp has it) of the TCP sockets ``pids`` listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.add(cols[1])
    return found


@pytest.mark.compat
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_standalone_run_listens_on_loopback_only(tmp_path):
    cmd = [sys.executable, "-m", "fsdp2lab", "train", "--nproc-per-node", "2", "--model", "mlp",
           *TINY, "--max-steps", "3", "--global-batch-size", "32"]  # fmt: skip
    # Each step waits, so the job's sockets are seen while it trains. A GLOO_SOCKET_IFNAME left
    # in the environment for multi-node jobs (a real interface, not loopback) must not apply.
    env = cli_env({"FSDP2LAB_STEP_DELAY_S": "0.3"})
    if other := _outward_interface():
        env["GLOO_SOCKET_IFNAME"] = other
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= _listening(_children(proc.pid))
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert seen, "no listening socket seen: the run ended before it was watched"
    exposed = sorted(s for s in seen if s.partition(":")[0] not in LOOPBACK)
    assert not exposed, f"listening beyond loopback: {exposed} (all: {sorted(seen)})"


def test_only_a_job_fsdp2lab_starts_is_local():
    torchrun = LaunchEnv("torchrun", 0, 2, 0, "10.0.0.1", 29500)  # also srun's and the launcher's
    assert not local_only(torchrun, {})
    assert local_only(torchrun, {"FSDP2LAB_LAUNCHED_BY": "fsdp2lab"})
    assert local_only(detect({}), {})  # one process, no launcher
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    assert not local_only(detect(slurm), slurm)


@pytest.mark.compat
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
@pytest.mark.parametrize("takes_listen_fd", [True, False])
def test_loopback_store(monkeypatch, takes_listen_fd):
    """The store's server listens on 127.0.0.1; a torch whose TCPStore takes no bound socket
    still gets a working store (listening everywhere), and says so."""
    real = dist.TCPStore

    def without_listen_fd(*args, **kwargs):
        if "master_listen_fd" in kwargs:
            raise TypeError("__init__(): incompatible constructor arguments")
        return real(*args, **kwargs)

    if not takes_listen_fd:
        monkeypatch.setattr(dist, "TCPStore", without_listen_fd)
    monkeypatch.setattr(torch_compat, "_noticed", set())
    server = torch_compat.loopback_store(0, 1, True, timedelta(seconds=30))
    client = torch_compat.loopback_store(server.port, 1, False, timedelta(seconds=30))
    client.set("k", "v")
    assert server.get("k") == b"v"
    port = f"{server.port:04X}"
    addresses = {a.partition(":")[0] for a in _listening({os.getpid()}) if a.endswith(f":{port}")}
    if takes_listen_fd:
        assert addresses == {"0100007F"}
        assert not torch_compat._noticed
    else:
        assert addresses and not addresses <= LOOPBACK
        assert torch_compat._noticed == {"store-any-interface"}


def test_a_store_serves_on_the_listening_socket_it_is_handed():
    """fsdp2lab's launcher binds the store's port and hands rank 0 the socket: the port is held
    from the moment it is chosen (no other process can bind it: the control), and the store serves
    on it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(socket.SOMAXCONN)
    port = listener.getsockname()[1]
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    server = torch_compat.loopback_store(
        port, 1, True, timedelta(seconds=30), listen_fd=listener.detach()
    )
    client = torch_compat.loopback_store(port, 1, False, timedelta(seconds=30))
    client.set("k", "v")
    assert server.port == port and server.get("k") == b"v"
