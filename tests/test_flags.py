"""Bad flag values: one line from rank 0, exit code 2, before any worker starts."""

from __future__ import annotations

import pytest

from conftest import run_cli
from fsdp2lab import cli

BAD = [
    (["--lr", "-1"], "--lr must be >= 0, got -1.0"),
    (["--lr", "nan"], "--lr must be >= 0, got nan"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--log-every-steps", "0"], "--log-every-steps must be >= 1, got 0"),
    (["--gamma", "0"], "--gamma must be > 0, got 0.0"),
    (["--momentum", "1.5"], "--momentum must be in [0, 1), got 1.5"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be > 0, got 0.0"),
    (["--warmup-steps", "-3"], "--warmup-steps must be >= 0, got -3"),
    (["--num-workers", "-1"], "--num-workers must be >= 0, got -1"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--pp-microbatches", "0"], "--pp-microbatches must be >= 1, got 0"),
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["--ckpt-dir", "c", "--keep-last", "-1"], "--keep-last must be >= 0, got -1"),
    (["--collective-timeout", "0"], "--collective-timeout must be > 0, got 0.0"),
    (["--dp-shard", "0"], "--dp-shard must be >= 1 or -1 (the rest), got 0"),
    (
        ["--strategy", "fsdp1", "--mixed-precision", "fp16"],
        "--mixed-precision fp16 with --strategy fsdp1: the gradient scaler cannot agree across "
        "FSDP1's shards; use --strategy fsdp2 (its scaler checks every shard) or bf16",
    ),
]


@pytest.mark.parametrize(("flags", "message"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_flag_values_give_one_line_and_exit_2(flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *flags]) == 2
    out = capsys.readouterr()
    assert out.err == f"fsdp2lab: error: {message}\n"
    assert list(tmp_path.iterdir()) == []  # nothing written: no data, no checkpoint folder


def test_a_bad_value_under_several_ranks_prints_once(tmp_path):
    proc = run_cli(["train", "--nproc-per-node", "2", "--lr", "-1"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == "fsdp2lab: error: --lr must be >= 0, got -1.0\n"


GONE = "is no longer read: FSDP2 on CPU uses gloo's own all-gather and reduce-scatter"


@pytest.mark.parametrize("value", ["shm", "ring", "builtin"])
def test_the_retired_transport_is_one_line_and_exit_2(value, capsys, tmp_path, monkeypatch):
    """A config (or a flag) that still asks for the shared-memory or ring collectives."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.toml").write_text(f'model = "mlp"\ngloo_collectives = "{value}"\n')
    assert cli.main(["train", "--config", "old.toml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fsdp2lab: error: config file old.toml: gloo_collectives " + GONE), err
    assert err.count("\n") == 1
    assert cli.main(["train", "--gloo-collectives", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fsdp2lab: error: --gloo-collectives {GONE}") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.toml"]  # nothing else written
