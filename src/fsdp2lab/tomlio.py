"""The one TOML writer: flat ``key = value`` lines of scalars, which ``tomllib`` reads back as given.

Used for ``TrainConfig.to_toml`` (the resolved config a run prints and TensorBoard stores) and for
the per-run ``config.toml`` files of ``fsdp2lab bench``. Strings are TOML basic strings, escaped per
the TOML 1.0 spec; the text is UTF-8 (write it with ``encoding="utf-8"``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}
# What a basic string may not hold as itself: the quote, the backslash, control characters.
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\x7f]')


def string(text: str) -> str:
    """``text`` as a TOML basic string, quotes included."""
    escaped = _NEEDS_ESCAPE.sub(lambda m: _ESCAPES.get(m[0]) or f"\\u{ord(m[0]):04X}", text)
    return f'"{escaped}"'


def key(name: str) -> str:
    """``name`` as a TOML key: bare where it may be, else quoted."""
    return name if _BARE_KEY.fullmatch(name) else string(name)


def value(v: Any) -> str:
    """A bool, int, float or str as TOML; TypeError for anything else (None included)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # nan, inf, -inf, 1e-05 and 0.5 are TOML floats as Python writes them
    if isinstance(v, str):
        return string(v)
    raise TypeError(f"must be a string, number or boolean, got {v!r}")


def dumps(values: Mapping[str, Any], *, unset_as_comment: bool = False) -> str:
    """``key = value`` lines, one per item, newline-terminated.

    TOML has no null: a None value is a TypeError, or with ``unset_as_comment`` the line
    ``# key = (unset)`` (reading the text back leaves the key at its default).
    """
    lines = []
    for name, v in values.items():
        if v is None and unset_as_comment:
            lines.append(f"# {key(name)} = (unset)")
            continue
        try:
            lines.append(f"{key(name)} = {value(v)}")
        except TypeError as e:
            raise TypeError(f"{name} {e}") from None
    return "".join(line + "\n" for line in lines)
