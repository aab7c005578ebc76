"""Every command the README shows, run as written (training cut to 2 steps), so it cannot rot.

Each ```bash block of README.md runs in order in one fresh folder holding the README, configs/
and a ``.venv`` link to this environment; every ``fsdp2lab train`` without a ``--max-steps`` of its
own gets ``--max-steps 2`` (for ``bench``, after ``--``), 2 more than the run before it on the
same ``--ckpt-dir`` (so a resumed run trains too). Command 1 runs as written, set-up included, in
a copy of this checkout with a fresh venv (``pip install -e .``, no dev extra). Each command is
checked for what the README tells its user to expect: the lines it prints (``EXPECT``: patterns
in its output) and the files it writes (new or modified while it ran), besides its exit code.
Every training run must print the line it prints only once it has trained (``TRAINED``), so a run
that stops after its start-up lines and echoed config fails. A command run here without an entry
in ``EXPECT``, or one that shortening would leave empty, fails the test. Commands that need what
this machine lacks (a Slurm allocation, GPUs, two machines, the hf extra's install) are listed in
``ELSEWHERE`` with the test that runs them or why none can; a README command in neither place
fails the test.

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
STEPS = 2  # each training run's --max-steps (2 more on a --ckpt-dir a run before it trained)
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
    'pip install -e ".[hf]"':
        "the hf stage of .ci/run installs the hf extra into its fresh venv (pip install -e \".[dev,hf]\")",
}  # fmt: skip

# What the README tells the user each command prints (regular expressions, each must match the
# output) and writes (globs, each must match a file), from the text around the command.
SEED_LINES = [r"Train Epoch: 1 \tLoss: \d+\.\d{6}\n",
              r"Test set: Average loss: \d+\.\d{4}, Accuracy: \d+/\d+ \(\d+\.\d\d%\)",
              r"Epoch 1 time: \d+\.\d\ds \([\d,]+ samples/s\)"]  # fmt: skip
TWO_CPU_RANKS = r"on 2 rank\(s\) \[cpu/gloo\]"
CONFIG = r"fsdp2lab: resolved config\n"
TRAINED = SEED_LINES[2]  # printed at the end of each epoch, or of a run cut short by --max-steps
PROFILE_PARTS = ("compute", "exposed_comm", "data", "optimizer", "host")  # the breakdown's rows
EXPECT: dict[str, tuple[list[str], list[str]]] = {
    "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/fsdp2lab train": (
        [r"fsdp2lab: dataset: (mnist|fashion-mnist)", r"fsdp2lab: fsdp2 " + TWO_CPU_RANKS,
         r"model cnn", *SEED_LINES, r"Accuracy: \d+/10000 "], []),
    "fsdp2lab train --help": (
        [r"--mixed-precision \{fp32,bf16,fp16\}", r"--nproc-per-node", r"\(default: fp32\)",
         r"--on-nan \{stop,skip\}"], []),
    "fsdp2lab train --dataset mnist --epochs 14 --recipe seed": (
        [CONFIG, r'optimizer = "adadelta"', r"epochs = 14", r"global batch 64 ", *SEED_LINES,
         r"Accuracy: \d+/10000 "], []),
    "fsdp2lab train --nproc-per-node 4 --dp-replicate 2": (
        [r"on 4 rank\(s\) \[cpu/gloo\], mesh dp_replicate=2 x dp_shard=2", *SEED_LINES], []),
    "fsdp2lab train --model gpt --dataset text --text-file README.md --seq-len 128 --d-model 256 --n-heads 8 --optimizer adamw --lr 1e-3 --scheduler cosine --max-grad-norm 1.0 --mixed-precision bf16 --global-batch-size 32 --epochs 3": (
        [r"model gpt \(", r'mixed_precision = "bf16"', r"global batch 32 ", r"fsdp2lab: dataset: bytes of README\.md",
         TRAINED], []),
    "fsdp2lab train --config configs/gpt-small.toml --epochs 1": (
        [CONFIG, r"model gpt \(", r"epochs = 1\n", TRAINED], []),
    "fsdp2lab train --nproc-per-node 2": ([TWO_CPU_RANKS, *SEED_LINES], []),
    "torchrun --nproc-per-node 2 -m fsdp2lab train": ([TWO_CPU_RANKS, *SEED_LINES], []),
    "fsdp2lab train --model mlp --dataset synthetic --log-every-steps 1 --strategy ddp --tensorboard runs/ddp": (
        [r"ddp " + TWO_CPU_RANKS, r"TensorBoard logs in runs/ddp", TRAINED], ["runs/ddp/events.out.tfevents.*"]),
    "fsdp2lab train --model mlp --dataset synthetic --log-every-steps 1 --strategy fsdp2 --tensorboard runs/fsdp2 --metrics-file fsdp2.jsonl": (
        [r"fsdp2 " + TWO_CPU_RANKS, TRAINED], ["runs/fsdp2/events.out.tfevents.*", "fsdp2.jsonl"]),
    "fsdp2lab report runs/ddp fsdp2.jsonl --out loss-curves.png": (
        [r"wrote loss-curves\.png"], ["loss-curves.png"]),
    "fsdp2lab train --eval-every-steps 200 --target-accuracy 0.9": (
        [r"target_accuracy = 0\.9", *SEED_LINES], []),
    "fsdp2lab train --max-steps 20 --profile prof": (
        [r"fsdp2lab: profile of 5 steps written to prof/rank0\.pt\.trace\.json\n",
         *(rf"\n  {part} +\d+\.\d\d ms +\d+\.\d%" for part in PROFILE_PARTS), TRAINED],
        ["prof/rank0.pt.trace.json", "prof/rank1.pt.trace.json"]),
    "fsdp2lab train --model examples/my_model.py:build --model-args 'width=256,depth=4' --input-shape 1,28,28 --dataset fashion-mnist --epochs 1": (
        [r"model examples/my_model\.py:build \(", r"dataset: fashion-mnist", *SEED_LINES], []),
    "fsdp2lab train --model examples/my_model.py:build --input-shape 1,28,28 --dataset synthetic --strategy ddp --activation-checkpointing full": (
        [r"ddp " + TWO_CPU_RANKS, r'activation_checkpointing = "full"', *SEED_LINES], []),
    "fsdp2lab train --model gpt --nproc-per-node 2 --tp 2": ([r"mesh dp_shard=1 x tp=2", TRAINED], []),
    "fsdp2lab train --model gpt --nproc-per-node 4 --tp 2": ([r"mesh dp_shard=2 x tp=2", TRAINED], []),
    "fsdp2lab train --model gpt --nproc-per-node 2 --pp 2": (
        [r"mesh pp=2 x dp_shard=1", r"fsdp2lab: pipeline: stage 0 \[", r'pp_schedule = "1f1b"', TRAINED], []),
    "fsdp2lab train --model gpt --nproc-per-node 4 --pp 2 --pp-schedule gpipe": (
        [r"mesh pp=2 x dp_shard=2", r"fsdp2lab: pipeline: stage 0 \[", r'pp_schedule = "gpipe"', TRAINED], []),
    "fsdp2lab train --model mlp2 --strategy model-parallel": (
        [r"model-parallel on 1 rank\(s\)", *SEED_LINES], []),
    "fsdp2lab bench --strategies ddp,fsdp1,fsdp2,hsdp --world-sizes 1,2,4 --models cnn --out results/cmp -- --dataset synthetic --epochs 1": (
        [r"fsdp2lab bench: \d+ runs into results/cmp", r"\] cnn-fsdp2-ws2-\S+ \.\.\. ok in \d",
         r"wrote results/cmp/results\.csv"], ["results/cmp/*/status.json"]),
    "fsdp2lab report results/cmp": (
        [r"wrote results/cmp/results\.csv"],
        ["results/cmp/results.csv", "results/cmp/summary.md", "results/cmp/plots/*.png"]),
    "fsdp2lab train --ckpt-dir ckpt --ckpt-every-steps 500 --keep-last 3 --async-checkpoint": (
        [r"fsdp2lab: checkpoint saved: ckpt/step-2 \(", TRAINED], ["ckpt/step-2/COMPLETE", "ckpt/latest"]),
    "fsdp2lab train --ckpt-dir ckpt": (
        [r"fsdp2lab: checkpoint: resumed from ckpt/step-2: step 2", TRAINED,
         r"fsdp2lab: checkpoint saved: ckpt/step-4 \("], ["ckpt/step-4/COMPLETE"]),
    "fsdp2lab train --ckpt-dir ckpt --nproc-per-node 4 --dp-replicate 2": (
        [r"resumed from ckpt/step-4: step 4", r"mesh dp_replicate=2 x dp_shard=2", TRAINED,
         r"fsdp2lab: checkpoint saved: ckpt/step-6 \("], ["ckpt/step-6/COMPLETE"]),
    "fsdp2lab ckpt info ckpt": (
        [r"step: 6\n", r"mesh: ", r"strategy: fsdp2", r"tensors: \d+, [\d,]+ bytes"], []),
    "fsdp2lab ckpt export ckpt model.pt": ([r"exported \d+ tensors"], ["model.pt"]),
    "fsdp2lab ckpt export ckpt model.safetensors": (
        [r"exported \d+ tensors"], ["model.safetensors"]),
    "fsdp2lab ckpt import model.pt tune && fsdp2lab train --ckpt-dir tune --epochs 3": (
        [r"imported model\.pt as tune", r"loaded model weights from tune", TRAINED], []),
    "fsdp2lab plan --model gpt --n-layers 12 --d-model 768 --n-heads 12 --seq-len 1024 --vocab-size 50304 --batch-size 8 --mixed-precision bf16 --optimizer adamw --world-size 64 --dp-replicate 8 --gpu h100": (
        [r"plan: gpt \([\d,]+ parameters\), .* on 64 x ", r"mesh dp_replicate=8 x dp_shard=8",
         r"peak total", r"reserved \(estimate\)", r"tokens/s per GPU, MFU"], []),
    # The fine-tuning block: test_fine_tune_block_runs_as_written, on a small model it saves.
    "fsdp2lab data prepare --tokenizer my-llama --input corpus.jsonl --out corpus-tokens": (
        [r"corpus-tokens: [\d,]+ training and [\d,]+ held-out tokens \(uint16\) of 4,000 "
         r"documents; vocabulary [\d,]+, EOS id \d+"],
        ["corpus-tokens/train.bin", "corpus-tokens/val.bin", "corpus-tokens/tokens.json"]),
    "fsdp2lab train --model hf:my-llama --dataset tokens:corpus-tokens --tokenizer my-llama --seq-len 128 --optimizer adamw --lr 1e-5 --ckpt-dir ft-ckpt": (
        [r"model hf:my-llama \(", r"tokens:corpus-tokens", TRAINED,
         r"fsdp2lab: checkpoint saved: ft-ckpt/step-2 \("], ["ft-ckpt/step-2/COMPLETE"]),
    "fsdp2lab ckpt export ft-ckpt my-llama-ft": (
        [r"exported \d+ tensors \([\d,]+ bytes\) of ft-ckpt/step-2 to my-llama-ft"],
        ["my-llama-ft/config.json", "my-llama-ft/*.safetensors", "my-llama-ft/tokenizer.json",
         "my-llama-ft/generation_config.json"]),
    "fsdp2lab train --model hf:my-llama --dataset tokens:corpus-tokens --tokenizer my-llama --seq-len 128 --nproc-per-node 2 --save-hf my-llama-hf": (
        [r"on 2 rank\(s\)", TRAINED, r"fsdp2lab: Hugging Face model saved to my-llama-hf at step 2 \("],
        ["my-llama-hf/config.json", "my-llama-hf/model.safetensors", "my-llama-hf/tokenizer.json",
         "my-llama-hf/generation_config.json"]),
    "fsdp2lab train --model hf:my-llama --dataset tokens:corpus-tokens --tokenizer my-llama --seq-len 128 --nproc-per-node 2 --lora-rank 4 --lora-alpha 8 --ckpt-dir lora-ckpt": (
        [r"on 2 rank\(s\)", TRAINED, r"fsdp2lab: checkpoint saved: lora-ckpt/step-2 \("],
        ["lora-ckpt/step-2/COMPLETE"]),
    "fsdp2lab ckpt export lora-ckpt my-adapter": (
        [r"exported \d+ tensors \([\d,]+ bytes\) of lora-ckpt/step-2 to my-adapter as a PEFT "
         r"adapter folder"], ["my-adapter/adapter_config.json", "my-adapter/adapter_model.safetensors"]),
    "fsdp2lab train --model hf:my-llama --dataset tokens:corpus-tokens --tokenizer my-llama --seq-len 128 --nproc-per-node 2 --lora-rank 4 --quantize-base nf4 --save-hf my-qlora-adapter": (
        [r"on 2 rank\(s\)", TRAINED, r"fsdp2lab: PEFT adapter saved to my-qlora-adapter at step 2 \("],
        ["my-qlora-adapter/adapter_config.json", "my-qlora-adapter/adapter_model.safetensors"]),
    "fsdp2lab ckpt export lora-ckpt my-llama-merged --merge": (
        [r"to my-llama-merged as the base model with the adapters merged in"],
        ["my-llama-merged/config.json", "my-llama-merged/*.safetensors",
         "my-llama-merged/tokenizer.json"]),
}  # fmt: skip
# Command 1 runs, set-up included, in test_command_1_in_a_fresh_venv; the fine-tuning block needs
# a pretrained model and the hf extra: test_fine_tune_block_runs_as_written saves a small one.
COMMAND_1 = "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/fsdp2lab train"
FINE_TUNE_START = "fsdp2lab data prepare --tokenizer my-llama"


def readme_blocks() -> list[list[str]]:
    """The commands of each ```bash block: continuation lines joined, comments dropped."""
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        joined = re.sub(r"\\\n\s*", "", body)
        commands = [re.sub(r"\s+#.*$", "", ln).strip() for ln in joined.splitlines()]
        blocks.append([c for c in commands if c and not c.startswith("#")])
    return blocks


def shortened(command: str, steps: dict[str, int] | None = None, set_up: bool = False) -> str:
    """``command`` with every training run cut to 2 steps (unless it sets its own --max-steps),
    2 more than ``steps`` records for its ``--ckpt-dir`` (updated), and without its venv and pip
    install steps unless ``set_up``. Never empty: a command that is only set-up belongs in
    ``ELSEWHERE``."""
    steps = {} if steps is None else steps
    parts = []
    for part in command.split(" && "):
        if not set_up and (
            part.startswith("python3 -m venv ") or re.search(r"\bpip install\b", part)
        ):
            continue
        # bench passes what follows ``--`` to each of its training runs
        training = re.search(r"fsdp2lab (bench .* -- |train(?! --help))", part)
        if training and "--max-steps" not in part:
            ckpt = re.search(r"--ckpt-dir (\S+)", part)
            n = STEPS + (steps.get(ckpt[1], 0) if ckpt else 0)
            if ckpt:
                steps[ckpt[1]] = n
            part = f"{part} --max-steps {n}"
        parts.append(part)
    assert parts, f"README command shortened to nothing: {command!r}; list it in ELSEWHERE"
    return " && ".join(parts)


BLOCKS = [[c for c in block if c not in ELSEWHERE and c != COMMAND_1] for block in readme_blocks()]
(FINE_TUNE,) = [block for block in BLOCKS if block and block[0].startswith(FINE_TUNE_START)]
BLOCKS = [block for block in BLOCKS if block and block is not FINE_TUNE]


def test_every_readme_command_is_run_here_or_named_elsewhere():
    commands = {c for block in readme_blocks() for c in block}
    assert set(ELSEWHERE) <= commands, f"gone from the README: {set(ELSEWHERE) - commands}"
    assert len(BLOCKS) >= 5, BLOCKS
    run_here = {c for block in [*BLOCKS, FINE_TUNE] for c in block} | {COMMAND_1}
    assert COMMAND_1 in commands and run_here == set(EXPECT), (
        f"README commands without expectations: {sorted(run_here - set(EXPECT))}; "
        f"expectations of commands gone from the README: {sorted(set(EXPECT) - run_here)}"
    )
    assert all(shortened(c) for c in run_here)
    # A run that stops after its start-up lines and echoed config fails: it misses this line.
    trains = [c for c in EXPECT if re.search(r"fsdp2lab train(?! --help)", c)]
    assert not [c for c in trains if TRAINED not in EXPECT[c][0]], "a training run without TRAINED"


def test_a_set_up_only_command_cannot_shrink_to_nothing():
    with pytest.raises(AssertionError, match="shortened to nothing"):
        shortened('pip install -e ".[hf]"')
    assert shortened("fsdp2lab train --max-steps 20 --profile prof").endswith("--profile prof")
    steps: dict[str, int] = {}
    assert shortened("fsdp2lab train --ckpt-dir c", steps).endswith("--max-steps 2")
    assert shortened("fsdp2lab train --ckpt-dir c --tp 2", steps).endswith("--max-steps 4")
    assert shortened(COMMAND_1, set_up=True) == f"{COMMAND_1} --max-steps 2"


def run_as_the_readme_says(command: str, cwd: Path, steps: dict, env: dict, set_up: bool = False,
                           timeout: float = 600) -> str:  # fmt: skip
    """Run ``command`` shortened in ``cwd``; check its exit code, and the lines and files that
    ``EXPECT`` names for it (files this command wrote: new, or modified since it started);
    return its output."""
    before = {p: p.stat().st_mtime_ns for glob in EXPECT[command][1] for p in cwd.glob(glob)}
    proc = subprocess.run(["bash", "-c", shortened(command, steps, set_up)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    shown = f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"README command failed ({proc.returncode}): {command}\n{shown}"
    lines, files = EXPECT[command]
    output = proc.stdout + proc.stderr
    missing = [pattern for pattern in lines if not re.search(pattern, output)]
    assert not missing, f"{command}: the README's lines not printed: {missing}\n{shown}"
    absent = [g for g in files if all(before.get(p) == p.stat().st_mtime_ns for p in cwd.glob(g))]
    assert not absent, f"{command}: the README's files not written: {absent}\n{shown}"
    return output


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


def here_env() -> dict:
    return cli_env({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})


@pytest.mark.readme
@pytest.mark.parametrize("block", BLOCKS, ids=[b[0][:60] for b in BLOCKS])
def test_readme_block_runs_as_written(block, workspace):
    if any("--dataset mnist" in c for c in block) and not FASHION_DIR.is_dir():
        pytest.skip(f"no MNIST stand-in: {FASHION_DIR} missing (.ci/run installs it)")
    steps: dict[str, int] = {}
    for command in block:
        run_as_the_readme_says(command, workspace, steps, here_env())


@pytest.mark.readme
def test_command_1_in_a_fresh_venv(tmp_path):
    """Command 1 as written, in a copy of this checkout's files (tracked and not ignored) with
    no data: a new venv, ``pip install -e .`` from the registry (no dev extra, so a module the
    run imports from a dev-only package fails it), the main job cut to 2 steps."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout  # fmt: skip
    for name in filter(None, listed.decode().split("\0")):
        if (REPO / name).is_file():  # not a file deleted from the working tree
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tmp_path / name)
    env = {
        k: v for k, v in cli_env().items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    }
    env["PATH"] = os.pathsep.join(d for d in env["PATH"].split(os.pathsep)
                                  if Path(d).resolve() != Path(sys.executable).parent.resolve())  # fmt: skip
    output = run_as_the_readme_says(COMMAND_1, tmp_path, {}, env, set_up=True, timeout=1500)
    assert (tmp_path / ".venv" / "bin" / "fsdp2lab").is_file()
    # "downloads MNIST into ./data", or offline "says which data it used and why"
    if re.search(r"fsdp2lab: dataset: mnist\b", output):
        assert list(tmp_path.glob("data/MNIST/raw/*-ubyte*")), "MNIST used but not in ./data"
    else:
        assert re.search(r"dataset: fashion-mnist from .*, because mnist is not available", output)


@pytest.mark.readme
@pytest.mark.hf
def test_fine_tune_block_runs_as_written(workspace):
    """prepare, train, export on a small Llama (with its tokenizer) saved as my-llama, and a
    JSON-lines corpus.jsonl of 4,000 documents: each command's lines and files, and the export
    and the --save-hf folder load in from_pretrained with their tokenizer."""
    transformers = pytest.importorskip("transformers")
    import json

    from test_hf_pretrained import save_llama
    from test_hf_tokens import documents, make_tokenizer

    make_tokenizer(save_llama(workspace / "my-llama", tied=True, shard=None, hidden=256))
    corpus = "".join(json.dumps({"text": d}) + "\n" for d in documents(4000, seed=3))
    (workspace / "corpus.jsonl").write_text(corpus)
    steps: dict[str, int] = {}
    for command in FINE_TUNE:
        run_as_the_readme_says(command, workspace, steps, here_env())
    out = workspace / "my-llama-ft"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer.eos_token == "<eos>"
    from_every_rank = transformers.AutoModelForCausalLM.from_pretrained(workspace / "my-llama-hf")
    assert from_every_rank.lm_head.weight is from_every_rank.model.embed_tokens.weight  # tied
    assert (
        transformers.AutoTokenizer.from_pretrained(workspace / "my-llama-hf").eos_token == "<eos>"
    )
    peft = pytest.importorskip("peft")
    import torch

    base = transformers.AutoModelForCausalLM.from_pretrained(workspace / "my-llama")
    tuned = peft.PeftModel.from_pretrained(base, workspace / "my-adapter").merge_and_unload()
    merged = transformers.AutoModelForCausalLM.from_pretrained(workspace / "my-llama-merged")
    assert all(torch.equal(v, merged.state_dict()[k]) for k, v in tuned.state_dict().items())
