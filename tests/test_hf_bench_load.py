"""scripts/bench_hf_load.py on a tiny saved Llama: it runs, its figures are consistent, and the
memory bound holds (the timings are figures for docs/own-model.md, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

pytestmark = [pytest.mark.hf]
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_hf_load.py"


@pytest.mark.parametrize("reader", ["auto", "slices"])
def test_bench_hf_load_reports_memory_and_speed_per_rank(tmp_path, reader):
    from test_hf_pretrained import save_llama

    folder = save_llama(tmp_path / "llama", tied=False)
    report_file = tmp_path / "out" / "report.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(folder), "--reader", reader, "--json", str(report_file)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(report_file.read_text())
    files = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert report["file_bytes"] == files and report["reader"] == reader
    assert report["load_s"] > 0 and report["raw_read_s"] > 0
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    # Each rank holds half of the fp32 weights (the files are fp32 here).
    assert sum(r["fp32_shard"] for r in ranks) == pytest.approx(files, rel=0.05)  # + headers
    assert all(r["bound"] == 1.2 * r["fp32_shard"] + r["largest_tensor_fp32"] for r in ranks)
    assert report["memory_within_bound"] is (all(r["rss_anon_growth"] <= r["bound"] for r in ranks))
    assert "RssAnon growth" in proc.stdout and "% of raw" in proc.stdout
