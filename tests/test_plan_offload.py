"""``fsdp2lab plan --cpu-offload``: FSDP2's ``CPUOffloadPolicy`` planned.

A tiny gpt (fp32, AdamW) on 2 ranks, with and without ``--cpu-offload``, its figures counted
here from the model's parameters: a rank's shard of N parameters is 4 N / 2 bytes, its AdamW
state twice that and a 4-byte step count per tensor. Offloaded, those and the sharded gradients
are in host memory; the device peak (activation-bound here: no gradient is live at it) falls by
the shards and the optimizer state, less one unit's shards copied to the device for its
all-gather (a block: the largest unit). A step copies every shard in for forward and the first
block's again for backward (the root and the last unit keep theirs gathered), and each gradient
shard out once; the step takes those bytes at the GPU's PCIe rates, and the optimizer's on the
host where its memory bandwidth is published.
"""

from __future__ import annotations

import json

import pytest

from fsdp2lab import cli
from fsdp2lab.scale.estimate import Hardware, estimate
from fsdp2lab.scale.gpus import GPUS
from fsdp2lab.scale.report import format_report, gib_text
from fsdp2lab.scale.simulate import simulate
from test_scale_plan import plan_of

RANKS = 2
GPT = ["--model", "gpt", "--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len",
       "64", "--batch-size", "8", "--optimizer", "adamw"]  # fmt: skip
# Published figures (scale/gpus.py's sources): pinned copies on an H100 node, 54.8 GB/s to the
# GPU and 46.8 back, of PCIe 5.0 x16's 63; the A100's link is PCIe 4.0 x16 (31.5 GB/s); the H100
# node's host memory, STREAM Triad 486.7 GB/s, shared by its ranks.
H2D, D2H = 54.8 / 63, 46.8 / 63
PCIE4, NODE_HOST_GBS = 31.5, 486.7


@pytest.fixture(scope="module")
def runs():
    plain, offloaded = plan_of(RANKS, GPT), plan_of(RANKS, [*GPT, "--cpu-offload"])
    return (
        plain,
        simulate(plain, device_type="cpu"),
        offloaded,
        simulate(offloaded, device_type="cpu"),
    )


@pytest.fixture(scope="module")
def counted(runs):
    """Bytes a rank holds, from the meta model's parameters."""
    model = runs[0].meta_model
    params = list(model.parameters())
    shard = 4 * sum(p.numel() for p in params) // RANKS
    block = 4 * sum(p.numel() for p in model.blocks["0"].parameters()) // RANKS
    return {"shard": shard, "optimizer": 2 * shard + 4 * len(params), "block": block}


def test_offload_keeps_the_state_on_the_host_and_off_the_device(runs, counted):
    _, plain, _, offloaded = runs
    shard, optimizer, block = counted["shard"], counted["optimizer"], counted["block"]
    assert plain.peak_by_category["grads"] == 0  # the peak is in forward: no gradient yet
    assert offloaded.peak_bytes == plain.peak_bytes - shard - optimizer + block
    assert not {"params", "grads", "optimizer_state"} & offloaded.peak_by_category.keys()
    assert offloaded.offload == {
        "host_bytes": 2 * shard + optimizer,
        "h2d_bytes": shard + block,
        "d2h_bytes": shard,
        "shard_copy_bytes": block,
    }
    assert offloaded.phases[0].host_bytes == 2 * shard + optimizer
    # Without it, as before: the state on the device, nothing on the host.
    assert plain.offload == {} and plain.phases[0].host_bytes == 0
    assert plain.peak_by_category["params"] == shard
    assert plain.peak_by_category["optimizer_state"] == optimizer


def test_offload_step_time_adds_the_copies_and_the_host_step(runs, counted):
    plain_plan, plain, plan, offloaded = runs
    shard, optimizer, block = counted["shard"], counted["optimizer"], counted["block"]
    a100 = Hardware(GPUS["a100"], 8, 50.0)  # no host memory bandwidth published for its hosts
    before, after = estimate(plain_plan, plain, a100), estimate(plan, offloaded, a100)
    copies_s = (shard + block) / (PCIE4 * H2D * 1e9) + shard / (PCIE4 * D2H * 1e9)
    device_optimizer_s = before["time"]["optimizer_s"]
    assert after["time"]["step_s"] == pytest.approx(
        before["time"]["step_s"] - device_optimizer_s + copies_s, rel=1e-12
    )
    assert after["offload"]["host_optimizer_s"] is None and "offload" not in before
    h100 = Hardware(GPUS["h100"], 8, 50.0)
    before, after = estimate(plain_plan, plain, h100), estimate(plan, offloaded, h100)
    fused_adamw = 2 * shard + shard + 2 * optimizer  # parameters and state read and written
    host_s = fused_adamw / (NODE_HOST_GBS / RANKS * 1e9)
    copies_s = (shard + block) / (63 * H2D * 1e9) + shard / (63 * D2H * 1e9)
    assert after["time"]["step_s"] == pytest.approx(
        before["time"]["step_s"] - before["time"]["optimizer_s"] + copies_s + host_s, rel=1e-12
    )
    # the sharded gradients are on the host: none kept in the device's reduce-scatter pool
    assert after["memory"]["reserved_bytes_estimate"] == int(offloaded.peak_bytes * 1.144)


def test_cli_reports_host_memory_and_offload_as_modelled(capsys, counted):
    argv = ["plan", *GPT, "--world-size", str(RANKS), "--gpu", "rtx4090", "--cpu-offload"]
    assert cli.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["host_bytes_per_rank"] == 2 * counted["shard"] + counted["optimizer"]
    assert report["not_modelled"] == [] and "--cpu-offload" in report["modelled"]
    assert report["gpu"]["hbm_gib"] == 24564 / 1024
    text = format_report(report)
    host = gib_text(2 * counted["shard"] + counted["optimizer"])
    assert f"--cpu-offload: host memory {host} a rank" in text
    assert "time uncharacterized" in text  # a desktop's host: no published bandwidth


@pytest.mark.hf
def test_a_lora_optimizer_steps_only_the_adapters(counted):
    """A LoRA's optimizer, on the host, moves its adapters' bytes (their fp32 shards and
    gradients, read; the shards and AdamW state, read and written), not the frozen base's."""
    pytest.importorskip("peft")
    from fsdp2lab.models.lora import is_adapter

    plan = plan_of(RANKS, [*GPT, "--lora-rank", "4", "--lora-targets", "wq,wv", "--cpu-offload"])
    adapters = [p for n, p in plan.meta_model.named_parameters() if is_adapter(n)]
    shard = 4 * sum(p.numel() for p in adapters) // RANKS
    state = 2 * shard + 4 * len(adapters)
    run = simulate(plan, device_type="cpu")
    offload = estimate(plan, run, Hardware(GPUS["h100"], 8, 50.0))["offload"]
    assert offload["host_optimizer_bytes"] == 3 * shard + 2 * state


def test_search_with_offload_is_refused_in_one_line(capsys):
    model = GPT[: GPT.index("--batch-size")]  # --search chooses the batch
    argv = ["plan", *model, "--world-size", str(RANKS), "--cpu-offload", "--search"]
    assert cli.main([*argv, "--global-batch-size", "16"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "fsdp2lab: error: fsdp2lab plan --search does not search --cpu-offload layouts yet: "
        "plan one layout without --search"
    ]
