"""Your own model in one file: ``--model file.py:NAME``.

* ``TOY`` declares a ModelSpec (units, TP plan, pipeline by module name) and gets FSDP2 per layer,
  TP and PP without any line in ``parallel/``;
* ``TIED`` is a bare factory (an embedding tied to the output head, a ModuleList of blocks): its
  units are inferred, and it trains under FSDP2, HSDP and DDP, resumes and exports.

Every run is compared with the single-process run step by step (fp32, dropout 0, 20 steps).
"""

from __future__ import annotations

import importlib.util
import re
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import assert_close_lists, read_metrics, run_cli
from fsdp2lab import cli, consent
from fsdp2lab.config import TrainConfig
from fsdp2lab.plan import resolve
from test_strategies import train_in_ranks

MODEL_FILE = textwrap.dedent(
    '''
    import torch
    import torch.nn as nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from fsdp2lab.models.spec import ModelSpec


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))


    class Toy(nn.Module):
        def __init__(self, vocab=64, d=32, n_blocks=3, tied=False):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
            self.head = nn.Linear(d, vocab, bias=False)
            if tied:
                self.head.weight = self.emb.weight

        def forward(self, x):
            if self.emb is not None:  # a pipeline stage without it starts from activations
                x = self.emb(x)
            for block in self.blocks:
                x = block(x)
            return x if self.head is None else self.head(x)


    def build(vocab=64, d=32, n_blocks=3):
        """The bare factory: tied embedding and head."""
        return Toy(vocab, d, n_blocks, tied=True)


    def blocks(model):
        return [f"blocks.{i}" for i, _ in enumerate(model.blocks)]


    def tp_plan(model):
        plan = {}
        for name in blocks(model):
            plan[f"{name}.up"] = ColwiseParallel()
            plan[f"{name}.down"] = RowwiseParallel()
        return plan


    SPEC = ModelSpec(
        name="toy",
        build=lambda cfg: Toy(cfg.vocab_size),
        task="lm",
        input_shape=None,
        datasets=("synthetic", "text"),
        default_dataset="synthetic",
        units=blocks,
        tp_plan=tp_plan,
        tp_sizes=lambda model: {"hidden width": model.blocks[0].up.out_features},
        pipeline=lambda model: ["emb", *blocks(model), "head"],
    )

    NOT_A_MODEL = "text"
    '''
)
STEPS = 20
COMMON = ["--dataset", "synthetic", "--vocab-size", "64", "--seq-len", "16", "--dropout", "0",
          "--synthetic-size", "640", "--global-batch-size", "16", "--max-steps", str(STEPS),
          "--log-every-steps", "1", "--optimizer", "adam", "--lr", "0.003", "--progress", "off"]  # fmt: skip


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("own") / "toy.py"
    path.write_text(MODEL_FILE)
    return path


@pytest.fixture(scope="module")
def runs(model_file, tmp_path_factory) -> dict[str, list[dict]]:
    toy, tied = ["--model", f"{model_file}:SPEC"], ["--model", f"{model_file}:build"]
    fsdp2 = ["--strategy", "fsdp2"]
    by_ranks = {
        1: {"toy-single": [*toy, "--strategy", "single"], "tied-single": [*tied, "--strategy", "single"]},
        2: {
            "toy-fsdp2-layer": [*toy, *fsdp2, "--fsdp-units", "layer", "--prefetch", "1"],
            "toy-tp2": [*toy, *fsdp2, "--tp", "2"],
            "toy-pp2": [*toy, *fsdp2, "--pp", "2", "--pp-microbatches", "2"],
            "tied-fsdp2-layer": [*tied, *fsdp2, "--fsdp-units", "layer"],
            "tied-ddp": [*tied, "--strategy", "ddp"],
        },
        4: {"tied-hsdp": [*tied, *fsdp2, "--dp-replicate", "2", "--fsdp-units", "layer"]},
    }  # fmt: skip
    out = {}
    for ranks, variants in by_ranks.items():
        out.update(train_in_ranks(tmp_path_factory.mktemp(f"r{ranks}"), ranks, variants, *COMMON))
    return out


