"""Light commands stay light: ``fsdp2lab --help``, ``data prepare``, ``ckpt info`` and ``report``
import torch only where they use it (each check in a fresh interpreter: this one holds torch)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_env

# Runs ARGV through the CLI, then prints the heavy packages it imported and its peak resident
# memory (VmHWM: not ru_maxrss, which a child inherits from its parent across fork and exec).
CHILD = """
import json, re, sys
from fsdp2lab import cli
rc = cli.main(sys.argv[1:]) if sys.argv[1:] else 0
cli.build_parser()  # every command's options
heavy = [m for m in ("torch", "transformers") if m in sys.modules]
peak = re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]
print(json.dumps({"heavy": heavy, "peak_kb": int(peak)}))
sys.exit(rc)
"""


def child(*argv: str) -> tuple[int, list[str], float, str]:
    """(exit code, heavy packages imported, peak MB, stderr) of ``fsdp2lab ARGV``."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, env=cli_env()
    )
    assert proc.stdout.strip(), proc.stderr
    last = json.loads(proc.stdout.splitlines()[-1])
    return proc.returncode, last["heavy"], last["peak_kb"] / 1024, proc.stderr


def test_the_parser_of_every_command_imports_no_torch():
    code, heavy, _, err = child()
    assert code == 0 and heavy == [], err


def test_help_answers_in_under_a_second():
    """Wall time of ``python -m fsdp2lab --help``, the best of three (the machine is shared)."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "fsdp2lab", "--help"],
            capture_output=True,
            text=True,
            env=cli_env(),
        )
        times.append(time.perf_counter() - start)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: fsdp2lab"), proc.stderr
    print(f"[fsdp2lab --help] {min(times):.2f} s")
    assert min(times) < 1.0, times


def test_data_prepare_peaks_under_200_mb_without_torch_or_transformers(tmp_path):
    pytest.importorskip("tokenizers")
    from test_hf_tokens import documents, make_tokenizer

    tokenizer = make_tokenizer(tmp_path / "tok")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(2000)))
    out = tmp_path / "out"
    code, heavy, peak_mb, err = child(
        "data", "prepare", "--tokenizer", str(tokenizer), "--input", str(corpus),
        "--out", str(out), "--progress", "off",
    )  # fmt: skip
    assert code == 0, err
    print(f"[data prepare] peak RSS {peak_mb:.0f} MB")
    assert peak_mb < 200 and heavy == []
    assert json.loads((out / "tokens.json").read_text())["documents"] == 2000


def test_ckpt_info_and_report_import_torch_only_to_read_a_checkpoint(tmp_path):
    """``ckpt info`` of no checkpoint answers without torch (reading one's metadata needs it);
    ``report`` of metrics files never needs it."""
    code, heavy, _, err = child("ckpt", "info", str(tmp_path / "nothing"))
    assert code == 2 and heavy == [] and "checkpoint not found" in err, err
    runs = []
    for name, loss in (("a", 2.0), ("b", 1.5)):
        path = tmp_path / f"{name}.jsonl"
        lines = [{"event": "step", "step": s, "time": 10.0 + s, "loss": loss / s} for s in (1, 2)]
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        runs.append(str(path))
    plot = tmp_path / "curves.png"
    code, heavy, _, err = child("report", *runs, "--out", str(plot))
    assert code == 0 and heavy == [] and Path(plot).read_bytes()[:4] == b"\x89PNG", err
