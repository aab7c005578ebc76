"""The only reasons a test may skip under CI=true (tests/conftest.py fails every other skip).

Tests skip with these reasons, never with their own text:

- ``NO_GPU``: no CUDA device here;
- ``fewer_gpus(needed, here)``: the test needs more GPUs than this machine has;
- ``other_torch(what)``: a branch for another torch version than the installed one (the compat
  stage runs each version);
- ``pytest.importorskip(PKG)`` of an extra's package (``EXTRA_STAGES``) outside that extra's
  stage (the stage installs it): a module collected in a run that does not select the stage's
  marker, or a test marked with it in such a run.
"""

from __future__ import annotations

import re
from collections.abc import Callable

NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"
# The package of each extra whose absence may skip a test, and the marker of the stage installing it.
EXTRA_STAGES = {"transformers": "hf", "tokenizers": "hf", "pyarrow": "hf"}


def fewer_gpus(needed: int, here: int) -> str:
    return f"needs {needed} GPUs, {here} here"


def other_torch(what: str) -> str:
    return f"the other torch version's branch: {what}"


_ALLOWED = (
    re.compile(re.escape(NO_GPU)),
    re.compile(r"needs (\d+) GPUs, (\d+) here"),
    re.compile(r"the other torch version's branch: \S.*"),
)
_IMPORTORSKIP = re.compile(r"could not import '([\w.]+)': .*", re.DOTALL)


def allowed(reason: str, in_stage: Callable[[str], bool]) -> bool:
    """Whether a skip for ``reason`` is allowed; ``in_stage(marker)``: whether the skip happens
    within that marker's stage."""
    reason = reason.removeprefix("Skipped: ")
    for pattern in _ALLOWED:
        match = pattern.fullmatch(reason)
        if match:
            return pattern is not _ALLOWED[1] or int(match[1]) > int(match[2])
    match = _IMPORTORSKIP.fullmatch(reason)
    stage = match and EXTRA_STAGES.get(match[1].split(".")[0])
    return bool(stage) and not in_stage(stage)
