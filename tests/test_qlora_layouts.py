"""QLoRA (``--quantize-base nf4``) with ``--cpu-offload`` and with ``--compile``: 16 steps of a tiny
gpt on FSDP2 over 2 ranks follow the same run without them, step by step: offload moves the NF4
shards and the adapters' state to the host and changes no value (bit for bit); the compiled units
(torchao's NF4 under inductor) follow the eager ones within fp32 rounding. On a GPU,
``tests/test_gpu.py`` runs the offloaded one (pinned host memory, copies to the device).
"""

from __future__ import annotations

import pytest

from conftest import assert_close_lists, train

pytestmark = [pytest.mark.hf]
pytest.importorskip("torchao")
pytest.importorskip("peft")

# d_model 256: every projection holds a multiple of 2 x 16,384 values (two ranks' NF4 blocks).
QLORA = ["--model", "gpt", "--d-model", "256", "--n-layers", "2", "--n-heads", "4", "--seq-len",
         "16", "--dataset", "synthetic", "--synthetic-size", "256", "--global-batch-size", "16",
         "--max-steps", "16", "--lora-rank", "4", "--lora-targets", "wq,wk,wv,wo,up,down",
         "--quantize-base", "nf4", "--optimizer",
         "adamw", "--lr", "1e-2", "--log-every-steps", "1", "--progress", "off", "--dropout", "0",
         "--nproc-per-node", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return train(tmp_path_factory.mktemp("qlora-eager"), *QLORA, name="eager")


def test_qlora_with_cpu_offload_equals_without_bit_for_bit(eager, tmp_path):
    offloaded = train(tmp_path, *QLORA, "--cpu-offload", name="offload")
    assert len(offloaded.step_losses) == 16
    assert offloaded.step_losses == eager.step_losses
    assert eager.step_losses[-1] < eager.step_losses[0]


def test_qlora_compiled_follows_eager(eager, tmp_path):
    compiled = train(tmp_path, *QLORA, "--compile", name="compiled")
    assert_close_lists(compiled.step_losses, eager.step_losses, 1e-5)
