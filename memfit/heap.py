"""glibc's heap, from Python: hand free pages back to the OS, and give large allocations their own mmap.

Why here: training (activations freed every step) and serving (a model converted or repacked at load, its
transient copies freed) both leave freed memory in RSS as heap fragments until glibc is told otherwise.
Every function is a no-op where libc is not glibc. ``status_kib`` reads what the kernel counts of the process
(VmRSS, VmHWM), which is how training's plans and serve's fit measure it.
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD_BYTES = 1 << 20
"""CPU allocations from this size up get their own mmap, returned to the OS the moment they are freed."""
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def map_large_allocations() -> bool:
    """glibc: serve every allocation >= MMAP_THRESHOLD_BYTES by mmap, fixed for the rest of the process.

    Why: glibc's mmap threshold starts at 128 KiB but rises to the size of each mmapped block freed, up
    to 32 MiB. After one training step nearly every activation (4 x 1024 x 640 fp32 is 10 MiB) lands on
    the heap instead, between longer-lived tensors, and what the forward frees stays in RSS as fragments
    until a trim: on Gemma 3 270M (LoRA, chunked CE, batch 4 x 1024) the second step peaked 1.8 GiB above
    the first. A fixed threshold also stops the rise. The price is page faults on fresh pages: 13-24% longer
    steps there (docs/training.md has the A/B). Skipped when the user set MALLOC_MMAP_THRESHOLD_ (their choice:
    speed over memory) and where libc is not glibc. Returns whether it was applied."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _glibc()
    return bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release_free_memory() -> None:
    """Hand free heap pages back to the OS (glibc malloc_trim): small tensors freed between forward and
    backward, or a load's transient copies, would otherwise stay in RSS as heap fragments."""
    libc = _glibc()
    if libc:
        libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    global _LIBC
    if _LIBC is None:
        try:
            lib = ctypes.CDLL("libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except OSError:
            _LIBC = False  # not glibc
    return _LIBC or None


_LIBC: ctypes.CDLL | bool | None = None


def status_kib(field: str, pid: str = "self") -> int:
    """A field of /proc/PID/status in KiB (VmRSS: resident now, VmHWM: the peak); 0 where it has none."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0
