"""The only reasons a test may skip under CI=true (tests/conftest.py fails every other skip).

Tests skip with these reasons, never with their own text:

- ``NO_GPU``: no CUDA device here (refused where ``torch.cuda.is_available()`` is True);
- ``fewer_gpus(needed, here)``: the test needs more GPUs than this machine has;
- ``other_torch(needs, what)``: in a ``compat`` test only, a branch for another torch version:
  ``needs``, a version specifier (``">=2.15"``: the versions the branch is known to run on, of
  those the compat stage tests), must be false for the installed torch;
- ``pytest.importorskip(PKG)`` of an extra's package (``EXTRA_STAGES``) outside that extra's
  stage (the stage installs it): in a test, or a module, marked with the stage's marker, in a run
  that does not select it. A module's collection skip is judged by the module's own
  ``pytestmark``; the dev extra's packages (tokenizers, safetensors) are never missing.
"""

from __future__ import annotations

import re

NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"
# The package of each extra whose absence may skip a test, and the marker of the stage installing it.
# torchao (the qlora extra) is installed by the hf stage, whose tests also need PEFT for LoRA.
EXTRA_STAGES = {"transformers": "hf", "pyarrow": "hf", "torchao": "hf", "peft": "hf"}


def fewer_gpus(needed: int, here: int) -> str:
    return f"needs {needed} GPUs, {here} here"


def other_torch(needs: str, what: str) -> str:
    """The reason of a branch that runs on torch ``needs`` (a specifier: ``">=2.15"``)."""
    return f"the other torch version's branch: needs torch {needs}: {what}"


_FEWER_GPUS = re.compile(r"needs (\d+) GPUs, (\d+) here")
_OTHER_TORCH = re.compile(r"the other torch version's branch: needs torch (\S+): \S.*", re.DOTALL)
_IMPORTORSKIP = re.compile(r"could not import '([\w.]+)': .*", re.DOTALL)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _torch_version() -> str:
    import torch

    return torch.__version__


def torch_matches(needs: str, version: str) -> bool | None:
    """Whether torch ``version`` satisfies the specifier ``needs``; None if it is none."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import Version

    try:
        return SpecifierSet(needs).contains(Version(version).base_version, prereleases=True)
    except InvalidSpecifier:
        return None


def allowed(
    reason: str,
    selected,
    marks: set[str],
    *,
    cuda: bool | None = None,
    torch_version: str | None = None,
) -> bool:
    """Whether a skip for ``reason`` is allowed. ``selected(marker)``: whether this run's ``-m``
    selects that marker's tests; ``marks``: the markers of the test (or the module) that skips;
    ``cuda`` and ``torch_version`` default to this machine's."""
    reason = reason.removeprefix("Skipped: ")
    if reason == NO_GPU:
        return not (_cuda_available() if cuda is None else cuda)
    if match := _FEWER_GPUS.fullmatch(reason):
        return int(match[1]) > int(match[2])
    if match := _OTHER_TORCH.fullmatch(reason):
        version = _torch_version() if torch_version is None else torch_version
        return "compat" in marks and torch_matches(match[1], version) is False
    match = _IMPORTORSKIP.fullmatch(reason)
    stage = match and EXTRA_STAGES.get(match[1].split(".")[0])
    return bool(stage) and stage in marks and not selected(stage)
