"""The all-gathers and reduce-scatters FSDP2 uses on CPU: the gloo rings
(fsdp2lab.parallel.gloo_ring) and shared memory (fsdp2lab.parallel.shm_collectives)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

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
        # world and, on 4 ranks, the 2-rank shard groups of a 2 x 2 mesh: ring, shm and shm's
        # fallback, each 4 sizes x 2 repeats x (2 AG + 2 RS); shm's deferred all-gathers (8 AG,
        # 1 RS)
        assert len(report["checks"]) == (3 * 32 + 9) * (2 if ranks == 4 else 1)
        assert report["left_in_dev_shm"] == []
        # an FSDP2 step with 4 units and the root: 13 collectives, 10 barriers
        assert report["fsdp2_barriers_per_step"] in (10, None)
        in_group_of_rank1 = ranks == 2 or report["rank"] in (0, 1)
        expected = {f"n={ranks}": True, f"n={ranks} rank 1 without /dev/shm": False}
        if ranks == 4:
            expected |= {"n=2": True, "n=2 rank 1 without /dev/shm": not in_group_of_rank1}
        assert report["usable"] == expected
    # the fallback was said once per rank that could not share, not silently
    assert "shared-memory collectives off" in proc.stdout + proc.stderr
