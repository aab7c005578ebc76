"""The ring all-gather and reduce-scatter FSDP2 uses on gloo (fsdp2lab.parallel.gloo_ring)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

pytestmark = pytest.mark.compat  # .ci/run runs these again on other torch versions

SCRIPT = Path(__file__).parent / "scripts" / "check_gloo_ring.py"


@pytest.mark.parametrize("ranks", [2, 4])
def test_ring_collectives_equal_gloo_builtin_ones(tmp_path, ranks):
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
        # world and, on 4 ranks, the 2-rank shard groups of a 2 x 2 mesh: 3 sizes x (AG + 2 RS)
        assert len(report["checks"]) == 9 * (2 if ranks == 4 else 1)
