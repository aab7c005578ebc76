"""Resume at another world size, mesh or strategy: the loaded state is the saved one, bit for bit,
and the curve after the resume is the straight run's at the target layout.

Every source layout trains 30 steps straight and saves at step 15; every cell resumes that
checkpoint in its target layout and trains steps 16-30 (across the epoch boundary at step 20:
StepLR steps and the sampler reshuffles). Runs at different layouts add the same numbers in
different orders, so even two straight runs differ by rounding, which training amplifies
(Adam more than Adadelta). A resumed run must stay within max(1e-6, 2 x the largest
difference so far between the straight runs at the source and at the target layout) at every
step: as close to the target's straight run as the source's straight run is.

Before training, each cell also gathers every parameter, optimizer state tensor and
hyperparameter of the freshly loaded trainer to full and compares it bitwise with what the
checkpoint holds (tests/scripts/resume_matrix.py).

Negative controls, in every cell: the loaded state of the running trainer is changed in one place
before it trains (one optimizer state row zeroed, the data position one global batch on, or the
schedule stepped once more), and both checks must then fail, the curve check with that cell's own
tolerance. The 4->2 cell runs all three changes with every optimizer; every other cell one change
with one optimizer, the changes and the optimizers in turn over the cells. The token-file resume (slow) is checked the
same way, with the data position moved.

LoRA (hf): a tiny pretrained Llama with rank-4 adapters saves at step 5 of 20 on 2 ranks (FSDP2)
and resumes on 1 rank, across the epoch boundary at step 10. Its checkpoint holds the adapters,
not the frozen base: the state check compares what the checkpoint code saves (the same state dict
options) bitwise, and the live base with the folder's tensors. All three changes run in this cell
(LORA_CONTROLS), each failing both checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import read_metrics, run_variants

SAVE_AT, STEPS = 15, 30
COMMON = ["--model", "mlp", "--dataset", "synthetic", "--synthetic-size", "960", "--seed", "3",
          "--global-batch-size", "48", "--dropout", "0", "--mixed-precision", "fp32",
          "--log-every-steps", "1", "--progress", "off", "--max-steps", str(STEPS)]  # fmt: skip
OPTIMIZERS = {
    "adadelta": ["--optimizer", "adadelta"],
    "adam": ["--optimizer", "adam"],
    "sgd": ["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05"],
}
# Layout name -> (world size, flags). 3 ranks shard every mlp layer unevenly (128, 64, 10 rows).
LAYOUTS = {
    "single": (1, ["--strategy", "single"]),
    "fsdp2-2": (2, []),
    "fsdp1-2": (2, ["--strategy", "fsdp1"]),
    "pp2": (2, ["--pp", "2"]),
    "fsdp2-3": (3, ["--fsdp-units", "layer"]),
    "fsdp2-4": (4, ["--fsdp-units", "layer"]),
    "hsdp-2x2": (4, ["--dp-replicate", "2"]),
    "fsdp2-tp-2x2": (4, ["--tp", "2"]),
}
# Negative controls: changes to the loaded state (tests/scripts/resume_matrix.py's Mutate).
MUTATIONS = ["optim-row", "data", "scheduler"]
MUTATED_CELL = ("fsdp2-4", "fsdp2-2")  # every change with every optimizer
CELLS = [  # (source, target); a new cell gets its negative controls from mutations()
    ("fsdp2-4", "fsdp2-2"),
    ("fsdp2-2", "fsdp2-4"),
    ("single", "fsdp2-4"),
    ("fsdp2-3", "fsdp2-2"),
    ("hsdp-2x2", "fsdp2-2"),
    ("fsdp2-2", "hsdp-2x2"),
    ("fsdp1-2", "fsdp2-2"),
    ("fsdp2-tp-2x2", "fsdp2-2"),
    ("pp2", "fsdp2-2"),
]


def mutations(cell: tuple[str, str], opt: str) -> list[str]:
    """The changes a cell's resume with ``opt`` is run with: all of them with every optimizer in
    MUTATED_CELL; in every other cell one change with one optimizer, both in turn over the cells."""
    if cell == MUTATED_CELL:
        return MUTATIONS
    i = CELLS.index(cell)
    return [MUTATIONS[i % len(MUTATIONS)]] if opt == list(OPTIMIZERS)[i // 3 % 3] else []


CONTROLS = [(cell, opt, m) for cell in CELLS for opt in OPTIMIZERS for m in mutations(cell, opt)]
# The LoRA cell (hf, test_lora_resume_at_another_world_size): a pretrained base with adapters,
# 2 ranks saving at step 5 -> 1 rank to step 20, AdamW, every change.
LORA_SAVE_AT, LORA_STEPS = 5, 20
LORA_CELL = ("lora-fsdp2-2", "lora-fsdp2-1")
# Named here, not taken from MUTATIONS: a change added there and not here fails the check below.
LORA_CONTROLS = [(LORA_CELL, "adamw", m) for m in ("optim-row", "data", "scheduler")]


def _run_ranks(out: Path, ranks: int, variants: dict) -> None:
    run_variants(out, ranks, variants, COMMON)


def _cell(source: str, target: str, opt: str, mutation: str | None = None) -> str:
    return f"{source}-to-{target}-{opt}" + (f"-{mutation}" if mutation else "")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Path:
    """Straight runs of every layout (saving at step 15), then every resume, grouped by world size."""
    out = tmp_path_factory.mktemp("resume-matrix")
    straight: dict[int, dict] = {}
    for layout, (ranks, flags) in LAYOUTS.items():
        for opt, opt_flags in OPTIMIZERS.items():
            ckpt = [
                "--ckpt-dir",
                str(out / f"ckpt-{layout}-{opt}"),
                "--ckpt-every-steps",
                str(SAVE_AT),
            ]
            straight.setdefault(ranks, {})[f"{layout}-{opt}"] = {
                "flags": [*flags, *opt_flags, *ckpt]
            }
    resumes: dict[int, dict] = {}
    for source, target in CELLS:
        ranks, flags = LAYOUTS[target]
        for opt, opt_flags in OPTIMIZERS.items():
            ckpt = str(out / f"ckpt-{source}-{opt}" / f"step-{SAVE_AT}")
            resumes.setdefault(ranks, {})[_cell(source, target, opt)] = {
                "flags": [*flags, *opt_flags, "--resume", ckpt],
                "check": ckpt,
            }
            for mutation in mutations((source, target), opt):
                resumes[ranks][_cell(source, target, opt, mutation)] = {
                    "flags": [*flags, *opt_flags, "--resume", ckpt],
                    "check": ckpt,
                    "mutate": mutation,
                }
    # Sources before the resumes that read them: 1, 3 and 4 ranks; 2 (its resumes read 3 and 4);
    # then the resumes on 4 (they read 1 and 2).
    for ranks in (1, 3):
        _run_ranks(out, ranks, straight[ranks])
    _run_ranks(out, 4, straight[4])
    _run_ranks(out, 2, {**straight[2], **resumes[2]})
    _run_ranks(out, 4, resumes[4])
    return out


def _losses(out: Path, name: str) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in read_metrics(out / f"{name}.jsonl") if r["event"] == "step"
    }


def check_state(matrix: Path, name: str, ranks: int) -> None:
    reports = [json.loads(p.read_text()) for p in sorted(matrix.glob(f"{name}.state.rank*.json"))]
    assert len(reports) == ranks
    compared = {k for r in reports for k in r["compared"]}
    assert set(reports[0]["expected"]) <= compared, "tensors of the checkpoint not compared"
    assert {"scheduler", "train_state"} <= compared
    mismatched = sorted({k for r in reports for k in r["mismatched"]})
    assert not mismatched, f"loaded state differs from the saved: {mismatched}"


def check_curve(
    out: Path, source: str, target: str, name: str, save_at: int = SAVE_AT, steps: int = STEPS
) -> None:
    """Run ``name`` resumed at ``save_at`` from straight run ``source`` stays as close to straight
    run ``target`` as ``source`` is (see the module docstring)."""
    src, tgt, resumed = _losses(out, source), _losses(out, target), _losses(out, name)
    assert sorted(src) == sorted(tgt) == list(range(1, steps + 1))
    assert sorted(resumed) == list(range(save_at + 1, steps + 1))
    straight_gap, report, worst = 0.0, [], 0.0
    for step in range(1, steps + 1):
        straight_gap = max(straight_gap, abs(src[step] - tgt[step]))
        if step <= save_at:
            continue
        diff, tol = abs(resumed[step] - tgt[step]), max(1e-6, 2 * straight_gap)
        worst = max(worst, diff / tol)
        report.append(f"step {step}: resumed - target {diff:.1e} (tolerance {tol:.1e})")
    largest = max(abs(resumed[s] - tgt[s]) for s in resumed)
    print(f"{name}: largest |resumed - target| {largest:.1e}")
    assert worst <= 1.0, "\n".join(report)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize(("source", "target"), CELLS, ids=[f"{s}->{t}" for s, t in CELLS])
def test_resumed_state_is_the_saved_state_bitwise(matrix, source, target, opt):
    check_state(matrix, _cell(source, target, opt), LAYOUTS[target][0])


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize(("source", "target"), CELLS, ids=[f"{s}->{t}" for s, t in CELLS])
def test_resumed_curve_follows_the_straight_run_at_the_target(matrix, source, target, opt):
    check_curve(matrix, f"{source}-{opt}", f"{target}-{opt}", _cell(source, target, opt))


def test_every_cell_has_a_negative_control():
    assert {cell for cell, _, _ in CONTROLS} == set(CELLS)
    assert {(opt, m) for cell, opt, m in CONTROLS if cell == MUTATED_CELL} == {
        (o, m) for o in OPTIMIZERS for m in MUTATIONS
    }
    others = [(opt, m) for cell, opt, m in CONTROLS if cell != MUTATED_CELL]
    assert {m for _, m in others} == set(MUTATIONS) and {o for o, _ in others} == set(OPTIMIZERS)
    assert sorted(m for _, _, m in LORA_CONTROLS) == sorted(MUTATIONS)  # the LoRA cell: every one


@pytest.mark.parametrize(
    ("cell", "opt", "mutation"), CONTROLS, ids=[f"{s}->{t}-{o}-{m}" for (s, t), o, m in CONTROLS]
)
def test_a_changed_loaded_state_fails_both_checks(matrix, cell, opt, mutation):
    source, target = cell
    name = _cell(source, target, opt, mutation)
    with pytest.raises(AssertionError, match="loaded state differs from the saved"):
        check_state(matrix, name, LAYOUTS[target][0])
    with pytest.raises(AssertionError, match="resumed - target"):
        check_curve(matrix, f"{source}-{opt}", f"{target}-{opt}", name)


# ------------------------------------------------------------- token windows (--dataset tokens:)
def _token_dir(folder: Path, count: int = 40_000, vocab: int = 64) -> Path:
    """A token file as ``fsdp2lab data prepare`` writes it (a Markov chain, no tokenizer)."""
    import numpy as np

    rng = np.random.default_rng(0)
    successor = rng.permutation(vocab)
    tokens = np.empty(count, dtype=np.uint16)
    tokens[0] = 0
    for i in range(1, count):
        tokens[i] = successor[tokens[i - 1]] if rng.random() < 0.9 else rng.integers(vocab)
    folder.mkdir()
    n_val = count // 20
    tokens[:-n_val].tofile(folder / "train.bin")
    tokens[-n_val:].tofile(folder / "val.bin")
    header = {"format": "fsdp2lab-tokens/1", "tokenizer": "none", "tokenizer_sha256": "0" * 64,
              "vocab_size": vocab, "eos_id": 0, "dtype": "uint16", "documents": 1,
              "train_tokens": count - n_val, "val_tokens": n_val}  # fmt: skip
    (folder / "tokens.json").write_text(json.dumps(header))
    return folder


@pytest.mark.slow  # the README's test command stays under 15 minutes
def test_token_windows_resume_at_another_world_size(tmp_path):
    """The memory-mapped windows' order is a bijection computed per index, the same at every
    world size: 2 ranks save at step 6, 4 ranks resume (across the epoch boundary at step 9) with
    the saved state, bit for bit, and the 4-rank straight run's curve; the same resume with the
    data position one global batch on (a batch of windows skipped) fails both checks."""
    from conftest import GPT_TINY

    tokens = _token_dir(tmp_path / "tokens")
    common = [*GPT_TINY, "--vocab-size", "64", "--dataset", f"tokens:{tokens}", "--dropout", "0",
              "--global-batch-size", "256", "--max-steps", "11", "--log-every-steps", "1",
              "--optimizer", "adam", "--progress", "off"]  # fmt: skip
    ckpt = str(tmp_path / "ck" / "step-6")
    save = ["--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every-steps", "6", "--keep-last", "0"]
    run_variants(tmp_path, 2, {"two": {"flags": save}}, common)
    resume = {"flags": ["--resume", ckpt], "check": ckpt}
    run_variants(tmp_path, 4, {"four": {"flags": []}, "resumed": resume,
                               "resumed-data": {**resume, "mutate": "data"}}, common)  # fmt: skip
    assert {r["epoch"] for r in read_metrics(tmp_path / "four.jsonl") if r["event"] == "step"} == {
        1,
        2,
    }
    check_state(tmp_path, "resumed", 4)
    check_curve(tmp_path, "two", "four", "resumed", save_at=6, steps=11)
    with pytest.raises(AssertionError, match="loaded state differs from the saved"):
        check_state(tmp_path, "resumed-data", 4)
    with pytest.raises(AssertionError, match="resumed - target"):
        check_curve(tmp_path, "two", "four", "resumed-data", save_at=6, steps=11)


# ------------------------------------------------------------- LoRA adapters (--lora-rank, hf)
@pytest.mark.hf
def test_lora_resume_at_another_world_size(tmp_path):
    """A LoRA run (a tiny pretrained Llama, rank-4 adapters, fp32, AdamW) saves at step 5 on
    2 ranks; 1 rank resumes it and trains steps 6-20 (across the epoch boundary at step 10) with
    the saved adapters and optimizer state, bit for bit, the base bit for bit its folder's, and the
    1-rank straight run's curve; each change of LORA_CONTROLS fails both checks."""
    pytest.importorskip("peft")
    from test_hf_pretrained import save_llama

    folder = save_llama(tmp_path / "llama", tied=False)
    save_at, steps = LORA_SAVE_AT, LORA_STEPS
    common = ["--model", f"hf:{folder}", "--lora-rank", "4", "--lora-dropout", "0",
              "--mixed-precision", "fp32", "--optimizer", "adamw", "--lr", "1e-2",
              "--global-batch-size", "16", "--seq-len", "16", "--synthetic-size", "160",
              "--epochs", "3", "--max-steps", str(steps), "--log-every-steps", "1",
              "--progress", "off"]  # fmt: skip
    ckpt = str(tmp_path / "ck" / f"step-{save_at}")
    save = ["--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every-steps", str(save_at)]
    run_variants(tmp_path, 2, {"two": {"flags": [*save, "--keep-last", "0"]}}, common)
    resume = {"flags": ["--resume", ckpt], "check": ckpt}
    mutated = {f"resumed-{m}": {**resume, "mutate": m} for _, _, m in LORA_CONTROLS}
    run_variants(tmp_path, 1, {"one": {"flags": []}, "resumed": resume, **mutated}, common)
    assert {r["epoch"] for r in read_metrics(tmp_path / "one.jsonl") if r["event"] == "step"} == {
        1,
        2,
    }
    check_state(tmp_path, "resumed", 1)
    compared = json.loads((tmp_path / "resumed.state.rank0.json").read_text())["compared"]
    files = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert {k for k in compared if k.startswith("base.")} == {f"base.{k}" for k in files}
    check_curve(tmp_path, "two", "one", "resumed", save_at=save_at, steps=steps)
    for name in mutated:
        with pytest.raises(AssertionError, match="loaded state differs from the saved"):
            check_state(tmp_path, name, 1)
        with pytest.raises(AssertionError, match="resumed - target"):
            check_curve(tmp_path, "two", "one", name, save_at=save_at, steps=steps)
