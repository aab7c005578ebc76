"""fsdp2lab.runtime.logs: the rank rule, the ``[rank N] `` prefix, the streams. In-process, plus
one 2-rank CPU run."""

from __future__ import annotations

import logging
import sys

import pytest

from conftest import TINY, train
from fsdp2lab.config import add_train_arguments, config_from_args
from fsdp2lab.runtime import logs

log = logs.get_logger("fsdp2lab.tests")


@pytest.fixture(autouse=True)
def restore_logs():
    """Each test sets the process-wide logger up its own way; put it back afterwards."""
    before = logs._output.chosen, logs._output.rank
    yield
    logs._output.chosen, logs._output.rank = before


def _emit_all() -> None:
    log.debug("d")
    log.info("Train Epoch: 1 \tLoss: 0.5")
    log.warning("fsdp2lab: warning: w")
    log.error("fsdp2lab: error: e")


def test_rank_0_logs_at_its_level_plain_info_and_warnings_on_stdout_errors_on_stderr(capsys):
    logs.setup("info", 0)
    _emit_all()
    out, err = capsys.readouterr()
    assert out == "Train Epoch: 1 \tLoss: 0.5\nfsdp2lab: warning: w\n"
    assert err == "fsdp2lab: error: e\n"

    logs.setup("debug", 0)
    log.debug("d")
    assert capsys.readouterr().out == "d\n"

    logs.setup("warning", 0)
    _emit_all()
    out, err = capsys.readouterr()
    assert out == "fsdp2lab: warning: w\n" and err == "fsdp2lab: error: e\n"

    logs.setup("error", 0)
    _emit_all()
    assert capsys.readouterr() == ("", "fsdp2lab: error: e\n")


def test_other_ranks_log_warnings_and_errors_only_prefixed(capsys):
    logs.setup("debug", 3)
    _emit_all()
    out, err = capsys.readouterr()
    assert out == "[rank 3] fsdp2lab: warning: w\n"
    assert err == "[rank 3] fsdp2lab: error: e\n"
    logs.setup("error", 3)  # a stricter level holds on every rank
    _emit_all()
    assert capsys.readouterr() == ("", "[rank 3] fsdp2lab: error: e\n")


def test_setup_keeps_what_it_is_not_given(capsys):
    logs.setup("warning", 0)
    logs.setup(rank=2)  # what run_rank does after the train command chose the level
    log.warning("w")
    log.info("hidden")
    assert capsys.readouterr().out == "[rank 2] w\n"
    with pytest.raises(ValueError, match="must be one of debug, info, warning, error"):
        logs.setup("loud")


def test_every_rank_lines_and_tracebacks_read_as_the_prints_did(capsys):
    logs.setup("info", 0)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import traceback

        expected = f"[rank 0] failed:\n{traceback.format_exc()}"
        log.error("failed:", exc_info=True, extra=logs.EVERY_RANK)
    assert capsys.readouterr().err == expected
    logs.setup(rank=1)
    log.warning("dying mid-save", extra=logs.EVERY_RANK)  # one prefix, not two
    assert capsys.readouterr().out == "[rank 1] dying mid-save\n"


def test_without_setup_the_rank_is_taken_from_the_environment(monkeypatch, capsys):
    logs._output.rank = None
    monkeypatch.setenv("RANK", "1")
    log.info("hidden")
    log.warning("w")
    assert capsys.readouterr().out == "[rank 1] w\n"


def test_lines_do_not_reach_the_root_logger(capsys):
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stdout)
    root.addHandler(handler)
    try:
        logs.setup("info", 0)
        log.info("once")
    finally:
        root.removeHandler(handler)
    assert capsys.readouterr().out == "once\n"


def test_log_level_is_a_train_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert config_from_args(parser.parse_args([])).log_level == "info"
    assert config_from_args(parser.parse_args(["--log-level", "warning"])).log_level == "warning"
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "loud"])


# ----------------------------------------------------------------------- 2 ranks, real run
def test_a_rank_1_warning_is_prefixed_and_log_level_warning_hides_info(tmp_path):
    run = train(
        tmp_path, "--model", "mlp", *TINY, "--max-steps", "1", "--nproc-per-node", "2",
        "--ckpt-dir", "ckpt", "--ckpt-every-steps", "1", "--log-level", "warning",
        env={"FSDP2LAB_CKPT_CRASH_AT": "1:1"}, check=False, timeout=180,
    )  # fmt: skip
    assert run.returncode == 43, run.stdout + run.stderr
    assert "[rank 1] dying mid-save (FSDP2LAB_CKPT_CRASH_AT)\n" in run.stdout
    for info in ("fsdp2lab: resolved config", "Train Epoch", "fsdp2lab: checkpoint"):
        assert info not in run.stdout
