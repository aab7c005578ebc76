"""``--quantize-base nf4`` on FSDP2 loads sharded: each rank reads only its rows of the weights
and quantizes them into its NF4 shard, bit for bit the shard of torchao's ``to_nf4`` of the whole
weight (tests/scripts/qlora_sharded.py on 2 gloo ranks; the script also runs HSDP, e.g. 4 ranks
with ``--dp-replicate 2``; tests/test_qlora.py trains QLoRA on HSDP 2 x 2).

* Random weights (bf16 and fp32, rows of growing scale): ``nf4.quantize_into`` of a rank's
  rows equals the shard of ``to_nf4`` of the whole weight, inner tensor by inner tensor; the
  negative control, ``to_nf4`` of the rows alone (their own scale mean), does not.
* A tiny bf16 Llama (``hf:``) built as training builds it: each rank reads (safetensors'
  ``get_slice``, every read counted) half the bytes of every quantized weight, and every NF4 shard
  equals that shard of ``to_nf4`` of the file's whole weight.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_env

pytestmark = [pytest.mark.hf]
pytest.importorskip("transformers")
pytest.importorskip("torchao")
pytest.importorskip("peft")

SCRIPT = Path(__file__).parent / "scripts" / "qlora_sharded.py"


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """Each rank's report of qlora_sharded.py on 2 ranks."""
    from test_hf_pretrained import save_llama

    where = tmp_path_factory.mktemp("qlora-sharded")
    # bf16, untied; hidden 256: every projection splits into whole NF4 blocks over 2 ranks
    folder = save_llama(where / "base", tied=False, dtype=torch.bfloat16, shard=None, hidden=256)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(SCRIPT), str(folder), str(where)]  # fmt: skip
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((where / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_shard_quantizes_as_the_whole_weight_and_its_own_mean_would_not(reports):
    for report in reports:
        assert set(report["random"]) == {"torch.bfloat16", "torch.float32"}
        for dtype, result in report["random"].items():
            assert result == {"equal": True, "own_mean_equal": False}, dtype


def test_each_rank_reads_only_its_rows_and_loads_the_whole_weights_nf4(reports):
    for report in reports:
        assert len(report["read"]) == 14  # 7 projections x 2 layers
        for key, sizes in report["read"].items():
            assert sizes["read"] * 2 == sizes["whole"], key  # half the rows
        assert report["loaded"] == dict.fromkeys(report["read"], True)