def _losses(metrics: list[dict]) -> list[float]:
    return [r["loss"] for r in metrics if r["event"] == "step"]


@pytest.mark.parametrize(
    "name", ["toy-fsdp2-layer", "toy-tp2", "toy-pp2", "tied-fsdp2-layer", "tied-ddp", "tied-hsdp"]
)
def test_own_model_matches_one_process_at_every_step(runs, name):
    reference = _losses(runs[f"{name.split('-')[0]}-single"])
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.5
    assert_close_lists(_losses(runs[name]), reference, 1e-5)


@pytest.fixture
def code_allowed():
    """In-process plans import the model file, as with ``--allow-code`` (fsdp2lab.consent)."""
    with consent.granted():
        yield


def test_units_are_inferred_and_tied_weights_stay_tied(model_file, code_allowed):
    plan = resolve(TrainConfig(model=f"{model_file}:build", dataset="synthetic", vocab_size=64), 2)
    assert plan.units == ("blocks.0", "blocks.1", "blocks.2")
    head, emb = plan.meta_model.head, plan.meta_model.emb
    assert head.weight is emb.weight and plan.params_total == 64 * 32 + 3 * (
        2 * 32 + 8 * 32 * 32 + 5 * 32
    )
    assert (
        resolve(
            TrainConfig(model=f"{model_file}:build", fsdp_unit_class="Linear", vocab_size=64), 1
        ).units[0]
        == "blocks.0.up"
    )


