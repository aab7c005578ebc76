"""The all-gathers and reduce-scatters FSDP2 uses on CPU: the gloo rings
(fsdp2lab.parallel.gloo_ring) and shared memory (fsdp2lab.parallel.shm_collectives)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import cli_env
from fsdp2lab.parallel.shm_collectives import ShmBarrier

pytestmark = pytest.mark.compat  # .ci/run runs these again on other torch versions

SCRIPT = Path(__file__).parent / "scripts" / "check_cpu_collectives.py"


@pytest.mark.parametrize("ranks", [2, 4])
def test_cpu_collectives_equal_gloo_builtin_ones(tmp_path, ranks):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(SCRIPT), str(tmp_path)],
        capture_output=True, text=True, env=cli_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert sorted(r["rank"] for r in reports) == list(range(ranks))
    for report in reports:
        failed = [name for name, ok in report["checks"].items() if not ok]
        assert not failed, f"rank {report['rank']}: {failed}"
        # world and, on 4 ranks, the 2-rank shard groups of a 2 x 2 mesh: ring, shm (with its
        # barrier and with gloo's) and shm's fallback, each 4 sizes x 2 repeats x (2 AG + 2 RS);
        # shm's deferred all-gathers (8 AG, 1 RS), with either barrier; reduce-scatters into
        # leased slots (5 x 3), with either barrier and in the fallback; host_collectives'
        # all-gather and 3 all-reduces of 4 tensors, likewise; all-gathers into held slots
        # (6 x 3 + 1), likewise
        assert len(report["checks"]) == (4 * 32 + 2 * 9 + 3 * 15 + 3 * 16 + 3 * 19) * (
            2 if ranks == 4 else 1
        )
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        assert report["shm_barrier"] == {"native": x86, "shm": x86, "shm-gloo-barrier": False}
        assert report["left_in_dev_shm"] == []
        # an FSDP2 step with 4 units and the root: 13 collectives, 10 barriers
        assert report["fsdp2_barriers_per_step"] in (10, None)
        # its 5 reduce-scatters' inputs and 8 all-gathers' outputs, written into leased slots,
        # published without a copy
        assert report["fsdp2_published_in_place_per_step"] in (13, None)
        in_group_of_rank1 = ranks == 2 or report["rank"] in (0, 1)
        expected = {}
        for n, usable_without_rank1 in [(ranks, False)] + [(2, not in_group_of_rank1)] * (
            ranks == 4
        ):
            expected |= {f"n={n} shm": True, f"n={n} shm-gloo-barrier": True}
            expected[f"n={n} rank 1 without /dev/shm"] = usable_without_rank1
            expected[f"n={n} host, rank 1 without /dev/shm"] = usable_without_rank1
        assert report["usable"] == expected
    # the fallback was said once per rank that could not share, not silently
    assert "shared-memory collectives off" in proc.stdout + proc.stderr


def test_shm_barrier_waits_for_every_rank_and_names_a_late_one():
    counts = [memoryview(bytearray(8)).cast("q") for _ in range(3)]
    barrier = ShmBarrier(counts, rank=0, group=None, timeout_s=0.2)
    late = threading.Timer(0.05, lambda: [c.__setitem__(0, 1) for c in counts[1:]])
    late.start()
    started = time.perf_counter()
    barrier.wait(1)  # ranks 1 and 2 arrive 50 ms later
    assert time.perf_counter() - started >= 0.04
    assert list(counts[0]) == [1]
    counts[1][0] = 2  # rank 2 never arrives at the second
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[2\] did not arrive within 0 s"):
        barrier.wait(2)
