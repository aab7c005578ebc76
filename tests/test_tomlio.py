"""fsdp2lab.tomlio, the one TOML writer (the resolved config, bench's config.toml files): what it
writes, ``tomllib`` reads back as it was."""

from __future__ import annotations

import sys

import pytest

from fsdp2lab import tomlio
from fsdp2lab.bench.sweep import to_toml as sweep_to_toml
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

AWKWARD = [
    'C:\\Users\\o"brien\\data',
    "line one\nline two\r\n",
    "tab\there",
    "unicode: é 日本 🙂",
    "# not a comment = still a value",
    "control \x00 \x1b \x7f \b \f",
    "",
    '\'single\' and """triple"""',
    "trailing backslash \\",
]


@pytest.mark.parametrize("text", AWKWARD)
def test_strings_round_trip_through_tomllib(text):
    values = {"data_dir": text, "bare-key": 1, "odd key.x": text}
    assert tomllib.loads(tomlio.dumps(values)) == values
    assert tomllib.loads(sweep_to_toml({"text_file": text})) == {"text_file": text}


def test_the_resolved_config_reads_back_as_it_was():
    cfg = TrainConfig(
        data_dir=AWKWARD[0],
        text_file=AWKWARD[1] + AWKWARD[3],
        metrics_file=AWKWARD[4],
        lr=1e-5,
        max_grad_norm=float("inf"),
        prefetch=2,
        download=False,
    )
    text = cfg.to_toml()
    assert not text.endswith("\n") and "# batch_size = (unset)" in text.splitlines()
    assert TrainConfig(**tomllib.loads(text)) == cfg


def test_none_and_other_values():
    assert tomlio.dumps({"a": None}, unset_as_comment=True) == "# a = (unset)\n"
    assert tomlio.value(float("nan")) == "nan" and tomlio.value(-float("inf")) == "-inf"
    with pytest.raises(TypeError, match="a must be a string, number or boolean, got None"):
        tomlio.dumps({"a": None})
    with pytest.raises(UsageError, match=r"epochs must be a string, number or boolean, got \[1\]"):
        sweep_to_toml({"epochs": [1]})