@pytest.mark.slow  # the README's test command stays under 15 minutes
def test_own_model_resumes_bitwise_and_exports_into_a_fresh_build(model_file, tmp_path):
    flags = ["--model", f"{model_file}:build", "--model-args", "d=32,n_blocks=3", *COMMON,
             "--nproc-per-node", "2", "--fsdp-units", "layer"]  # fmt: skip
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    ckpt = tmp_path / "ckpt"
    half = [*flags, "--ckpt-dir", str(ckpt), "--ckpt-every-steps", "10"]
    for args in (
        [*flags, "--metrics-file", str(straight)],
        [*half, "--max-steps", "10", "--metrics-file", str(tmp_path / "first.jsonl")],
        [*half, "--metrics-file", str(resumed)],
    ):
        proc = run_cli(["train", *args], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(read_metrics(resumed)) == _losses(read_metrics(straight))[10:]  # bitwise
    exported = tmp_path / "model.pt"
    assert cli.main(["ckpt", "export", str(ckpt), str(exported)]) == 0
    spec = importlib.util.spec_from_file_location("toy_fresh", model_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = module.build(d=32, n_blocks=3)
    fresh.load_state_dict(torch.load(exported, weights_only=True))
    assert fresh.head.weight is fresh.emb.weight


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "no_such_module_xyz:build"], "cannot import no_such_module_xyz"),
        (["--model", "{file}:missing"], "has no 'missing'"),
        (["--model", "{file}:NOT_A_MODEL"], "is not a factory or ModelSpec"),
        (["--model", "{file}:blocks"], "calling it with no arguments"),
        (["--model", "{file}:build", "--model-args", "d=32,bogus=1"], "unexpected keyword"),
        (["--model", "{file}:build", "--dataset", "mnist"], "does not take the data's batches"),
        (
            ["--model", "{file}:build", "--input-shape", "1,28,28"],
            "does not take the data's batches",
        ),
        (["--model", "{bad}:build"], "cannot import .*ZeroDivisionError"),
        (["--model", "{nomodule}:build"], "returned int, not a torch.nn.Module"),
    ],
)
def test_bad_own_model_is_one_message_and_exit_2(model_file, tmp_path, capsys, flags, message):
    bad = tmp_path / "bad.py"
    bad.write_text("1 / 0\n")
    nomodule = tmp_path / "nomodule.py"
    nomodule.write_text("def build():\n    return 3\n")
    flags = [f.format(file=model_file, bad=bad, nomodule=nomodule) for f in flags]
    if "--dataset" not in flags:
        flags += ["--dataset", "synthetic"]
    flags += ["--vocab-size", "64"]
    code = cli.main(["train", *flags, "--nproc-per-node", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("fsdp2lab: error: "), err
    assert re.search(message, err), err


def test_a_run_builds_the_model_once(model_file, monkeypatch, tmp_path, code_allowed):
    """The plan is resolved once per process and the factory called once (on the meta device):
    the trainer parallelises a copy of the plan's meta model."""
    import torch.distributed as dist

    from fsdp2lab.models import user
    from fsdp2lab.runtime.distributed import Runtime
    from fsdp2lab.training.session import run_training

    calls = []
    original = user._call_factory
    monkeypatch.setattr(user, "_call_factory", lambda *a: calls.append(1) or original(*a))
    cfg = TrainConfig(model=f"{model_file}:build", dataset="synthetic", synthetic_size=64,
                      max_steps=2, progress="off", seq_len=16, vocab_size=64)  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        summary = run_training(resolve(cfg, 1), Runtime(0, 1, 0, torch.device("cpu"), "gloo"))
    finally:
        dist.destroy_process_group()
    assert summary["steps"] == 2 and len(calls) == 1


DATA_FILE = textwrap.dedent(
    """
    import torch
    from torch.utils.data import TensorDataset


    def data():
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 64, (96, 16), generator=g)
        return TensorDataset(x, x.roll(-1, dims=1)), TensorDataset(x[:32], x[:32].roll(-1, dims=1))


    def images():
        x = torch.randn(40, 3, 8, 8)
        y = torch.zeros(40, dtype=torch.long)
        return TensorDataset(x, y), TensorDataset(x, y)


    def doubled(output, target):
        return 2 * torch.nn.functional.cross_entropy(
            output.reshape(-1, output.shape[-1]), target.reshape(-1)
        )
    """
)


@pytest.mark.slow  # the README's test command stays under 15 minutes
def test_own_dataset_loss_and_toml_model_args(model_file, tmp_path):
    data = tmp_path / "mydata.py"
    data.write_text(DATA_FILE)
    config = tmp_path / "run.toml"
    config.write_text(f'model = "{model_file}:build"\n[model_args]\nd = 32\nn_blocks = 2\n')
    flags = ["--config", str(config), "--allow-code", "--dataset", f"{data}:data", "--vocab-size", "64",
             "--seq-len", "16", "--global-batch-size", "16", "--max-steps", "6", "--dropout", "0",
             "--log-every-steps", "1", "--progress", "off", "--nproc-per-node", "2"]  # fmt: skip
    runs = {}
    for name, extra in {"ce": [], "doubled": ["--loss", f"{data}:doubled"]}.items():
        metrics = tmp_path / f"{name}.jsonl"
        proc = run_cli(["train", *flags, *extra, "--metrics-file", str(metrics)], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "96 train / 32 test samples" in proc.stdout
        runs[name] = read_metrics(metrics)
    ce, doubled = _losses(runs["ce"]), _losses(runs["doubled"])
    assert doubled[0] == pytest.approx(2 * ce[0], rel=1e-6)  # the same first batch and weights
    (summary,) = [r for r in runs["ce"] if r["event"] == "summary"]
    assert summary["params_total"] == 64 * 32 + 2 * (2 * 32 + 8 * 32 * 32 + 5 * 32)
    # Batches the model cannot take: one line from rank 0, exit code 2.
    proc = run_cli(["train", *flags, "--dataset", f"{data}:images"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("does not take the data's batches") == 1
    assert proc.stderr.startswith("fsdp2lab: error: "), proc.stderr


def test_model_args_parse_json_values():
    from fsdp2lab.models.user import parse_model_args

    assert parse_model_args("d=64, sizes=[1,2,3],name=x, tied=true") == {
        "d": 64, "sizes": [1, 2, 3], "name": "x", "tied": True
    }  # fmt: skip
