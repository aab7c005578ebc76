"""Launch modes, failure handling and bad input, through the real command line."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from conftest import FASHION_DIR, TINY, assert_close_lists, cli_env, read_metrics, run_cli, train

RUN = [
    "--model",
    "mlp",
    *TINY,
    "--max-steps",
    "6",
    "--log-every-steps",
    "1",
    "--global-batch-size",
    "32",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # three 2-rank launches: the README's test command stays under 15 minutes
def test_three_launch_modes_train_identically(tmp_path):
    standalone = train(tmp_path, *RUN, "--nproc-per-node", "2", name="standalone")
    assert "Train Epoch: 1 \tLoss: " in standalone.stdout
    assert "Test set: Average loss: " in standalone.stdout and "Accuracy: " in standalone.stdout

    metrics = tmp_path / "torchrun.jsonl"
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "fsdp2lab", "train", *RUN, "--metrics-file", str(metrics)],
        env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]

    # srun-style: one task per rank with Slurm's variables, no launcher in between.
    srun_metrics = tmp_path / "srun.jsonl"
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = cli_env(
            {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), "SLURM_STEP_ID": "0",
             "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "localhost", "FSDP2LAB_MASTER_PORT": port}
        )  # fmt: skip
        cmd = [sys.executable, "-m", "fsdp2lab", "train", *RUN, "--metrics-file", str(srun_metrics)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:]
    assert "fsdp2 on 2 rank(s)" in outputs[0][0] and outputs[1][0] == ""  # rank 0 alone prints

    losses = [
        [r["loss"] for r in read_metrics(m) if r["event"] == "step"]
        for m in (metrics, srun_metrics)
    ]
    assert_close_lists(losses[0], standalone.step_losses, 0.0)
    assert_close_lists(losses[1], standalone.step_losses, 0.0)


def test_failing_rank_ends_the_job_quickly_with_its_error_once(tmp_path):
    start = time.monotonic()
    run = train(
        tmp_path, "--model", "mlp", *TINY, "--epochs", "50", "--nproc-per-node", "2",
        env={"FSDP2LAB_FAIL_AT": "1:3"}, check=False, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert time.monotonic() - start < 60
    assert run.stderr.count("injected failure on rank 1 at step 3") == 1
    assert run.stderr.count("Traceback") == 1


def test_the_job_exits_with_the_code_of_the_rank_that_failed_first():
    """Rank 1 exits 43; rank 0 exits 1 some 20 ms after its pipe from rank 1 closes (as a rank
    whose collective broke does). A launcher that polls could see both exits at once."""
    from fsdp2lab.runtime.local_launcher import _wait

    for _ in range(5):
        dies = subprocess.Popen(["sh", "-c", "sleep 0.3; exit 43"], stdout=subprocess.PIPE)
        follows = subprocess.Popen(
            ["sh", "-c", "cat >/dev/null; sleep 0.02; exit 1"], stdin=dies.stdout
        )
        dies.stdout.close()
        assert _wait([follows, dies]) == 43
        follows.wait()


def _usage_error(tmp_path, *args: str) -> str:
    proc = run_cli(["train", *args], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    return proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--nproc-per-node", "4", "--dp-replicate", "3"],
            "mesh does not fit: world size 4 is not divisible by dp_replicate=3",
        ),
        (
            ["--nproc-per-node", "2", "--dp-shard", "4"],
            "dp_replicate=1 x dp_shard=4 x tp=1 x pp=1 = 4, but the world size is 2",
        ),
        (
            ["--model", "resnet"],
            "unknown model 'resnet'; choose one of: cnn, mlp, mlp2, cifar-cnn, gpt",
        ),
        (
            ["--nproc-per-node", "2", "--global-batch-size", "33"],
            "--global-batch-size 33 is not divisible by data-parallel ranks 2",
        ),
        (["--model", "gpt", "--dataset", "mnist"], "dataset 'mnist' does not fit model 'gpt'"),
        (
            ["--model", "gpt", "--d-model", "30", "--n-heads", "4"],
            "--d-model 30 is not divisible by --n-heads 4",
        ),
        (
            ["--strategy", "single", "--nproc-per-node", "2"],
            "--strategy single runs in one process, but 2 ranks",
        ),
    ],
)
def test_bad_flags_give_one_clear_error(tmp_path, args, message):
    stderr = _usage_error(tmp_path, *args)
    assert message in stderr
    assert stderr.count("fsdp2lab: error:") == 1


def test_unknown_dataset_is_one_clear_error(tmp_path):
    stderr = _usage_error(tmp_path, "--dataset", "imagenet")
    assert "--dataset must be one of auto, mnist" in stderr and "not 'imagenet'" in stderr
    assert stderr.count("fsdp2lab: error:") == 1


def test_bad_toml_gives_one_clear_error(tmp_path):
    (tmp_path / "bad.toml").write_text("epochs = \n")
    stderr = _usage_error(tmp_path, "--config", "bad.toml")
    assert (
        "config file bad.toml is not valid TOML" in stderr and stderr.count("fsdp2lab: error:") == 1
    )


@pytest.mark.parametrize("no_download", [True, False], ids=["no-download", "download-fails"])
def test_missing_data_offline_names_files_and_places(tmp_path, no_download):
    # A proxy on a closed local port makes any download fail at once, with or without internet.
    env = {
        "http_proxy": "http://127.0.0.1:9",
        "https_proxy": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
    }
    args = [
        "train",
        "--model",
        "mlp",
        "--dataset",
        "mnist",
        "--data-dir",
        "empty",
        "--nproc-per-node",
        "2",
    ]
    proc = run_cli(
        args + (["--no-download"] if no_download else []), cwd=tmp_path, env=env, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("fsdp2lab: error: dataset mnist is not available") == 1
    assert "train-images-idx3-ubyte" in proc.stderr and "t10k-labels-idx1-ubyte" in proc.stderr
    assert "empty/MNIST/raw" in proc.stderr and "fsdp2lab data download mnist" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "empty").rglob("*-ubyte"))


def test_auto_dataset_explains_its_fallback(tmp_path):
    env = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    run = train(
        tmp_path,
        "--model",
        "mlp",
        "--data-dir",
        "empty",
        "--max-steps",
        "2",
        "--progress",
        "off",
        env=env,
    )
    expected = (
        "fashion-mnist from /usr/share/datasets/fashion-mnist"
        if FASHION_DIR.is_dir()
        else "synthetic data"
    )
    assert f"dataset: {expected}" in run.stdout
    assert "because mnist is not available" in run.stdout
