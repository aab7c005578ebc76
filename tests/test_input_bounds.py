"""A Hugging Face config is input from elsewhere: ``config.json`` of ``--model hf:DIR`` and the
``hf_config`` a checkpoint records are checked before transformers builds anything. Sizes that
are not positive integers, remote code (``auto_map``, ``trust_remote_code``) and attention
implementations that are not transformers' own (a hub kernel) are one line and exit code 2; an
error of transformers' own while building is one line too. Nothing is fetched, nothing is asked.
"""

from __future__ import annotations

import io
import json
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp2lab import cli
from fsdp2lab.checkpoint import layout
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.plan import resolve_here

pytestmark = [
    pytest.mark.hf,
    pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning"),
]
transformers = pytest.importorskip("transformers")

LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
KERNEL = "kernels-community/flash-attn2"


def hf_folder(where: Path, **changes) -> Path:
    """A model folder holding only ``config.json`` (a tiny Llama's, with ``changes``)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return where


def check(folder: Path) -> None:
    resolve_here(TrainConfig(model=f"hf:{folder}", dataset="synthetic", seq_len=16), 1)


# Each config.json change and the one line it gives ({d}: the folder).
BAD_CONFIGS = {
    "no-attention-heads": (
        {"num_attention_heads": 0},
        "--model hf:{d}: num_attention_heads is 0 in config.json, not a positive integer",
    ),
    "negative-vocabulary": (
        {"vocab_size": -5},
        "--model hf:{d}: vocab_size is -5 in config.json, not a positive integer",
    ),
    "layers-not-a-number": (
        {"num_hidden_layers": "x"},
        "--model hf:{d}: num_hidden_layers is 'x' in config.json, not a positive integer",
    ),
    "trust-remote-code": (
        {"trust_remote_code": True},
        "--model hf:{d}: the model needs remote code (trust_remote_code in config.json), which "
        "fsdp2lab does not run",
    ),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_config_values_are_one_line_before_any_worker(case, tmp_path, capsys):
    changes, message = BAD_CONFIGS[case]
    folder = hf_folder(tmp_path / "m", **changes)
    with pytest.raises(UsageError) as raised:
        check(folder)
    assert str(raised.value) == message.format(d=folder)
    args = ["train", "--model", f"hf:{folder}", "--dataset", "synthetic", "--seq-len", "16",
            "--nproc-per-node", "2", "--progress", "off", "--max-steps", "1"]  # fmt: skip
    assert cli.main(args) == 2
    assert capsys.readouterr().err == f"fsdp2lab: error: {message.format(d=folder)}\n"


def test_an_error_of_transformers_while_building_is_one_line(tmp_path):
    """A value fsdp2lab does not check (an activation transformers does not know): the model
    cannot be built, and transformers' error is one line naming the folder."""
    folder = hf_folder(tmp_path / "m", hidden_act="no-such-activation")
    with pytest.raises(UsageError) as raised:
        check(folder)
    assert str(raised.value).startswith(f"--model hf:{folder}: no model from its config.json (")
    assert "no-such-activation" in str(raised.value)


@pytest.fixture
def no_network(monkeypatch):
    """Every connection and name lookup fails the test: a hub kernel must not be fetched."""
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("a connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield attempts
    assert attempts == [], attempts


@pytest.mark.parametrize("key", ["attn_implementation", "_attn_implementation"])
def test_a_hub_kernel_attention_is_refused_without_a_connection(key, tmp_path, no_network):
    folder = hf_folder(tmp_path / "m", **{key: KERNEL})
    with pytest.raises(UsageError) as raised:
        check(folder)
    assert str(raised.value).startswith(
        f"--model hf:{folder}: {key} '{KERNEL}' in config.json is not one of transformers' own "
        "attentions (eager, "
    )
    assert str(raised.value).endswith("): no kernel is fetched from the hub")
    check(hf_folder(tmp_path / "ok", **{key: "eager"}))  # transformers' own: taken


# ---------------------------------------------------------------------------- a recorded config
def _checkpoint(path: Path, hf_config: dict) -> Path:
    """A step folder holding one model tensor, whose run recorded ``hf_config``."""
    layout.mark_own(path)
    dcp.save({"model": {"w": torch.ones(2, 3)}}, checkpoint_id=path, no_dist=True)
    layout.mark_complete(path, {"step": 1, "contents": ["model"], "hf_config": hf_config})
    return path


# A model type transformers has no causal LM of, so that transformers asks whether to run the
# auto_map's code (a known one takes its own class without asking).
REMOTE = {"model_type": "vit", "auto_map": {"AutoModelForCausalLM": "evil.EvilModel"}}


@pytest.mark.parametrize(
    ("hf_config", "why"),
    [
        (REMOTE, "the model needs remote code (auto_map in the config), which fsdp2lab does not "
         "run"),
        ({**LLAMA, "attn_implementation": KERNEL}, f"attn_implementation '{KERNEL}' in the config "
         "is not one of transformers' own attentions"),
    ],
    ids=["auto_map", "hub-kernel"],
)  # fmt: skip
def test_a_recorded_config_asking_for_code_is_refused_by_export_without_a_prompt(
    tmp_path, monkeypatch, capsys, no_network, hf_config, why
):
    """The recorded ``hf_config`` names a module in the folder it names (``evil.py``, which
    leaves a file when imported): ``ckpt export`` refuses it, and transformers' [y/N] prompt
    never comes, though the answer on stdin would be y."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    sentinel = tmp_path / "code-ran"
    (model_dir / "evil.py").write_text(
        f"open({str(sentinel)!r}, 'w').close()\n"
        "from transformers import PreTrainedModel as EvilModel\n"
    )
    step = _checkpoint(tmp_path / "ckpt" / "step-1", {**hf_config, "_name_or_path": str(model_dir)})
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    out = tmp_path / "out"
    code = cli.main(["ckpt", "export", str(step), str(out)])
    assert asked == [] and not sentinel.exists()
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert err.startswith("fsdp2lab: error: no Hugging Face causal LM from this config: ")
    assert why in err and err.count("\n") == 1, err
