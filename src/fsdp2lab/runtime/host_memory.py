"""``--host-malloc cached``: a rank keeps the host memory it frees for its next step's tensors.

A CPU training step allocates and frees the same activations, gradients and collective buffers
every step. glibc's malloc maps each block above its threshold (128 KiB, raised as such blocks are
freed) with a ``mmap`` of its own, unmaps it on ``free`` and trims the heap's free top above
128 KiB: the next step's identical tensors then fault in fresh zeroed pages
(tests/test_host_memory.py counts them). ``cached`` sets both thresholds
(``mallopt``): blocks up to 32 MiB (glibc's largest mmap threshold on 64-bit) come from the heap,
which is never trimmed, so a step reuses the pages of the last: no page faults, and a process's
resident memory stays at its peak, as with a GPU's caching allocator. ``system`` leaves the C
library's defaults.

Applied only where the C library is glibc and the user has not tuned malloc already (its
``MALLOC_*_`` variables or ``GLIBC_TUNABLES``, or another allocator preloaded); the reason is
returned otherwise.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2); -1 never trims.
MMAP_THRESHOLD = 32 * 1024 * 1024
NEVER_TRIM = -1
_USER_TUNED = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def user_tuned(env: Mapping[str, str]) -> str | None:
    """The user's own malloc setting that ``cached`` must not override, if any."""
    for name in _USER_TUNED:
        if name in env:
            return name
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    preload = env.get("LD_PRELOAD", "")
    return next((f"LD_PRELOAD {a}" for a in _OTHER_ALLOCATORS if a in preload), None)


def configure(mode: str, env: Mapping[str, str] | None = None) -> str:
    """Apply ``--host-malloc`` to this process; a sentence saying what was done."""
    if mode == "system":
        return "host malloc: the C library's defaults (--host-malloc system)"
    own = user_tuned(os.environ if env is None else env)
    if own:
        return f"host malloc: left as set by {own}"
    libc = _glibc()
    if libc is None:
        return "host malloc: the C library's defaults (not glibc)"
    if not (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        and libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
    ):
        return "host malloc: the C library's defaults (mallopt refused)"
    return "host malloc: cached (freed blocks up to 32 MiB stay in the process)"
