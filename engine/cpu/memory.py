"""glibc's malloc told to keep freed memory while a CPU engine runs, so each pass does not
page-fault its activations afresh; glibc's environment settings win."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc refuses more than HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit
TRIM_THRESHOLD = 1 << 30
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the thresholds above (once per process); return whether they are in force."""
    if any(name in os.environ for name in _USER_SETTINGS):
        logger.info("malloc settings come from the environment; leaving them as they are")
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.warning("mallopt refused the CPU engine's malloc thresholds")
    return ok


def _mallopt():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
