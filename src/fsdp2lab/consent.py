"""What a file may make fsdp2lab do: consent is given on the command line, and only there.

The command line registers what its user typed (:func:`register`): ``--allow-code``,
``--allow-paths`` and the values of flags such as ``--model my.py:build``. Nothing registered
means no. Two gates ask it:

- :func:`require_code`, inside every function that imports named code (``module:NAME``,
  ``file.py:NAME``): a reference typed as its flag's value, or any with ``--allow-code``;
- :func:`check_output_path`: an output path a config or sweep file names must stay inside the
  working directory (relative, no ``..``, no symlink out), unless typed or ``--allow-paths``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from fsdp2lab.errors import UsageError

ALLOW_CODE_HELP = (
    "run the code (module:NAME, file.py:NAME) that a config or sweep file names as model, "
    "dataset or loss; without it such a file is refused (code typed on the command line runs)"
)
ALLOW_PATHS_HELP = (
    "let a config or sweep file name output paths (save_model, ckpt_dir, metrics_file, ...) "
    "outside the working directory; without it such a file is refused (paths typed on the "
    "command line are yours)"
)


@dataclasses.dataclass(frozen=True)
class Consent:
    allow_code: bool = False
    allow_paths: bool = False
    typed: frozenset[tuple[str, str]] = frozenset()  # (key, value) the command line gave


_state = Consent()


def register(
    *, allow_code: bool = False, allow_paths: bool = False, typed: Iterable[tuple[str, Any]] = ()
) -> None:
    """What this process's command line says (replacing what an earlier command said)."""
    global _state
    pairs = frozenset((k, v) for k, v in typed if isinstance(v, str))
    _state = Consent(bool(allow_code), bool(allow_paths), pairs)


def reset() -> None:
    """Back to no consent at all."""
    register()


@contextlib.contextmanager
def granted(
    *, allow_code: bool = True, allow_paths: bool = False, typed: Iterable[tuple[str, Any]] = ()
) -> Iterator[None]:
    """Consent for the ``with`` block only (in-process callers: tests, scripts)."""
    before = _state
    register(allow_code=allow_code, allow_paths=allow_paths, typed=typed)
    try:
        yield
    finally:
        restore(before)


def current() -> Consent:
    """This process's consent (for a process it starts: :func:`restore` there)."""
    return _state


def restore(state: Consent) -> None:
    global _state
    _state = state


def was_typed(key: str, value: Any) -> bool:
    """Whether the command line gave ``value`` as ``key``'s value."""
    return (key, value) in _state.typed


def typed_flags(values: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """``--key value`` for each of ``keys`` whose value in ``values`` the command line typed (what
    a ``bench`` run gets on its own command line, so that it is the user's there too)."""
    flags: list[str] = []
    for key in keys:
        if was_typed(key, values.get(key)):
            flags += [f"--{key.replace('_', '-')}", values[key]]
    return flags


def code_refused(label: str, reference: str) -> UsageError:
    return UsageError(
        f"{label} {reference!r} names code, which runs only with --allow-code (give it only for "
        "a file you trust as a script you run)"
    )


def allows_code(key: str, reference: str) -> bool:
    return _state.allow_code or was_typed(key, reference)


def require_code(key: str, reference: str, label: str) -> None:
    """The gate before ``reference`` is imported: typed as ``key``'s value, or ``--allow-code``."""
    if not allows_code(key, reference):
        raise code_refused(label, reference)


def outside_reason(path: str) -> str | None:
    """Why ``path`` does not stay inside the working directory, else None."""
    p = Path(path)
    if p.is_absolute():
        return "is an absolute path"
    if ".." in p.parts:
        return "has a '..' component"
    here = Path.cwd().resolve()
    if not (here / p).resolve().is_relative_to(here):
        return "leads out of the working directory through a symlink"
    return None


def check_output_path(key: str, path: str, where: str, typed_as: str) -> None:
    """An output path a file names (``where``): inside the working directory, typed on the
    command line, or ``--allow-paths``; else a UsageError naming the flag (``typed_as``)."""
    if _state.allow_paths or was_typed(key, path):
        return
    if why := outside_reason(path):
        raise UsageError(
            f"{where}: {key} {path!r} {why}; a file names output paths only inside the working "
            f"directory: give it on the command line ({typed_as} {path}) or add --allow-paths"
        )
