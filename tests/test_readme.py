"""Every command the README shows, run as written (training cut to 2 steps), so it cannot rot.

Each ```bash block of README.md runs in order in one fresh folder holding the README, configs/
and a ``.venv`` link to this environment (the set-up's venv and ``pip install`` steps are left to
``.ci/run``, which runs them on a fresh clone); every ``fsdp2lab train`` gets ``--max-steps 2``
(for ``bench``, after ``--``). Commands that need what this machine lacks (a Slurm allocation, GPUs,
two machines, a fresh venv) are listed in ``ELSEWHERE`` with the test that runs them or why none
can; a README command in neither place fails the test.

These runs take minutes (``bench`` alone starts ten jobs), so they are marked ``readme`` and left
out of a plain ``pytest``; ``.ci/run`` runs them with ``pytest -m readme``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FASHION_DIR, cli_env

REPO = Path(__file__).resolve().parents[1]
SHORT = "--max-steps 2"
ELSEWHERE = {
    'python3 -m venv .venv && .venv/bin/pip install -q -e ".[dev]" && .venv/bin/python -m pytest -q':
        ".ci/run runs it, as written, on a fresh clone",
    "srun --ntasks-per-node 2 fsdp2lab train": "tests/test_slurm.py (local Slurm cluster)",
    "sbatch slurm/train.sbatch --model gpt --dataset text --text-file README.md --epochs 3":
        "tests/test_slurm.py (local Slurm cluster)",
    "sbatch --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 slurm/train-torchrun.sbatch --model gpt":
        "needs 4 nodes of 8 GPUs; tests/test_slurm.py runs this script on 2 CPU nodes",
    "fsdp2lab train --model examples/hf_llama.py:build --dataset text --text-file README.md --seq-len 64 --ckpt-dir hf-ckpt":
        "tests/test_hf.py (the hf stage of .ci/run, with the hf extra installed)",
    "fsdp2lab ckpt export hf-ckpt hf-model": "tests/test_hf.py (the hf stage of .ci/run)",
    "scripts/multinode-torchrun.sh --nnodes 2 --head 10.0.0.1 -- --model gpt":
        "needs two machines; tests/test_multinode.py runs the script as two nodes on localhost",
    "hf download meta-llama/Llama-3.2-1B --local-dir /shared/models/llama-3.2-1b":
        "needs internet and the Hugging Face hub",
}  # fmt: skip
# The fine-tuning block needs a pretrained model and the hf extra: it runs as written in
# test_fine_tune_block_runs_as_written, on a small model the test saves.
FINE_TUNE_START = "fsdp2lab data prepare --tokenizer my-llama"


def readme_blocks() -> list[list[str]]:
    """The commands of each ```bash block: continuation lines joined, comments dropped."""
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        joined = re.sub(r"\\\n\s*", "", body)
        commands = [re.sub(r"\s+#.*$", "", ln).strip() for ln in joined.splitlines()]
        blocks.append([c for c in commands if c and not c.startswith("#")])
    return blocks


def shortened(command: str) -> str:
    """``command`` with every training run cut to 2 steps, and without its venv and pip install
    steps (``.ci/run`` makes a fresh venv and installs the package the same way)."""
    parts = []
    for part in command.split(" && "):
        if part.startswith("python3 -m venv ") or re.search(r"\bpip install\b", part):
            continue
        # bench passes what follows ``--`` to each of its training runs
        if re.search(r"fsdp2lab (bench .* -- |train(?! --help))", part):
            part = f"{part} {SHORT}"
        parts.append(part)
    return " && ".join(parts)


BLOCKS = [[c for c in block if c not in ELSEWHERE] for block in readme_blocks()]
BLOCKS = [block for block in BLOCKS if block and not block[0].startswith(FINE_TUNE_START)]


def test_every_readme_command_is_run_here_or_named_elsewhere():
    commands = {c for block in readme_blocks() for c in block}
    assert set(ELSEWHERE) <= commands, f"gone from the README: {set(ELSEWHERE) - commands}"
    assert len(BLOCKS) >= 5, BLOCKS


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A user's folder: the README and configs, .venv (this environment), MNIST on disk."""
    shutil.copy(REPO / "README.md", tmp_path)
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    (tmp_path / ".venv").symlink_to(sys.prefix)
    if FASHION_DIR.is_dir():  # same IDX format: stands in for a downloaded MNIST
        shutil.copytree(FASHION_DIR, tmp_path / "data" / "MNIST" / "raw")
    return tmp_path


@pytest.mark.readme
@pytest.mark.parametrize("block", BLOCKS, ids=[b[0][:60] for b in BLOCKS])
def test_readme_block_runs_as_written(block, workspace):
    if any("--dataset mnist" in c for c in block) and not FASHION_DIR.is_dir():
        pytest.skip(f"no MNIST stand-in: {FASHION_DIR} missing (.ci/run installs it)")
    env = cli_env({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    for command in block:
        proc = subprocess.run(
            ["bash", "-c", shortened(command)],
            cwd=workspace,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, (
            f"README command failed ({proc.returncode}): {command}\n"
            f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        )


@pytest.mark.readme
@pytest.mark.hf
def test_fine_tune_block_runs_as_written(workspace):
    """prepare, train, export on a small Llama (with its tokenizer) saved as my-llama, and a
    JSON-lines corpus.jsonl: the export loads in from_pretrained with its tokenizer."""
    transformers = pytest.importorskip("transformers")
    import json

    from test_hf_pretrained import save_llama
    from test_hf_tokens import documents, make_tokenizer

    (block,) = [b for b in readme_blocks() if b[0].startswith(FINE_TUNE_START)]
    make_tokenizer(save_llama(workspace / "my-llama", tied=True, shard=None))
    corpus = "".join(json.dumps({"text": d}) + "\n" for d in documents(4000, seed=3))
    (workspace / "corpus.jsonl").write_text(corpus)
    env = cli_env({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    for command in block:
        proc = subprocess.run(["bash", "-c", shortened(command)], cwd=workspace, env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, (
            f"README command failed ({proc.returncode}): {command}\n"
            f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        )
    out = workspace / "my-llama-ft"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer.eos_token == "<eos>"
